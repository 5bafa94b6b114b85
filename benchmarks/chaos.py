"""Random faults vs a fault-free run of the same seed:
`python benchmarks/chaos.py [CONFIG] [--kills K] [--fault process|actor|node] [--set k=v]`.

Local: `--fault process` (SIGKILL of worker processes). Ray (`--set runtime.kind=ray`):
`--fault actor` (ray.kill of worker actors, default on Ray) or `--fault node` (whole nodes of a
`ray.cluster_utils.Cluster` built here, `--nodes N` of `--node-cpus C`, removed and replaced)."""

import argparse
import sys

from flexmarl.bench.chaos import ChaosError, bench_chaos

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/relay_chain.yaml")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--fault", choices=["process", "actor", "node"], default=None,
                        help="default: process locally, actor on Ray")
    parser.add_argument("--nodes", type=int, default=2, help="--fault node: worker nodes")
    parser.add_argument("--node-cpus", type=float, default=2.0, help="--fault node: per node")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    overrides = ["train.iterations=30", "runtime.rollout_workers=2", *args.set]
    on_ray = any(o.replace(" ", "") == "runtime.kind=ray" for o in overrides)
    fault = args.fault or ("actor" if on_ray else "process")
    if fault != "process" and not on_ray:
        overrides.append("runtime.kind=ray")
    try:
        bench_chaos(args.config, overrides, kills=args.kills, seed=args.seed, out=args.out,
                    fault=fault, nodes=args.nodes, node_cpus=args.node_cpus)
    except ChaosError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
