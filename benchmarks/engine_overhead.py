"""Per decode step host costs of the engine vs `model.generate` (CPU proxies of GPU costs),
and end-to-end useful tok/s on a long-tailed batch, tiny and medium random Llama shapes.

    .venv/bin/python benchmarks/engine_overhead.py [--rounds 3] [--quick]

See flexmarl/bench/engine_overhead.py for what is counted. Timings alternate the two decoders
round by round and report medians; on a shared machine they are noisy, the counts are not.
"""

import argparse

import torch

from flexmarl.bench.engine_overhead import (
    _model,
    decode_step_costs,
    grouped_requests,
    kv_footprint,
    long_tail_costs,
    print_kv_table,
    print_step_table,
    print_tail_table,
    requests,
    smollm_requests,
    use_cpu_clock,
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--cases", default="shapes,a,b,c",
                        help="comma list: shapes (the tiny/medium step tables), a (overhead-bound "
                             "model, batch 64, outputs 4..64), b (256-token prompts shared by "
                             "groups of 8), c (SmolLM2-135M, real tokenizer, chat prompts)")
    parser.add_argument("--c-requests", type=int, default=32,
                        help="case (c): chat requests, all in one batch (64 on a GPU)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    use_cpu_clock()  # this process's CPU time: a shared machine disturbs it less than wall time
    print("times: this process's CPU time, one torch thread; medians of alternating rounds")
    shapes = {"tiny": dict(hidden=64, layers=12, vocab=512),
              "medium": dict(hidden=512, layers=8, vocab=8192, inter=1376)}
    cases = set(args.cases.split(","))
    if "a" in cases:  # (a) overhead-bound: hidden 32, one layer, batch 64, outputs 4..64
        model = _model(32, 1, 512)
        reqs = requests(64, 512, 4, spread=16)
        print_tail_table("\n== (a) overhead-bound model (hidden 32, 1 layer, vocab 512), "
                         "64 requests, outputs 4..64, batch 64",
                         long_tail_costs(model, reqs, 64, rounds=args.rounds))
        print_kv_table("(a) KV memory", kv_footprint(model, reqs, 64))
    if "b" in cases:  # (b) GRPO: 8 prompts of 256 tokens, 8 samples each
        model = _model(256, 4, 2048)
        reqs = grouped_requests(8, 8, 2048)
        print_tail_table("\n== (b) 8 groups of 8 samples sharing a 256-token prompt "
                         "(hidden 256, 4 layers, vocab 2048), outputs 4..60, batch 64",
                         long_tail_costs(model, reqs, 64, rounds=args.rounds))
        print_kv_table("(b) KV memory", kv_footprint(model, reqs, 64))
    if "c" in cases:  # (c) SmolLM2-135M-Instruct on chat prompts (its real tokenizer)
        loaded = smollm_requests(args.c_requests)
        if loaded is None:
            print("\n== (c) skipped: SmolLM2 is not installed (see flexmarl/policy/smollm.py)")
        else:
            model, reqs = loaded
            print_tail_table(f"\n== (c) SmolLM2-135M-Instruct, {len(reqs)} chat prompts "
                             f"({min(len(r.prompt) for r in reqs)}-"
                             f"{max(len(r.prompt) for r in reqs)} tokens, chat template), outputs "
                             f"4..64, batch {len(reqs)}",
                             long_tail_costs(model, reqs, len(reqs), rounds=args.rounds))
            print_kv_table("(c) KV memory", kv_footprint(model, reqs, len(reqs)))
    for name, shape in shapes.items():
        if "shapes" not in cases or (args.quick and name != "tiny"):
            continue
        model = _model(shape["hidden"], shape["layers"], shape["vocab"], shape.get("inter"))
        params = sum(p.numel() for p in model.parameters()) / 1e6
        label = f"{name}: {params:.1f}M params, {shape['layers']} layers, vocab {shape['vocab']}"
        if name == "tiny":
            print_step_table(f"\n== decode step, batch 32, {label}",
                             decode_step_costs(model, 32, shape["vocab"], rounds=args.rounds))
        reqs = requests(48, shape["vocab"], 8)
        print_tail_table(f"\n== long-tailed batch, 48 requests, outputs 8..64, 16 at a time, "
                         f"{label}", long_tail_costs(model, reqs, 16, rounds=args.rounds))
