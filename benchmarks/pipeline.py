"""Sync vs async pipeline, side by side: `python benchmarks/pipeline.py [CONFIG] [--set k=v]`."""

import argparse

from flexmarl.bench.pipeline import bench_pipeline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/relay_chain.yaml")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    bench_pipeline(args.config, args.set, rounds=args.rounds)
