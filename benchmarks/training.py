"""Training-engine benchmark: `python benchmarks/training.py [--model smollm2|random]`.

Prints (a) swap MB/s host<->disk and between two processes for a full training state,
(b) AgentTrainer vs plain PyTorch tokens/s on the same batches, (c) 3 agents on 1/2/3 slots.
"""

import argparse

import torch

from flexmarl.bench.training import (
    _agent,
    _batches,
    bench_overhead,
    bench_slots,
    bench_swap,
    trl_same_step,
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip", default="", help="letters of parts to skip, e.g. 'a' or 'ab'")
    parser.add_argument("--slots-config", default="examples/relay_chain.yaml")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        model, vocab = {"kind": "smollm2"}, 49152
    else:  # a mid-sized random Llama for machines without the smollm extra
        model = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 4}
        vocab = 4096
    if "a" not in args.skip:
        full = _agent(model, None)
        r = bench_swap(full, vocab, _batches(vocab, 1, 2, 32, 8)[0])
        print(f"(a) full training state of {args.model} (weights + AdamW + grads): "
              f"{r['state_mb']:.0f} MB", flush=True)
        print(f"    {'path':<22} {'swap-out MB/s':>14} {'swap-in MB/s':>13} {'out+in MB/s':>12}")
        print(f"    {'host <-> disk':<22} {r['disk_out_mbs']:>14.0f} {r['disk_in_mbs']:>13.0f} "
              f"{r['disk_pair_mbs']:>12.0f}")
        print(f"    {'process <-> process':<22} {r['proc_out_mbs']:>14.0f} "
              f"{r['proc_in_mbs']:>13.0f} {r['proc_pair_mbs']:>12.0f}", flush=True)
    if "b" not in args.skip:
        lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        cfg = _agent(model, lora if args.model == "smollm2" else None)
        r = bench_overhead(cfg, vocab, _batches(vocab, 2, 8, 48, 12, seed=1), args.rounds)
        print(f"(b) one agent, {r['tokens']} tokens per iteration, {args.rounds} rounds "
              f"alternating ({'LoRA' if cfg.lora else 'full'} {args.model}):")
        print(f"    FlexMARL AgentTrainer: {r['flexmarl_tps']:.1f} tokens/s")
        print(f"    plain PyTorch loop:    {r['plain_tps']:.1f} tokens/s")
        print(f"    framework overhead:    {100 * r['overhead']:+.1f}%", flush=True)
        same = trl_same_step(cfg, vocab, _batches(vocab, 1, 8, 48, 12, seed=1)[0]) \
            if cfg.lora is None else None
        if same is not None:
            print(f"    same step as TRL's:    loss {same['loss']:.6f} vs {same['trl_loss']:.6f}, "
                  f"grad norm {same['grad_norm']:.6f} vs {same['trl_grad_norm']:.6f}")
        if "trl_tps" in r:
            print(f"    TRL GRPOTrainer loss:  {r['trl_tps']:.1f} tokens/s (same batches, no "
                  "generation)")
            print(f"    FlexMARL step / TRL's: {r['vs_trl']:.2f}x time (goal <= 0.80)",
                  flush=True)
        else:
            print("    (TRL: not installed; pip install 'flexmarl[bench]' to compare)")
    if "c" not in args.skip:
        rows = bench_slots(args.slots_config, ["train.iterations=5", "runtime.torch_threads=1"],
                           [1, 2, 3])
        print(f"(c) 3 agents ({args.slots_config}), training slots 1/2/3:")
        print(f"    {'slots':>5} {'train busy frac':>16} {'s/iteration':>12} {'swaps':>6}")
        for row in rows:
            print(f"    {row['slots']:>5} {row['busy']:>16.2f} {row['wall']:>12.3f} "
                  f"{row['swaps']:>6}")
