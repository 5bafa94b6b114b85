"""Publication MB/s trainer -> replicas, `runtime.publication` pipe against collective, side by
side in one run with alternating rounds:

    python benchmarks/publication.py --sizes 10,100,700 --replicas 1,2 --rounds 3

On the CPU the collective is gloo over loopback TCP; on a machine with more GPUs than replicas
it is NCCL between GPUs (`benchmarks/gpu_check.py` runs it too). The machine's noise shows in the
min-max of the rounds.
"""

import argparse
import os

from flexmarl.bench.publication import measure, table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10,100,700", help="MB, comma-separated")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rows = measure([float(s) for s in args.sizes.split(",")],
                   [int(n) for n in args.replicas.split(",")], args.rounds, args.device,
                   args.dtype)
    print(f"publication trainer -> replicas, {args.device}, {args.dtype}, {os.cpu_count()} "
          f"CPU cores, median of {args.rounds} alternating rounds")
    print(table(rows))
