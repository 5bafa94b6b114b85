"""Static vs hierarchical rollout balancing on a skewed workload, plus the batching speedup.

    .venv/bin/python benchmarks/rollout.py [examples/skewed_rollout.yaml] [--set key=value ...]
"""

import argparse

from flexmarl.bench.rollout import bench_rollout

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/skewed_rollout.yaml")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench_rollout(args.config, args.set, args.out)
