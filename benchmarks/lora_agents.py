"""Adapter agents on one shared base vs separate models:
`python benchmarks/lora_agents.py [--model smollm2|tiny] [--agents 1,2,4,8]`.

Prints, per number of agents N: resident memory of a rollout replica and of a training slot,
rollout tokens/s of a mixed batch vs per-agent batches vs a single-agent batch of the same
size; then the swap time of an adapter agent vs a full-model agent; then the targets (memory
for 8 adapter agents <= 1.3x one agent's; mixed batch >= 0.8x a single-agent batch), each with
its figure and PASS or MISS.
"""

import argparse

import torch
import transformers

from flexmarl.bench.lora_agents import (
    MODELS,
    replica_memory,
    rollout_speed,
    swap_time,
    trainer_memory,
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--agents", default="1,2,4,8", help="the values of N")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rollout batch")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=16, help="new tokens per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars
    model, vocab = MODELS[args.model]
    ns = [int(x) for x in args.agents.split(",")]
    if args.model == "smollm2":
        from flexmarl.policy.smollm import ensure_cache

        ensure_cache()  # a clear error when the smollm extra is missing
    print(f"{args.model}, LoRA r=8 on q_proj/v_proj; rollout: {args.batch} sequences x "
          f"{args.prompt} prompt + {args.new} new tokens, {args.threads} thread(s), tokens per "
          f"CPU second, median of {args.rounds}", flush=True)
    head = (f"{'N':>2} | {'replica MB':>10} {'separate':>9} | {'trainer MB':>10} "
            f"{'separate':>9} | {'mixed tok/s':>11} {'per-agent':>9} {'single':>7} "
            f"{'mixed/single':>12}")
    print(head)
    print("-" * len(head), flush=True)
    rows = {}
    for n in ns:
        rep = replica_memory(model, vocab, n)
        trn = trainer_memory(model, vocab, n)
        spd = rollout_speed(model, vocab, n, args.batch, args.prompt, args.new, args.rounds)
        rows[n] = (rep, trn, spd)
        print(f"{n:>2} | {rep['shared_mb']:>10.1f} {rep['separate_mb']:>9.1f} | "
              f"{trn['shared_mb']:>10.1f} {trn['separate_mb']:>9.1f} | "
              f"{spd['mixed_tps']:>11.1f} {spd['per_agent_tps']:>9.1f} "
              f"{spd['single_tps']:>7.1f} {spd['ratio']:>12.2f}", flush=True)
    print(f"memory per added adapter agent: replica {rows[ns[-1]][0]['adapter_mb']:.2f} MB")
    sw = swap_time(model, vocab, args.rounds)
    print(f"swap out+in (capture, wire, restore; CPU s): adapter agent "
          f"{sw['adapter_s'] * 1e3:.1f} ms "
          f"({sw['adapter_mb']:.1f} MB), full-model agent {sw['full_s'] * 1e3:.1f} ms "
          f"({sw['full_mb']:.1f} MB): {sw['full_s'] / sw['adapter_s']:.0f}x", flush=True)

    if 1 in rows and max(ns) > 1:
        top = max(ns)
        for what, i in (("replica", 0), ("trainer", 1)):
            ratio = rows[top][i]["shared_mb"] / rows[1][i]["shared_mb"]
            ok = ratio <= 1.3
            print(f"target {what} memory, {top} adapter agents / 1: {ratio:.3f}x (<= 1.3) "
                  f"{'PASS' if ok else 'MISS'}")
    for n, (_, _, spd) in rows.items():
        ok = spd["ratio"] >= 0.8
        print(f"target mixed batch / single-agent batch, N={n}: {spd['ratio']:.2f}x (>= 0.8) "
              f"{'PASS' if ok else 'MISS'}")
