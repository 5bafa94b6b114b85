"""How far is FlexMARL's planned rollout/training split from the best fixed one?

Runs the simulator once with the hierarchical planner's own choice, then once per fixed split
(`--fix AGENT=REPLICAS[,AGENT=REPLICAS...]`, repeatable): those agents' rollout replicas are
pinned for every iteration and training gets every other accelerator, agent-centric. The
best fixed split is an oracle the planner cannot know in advance; the gap between the two is
what a better planner could win, the gap to the lower bound is what it cannot.

    python benchmarks/sim_split_sweep.py examples/sim/math_debate.yaml --iterations 6 \\
        --fix solver_a=4,solver_b=4,solver_c=4 --fix solver_a=5,solver_b=5,solver_c=5
"""

import argparse
import dataclasses

from flexmarl.sim.simulate import SYSTEMS, simulate_system
from flexmarl.sim.workload import load_workload


def parse_fix(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        agent, sep, n = part.partition("=")
        if not sep or not n.strip().isdigit():
            raise SystemExit(f"--fix: expected AGENT=REPLICAS, got {part!r}")
        out[agent.strip()] = int(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--fix", action="append", default=[], type=parse_fix,
                    help="AGENT=REPLICAS[,AGENT=REPLICAS...]; repeatable, one run each")
    args = ap.parse_args()
    wl = load_workload(args.workload)
    base = SYSTEMS["flexmarl"][2]
    runs = [("planner", None)] + [
        (",".join(f"{a}={n}" for a, n in fix.items()),
         dataclasses.replace(base, fixed_replicas=fix)) for fix in args.fix]
    print(f"workload {wl.name}: flexmarl, {args.iterations} iterations")
    print(f"{'split':<44}{'s/iteration':>12}{'vs planner':>11}{'util':>6}{'efficiency':>11}"
          f"{'rollout acc':>12}")
    planned = None
    for label, features in runs:
        try:
            r = simulate_system(wl, "flexmarl", args.iterations, features=features)
        except ValueError as e:
            raise SystemExit(f"--fix {label}: {e}") from None
        planned = planned or r.per_iteration_s
        plan = r.runtime.plans[-1]
        print(f"{label:<44}{r.per_iteration_s:>12.1f}{r.per_iteration_s / planned:>11.2f}"
              f"{r.utilisation:>6.2f}{r.efficiency:>11.2f}{plan['rollout_accelerators']:>12}")
    print("(vs planner = that split's s/iteration / the planner's; efficiency = lower bound /"
          " s per iteration)")


if __name__ == "__main__":
    main()
