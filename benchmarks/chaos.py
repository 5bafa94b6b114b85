"""Random worker kills vs a fault-free run of the same seed:
`python benchmarks/chaos.py [CONFIG] [--kills K] [--set k=v]`."""

import argparse

from flexmarl.bench.chaos import bench_chaos

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/relay_chain.yaml")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    overrides = ["train.iterations=30", "runtime.rollout_workers=2", *args.set]
    bench_chaos(args.config, overrides, kills=args.kills, seed=args.seed, out=args.out)
