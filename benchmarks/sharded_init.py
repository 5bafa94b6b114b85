"""Peak RSS per rank while a sharded slot builds its agent: full model on every rank (before)
against the meta-device init (after), side by side in alternating rounds:

    python benchmarks/sharded_init.py --ks 2 --hidden 1024 --layers 8 --rounds 2

Prints a table, then one JSON line per (K, init path, rank).
"""

import argparse
import json
import os

from flexmarl.bench.sharded_init import measure, table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ks", default="2", help="ranks per slot, comma-separated")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = measure([int(k) for k in args.ks.split(",")], args.hidden, args.layers, args.rounds)
    print(f"sharded slot init (FSDP2, gloo, cpu), hidden {args.hidden}, {args.layers} layers, "
          f"{rows[0]['n_params'] / 1e6:.1f} M params ({rows[0]['n_params'] * 4 / 2**20:.0f} MB "
          f"float32), {os.cpu_count()} CPU cores (shared, load {os.getloadavg()[0]:.1f}), "
          f"median of {args.rounds} alternating rounds; 'added at peak': peak RSS less RSS "
          "before the build")
    print(table(rows))
    for r in rows:
        print(json.dumps(r))
