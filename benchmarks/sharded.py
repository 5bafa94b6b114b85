"""Sharded (FSDP2) training of one agent at K ranks, side by side in alternating rounds:

    python benchmarks/sharded.py --ks 1,2 --hidden 256 --layers 4 --rounds 2

Per-rank bytes of parameters / gradients / optimizer state (goal at K=2: <= 0.55x of K=1), step,
swap and publication time, and the largest model whose training state fits --budget-gb per
device at each K. Prints a table, then one JSON line per K.
"""

import argparse
import json
import os

from flexmarl.bench.sharded import measure, table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ks", default="1,2", help="ranks per slot, comma-separated")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="rows per step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-gb", type=float, default=80.0)
    args = parser.parse_args()
    rows = measure([int(k) for k in args.ks.split(",")], args.hidden, args.layers, args.steps,
                   args.rows, args.rounds, args.budget_gb)
    print(f"sharded training (FSDP2, gloo, cpu), hidden {args.hidden}, {args.layers} layers, "
          f"{rows[0]['n_params'] / 1e6:.2f} M params, {args.rows} rows/step, {os.cpu_count()} "
          f"CPU cores (shared), median of {args.rounds} alternating rounds; 'fits': the "
          f"largest model whose params+grads+AdamW state fit {args.budget_gb} GB per device")
    print(table(rows))
    for r in rows:
        print(json.dumps(r))
