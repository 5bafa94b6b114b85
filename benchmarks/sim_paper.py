"""The paper-shaped workloads next to the FlexMARL paper's Tables 2 and 3, and a sensitivity
sweep over the assumptions the ratios hang on.

    python benchmarks/sim_paper.py [--iterations 10] [--sweep-iterations 4] [--no-sweep]

Prints, for `examples/sim/paper_ma.yaml` and `paper_ca.yaml`, each system's s/iteration and
the ratios the paper reports (arXiv 2602.09578 v1, as quoted in issue 21): MARTI / FlexMARL
(1.38 MA, 1.43 CA), MAS-RL / FlexMARL (7.3, 5.6), no load balancing / FlexMARL (1.21, MA) and
no async pipeline / FlexMARL (2.03, MA), with the simulator's efficiency against its lower
bound and the wall and CPU time of each simulation. The sweep varies one assumption of
paper_ma at a time: the training cost (MFU of training, i.e. the training share of a step),
episodes per iteration, the output-length tail (log-normal sigma of the specialists) and the
cluster size. Every figure is the simulator's; only *real s* and *cpu s* depend on this
machine.
"""

import argparse
import time

from flexmarl.sim.cost import Efficiency
from flexmarl.sim.simulate import simulate_system
from flexmarl.sim.workload import load_workload

# (system, what it stands for, paper MA, paper CA); the ratio is system / flexmarl
ROWS = [
    ("marti", "MARTI", 1.38, 1.43),
    ("mas-rl-like", "MAS-RL", 7.3, 5.6),
    ("flexmarl-static-balance", "no load balancing (Table 3)", 1.21, None),
    ("flexmarl-sync", "no async pipeline (Table 3)", 2.03, None),
]
EXTRA = ["marti-2025-05"]


def run(wl, iterations, cost=None):
    out = {}
    for system in ["flexmarl"] + [r[0] for r in ROWS]:
        t0 = time.perf_counter()
        res = simulate_system(wl, system, iterations, cost=cost)
        out[system] = (res, time.perf_counter() - t0)
    return out


def table(name, wl, iterations):
    out = run(wl, iterations)
    for system in EXTRA:
        t0 = time.perf_counter()
        out[system] = (simulate_system(wl, system, iterations), time.perf_counter() - t0)
    flex = out["flexmarl"][0]
    col = 2 if name == "paper_ma" else 3
    print(f"workload {name}: {wl.cluster.nodes} nodes x {wl.cluster.accelerators_per_node} "
          f"{wl.cluster.accelerator.name}, {len(wl.agents)} agents, "
          f"{wl.episodes_per_iteration} episodes/iteration, {iterations} iterations")
    print(f"{'system':<24}{'s/iteration':>12}{'ratio':>8}{'paper':>8}{'within 25%':>11}"
          f"{'efficiency':>11}{'real s':>8}{'cpu s':>7}")
    for system, (res, real) in out.items():
        ratio = res.per_iteration_s / flex.per_iteration_s
        paper = next((r[col] for r in ROWS if r[0] == system), None)
        p = f"{paper:.2f}" if paper else "-"
        ok = ("yes" if abs(ratio / paper - 1) <= 0.25 else "no") if paper else "-"
        print(f"{system:<24}{res.per_iteration_s:>12.1f}{ratio:>8.2f}{p:>8}{ok:>11}"
              f"{res.efficiency:>11.2f}{real:>8.1f}{res.cpu_s:>7.1f}")
    print()


def sweep(iterations):
    base = load_workload("examples/sim/paper_ma.yaml")
    data = base.model_dump(mode="json")
    cases = []
    for mfu in (0.4, 0.1, 0.04, 0.02):
        cases.append((f"training MFU {mfu}", base,
                      base.cost_model(efficiency=Efficiency(mfu_train=mfu))))
    for prompts in (16, 64):
        d = {**data, "rollout": {**data["rollout"], "prompts_per_iteration": prompts}}
        wl = type(base).model_validate(d)
        cases.append((f"episodes {prompts * 16}", wl, None))
    for sigma in (0.5, 1.3):
        d = {**data, "agents": [
            {**a, "output_length": {**a["output_length"], "sigma": sigma}}
            if a["name"].startswith("solver") else a for a in data["agents"]]}
        cases.append((f"solver tail sigma {sigma}", type(base).model_validate(d), None))
    d = {**data, "cluster": {**data["cluster"], "nodes": 12}}
    cases.append(("cluster 12 nodes", type(base).model_validate(d), None))
    print(f"sweep on paper_ma, one assumption at a time ({iterations} iterations; base: MFU "
          f"0.4, 64 episodes, sigma 0.9, 48 nodes); ratio = system s/iteration / FlexMARL's")
    print(f"{'case':<26}{'flexmarl s':>11}" + "".join(f"{r[0][:14]:>16}" for r in ROWS)
          + f"{'flex eff':>9}")
    print(f"{'paper (MA)':<26}{126.1:>11.1f}" + "".join(f"{r[2]:>16.2f}" for r in ROWS))
    for label, wl, cost in cases:
        out = run(wl, iterations, cost)
        flex = out["flexmarl"][0]
        ratios = [out[r[0]][0].per_iteration_s / flex.per_iteration_s for r in ROWS]
        print(f"{label:<26}{flex.per_iteration_s:>11.1f}"
              + "".join(f"{x:>16.2f}" for x in ratios) + f"{flex.efficiency:>9.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--sweep-iterations", type=int, default=4)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    for name in ("paper_ma", "paper_ca"):
        table(name, load_workload(f"examples/sim/{name}.yaml"), args.iterations)
    if not args.no_sweep:
        sweep(args.sweep_iterations)


if __name__ == "__main__":
    main()
