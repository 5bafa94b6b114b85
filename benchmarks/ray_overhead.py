"""Ray vs local orchestration overhead: `python benchmarks/ray_overhead.py [--address H:P]`."""

import argparse

from flexmarl.bench.ray_overhead import bench_ray_overhead

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--address", default=None, help="an existing cluster (default: start one)")
    args = parser.parse_args()
    bench_ray_overhead(args.rounds, args.micro_batch, args.address)
