"""Regenerate `docs/sim/results.md` and its Gantt pictures: every workload in `examples/sim`,
FlexMARL against every baseline and ablation, in one run of the simulator.

    python benchmarks/sim_results.py [--iterations 6] [--out docs/sim] [--workload NAME ...]

The table's figures are the simulator's; only the *real s* column depends on this machine.
"""

import argparse
import contextlib
import datetime
import io
import shutil
import tempfile
from pathlib import Path

from flexmarl.sim.simulate import ABLATIONS, BASELINES, simulate

WORKLOADS = ["paper_ma", "paper_ca", "star_hub", "customer_service", "planner_coder_reviewer",
             "math_debate", "solver_verifier"]
PICTURES = ["star_hub", "customer_service"]  # the two largest graphs

HEADER = """# Simulated cluster results

Made with `python benchmarks/sim_results.py --iterations {iterations}` on {date}: for each
workload, `flexmarl simulate examples/sim/<workload>.yaml --iterations {iterations}` with every
baseline and ablation ({systems}). The columns:
- *speedup*: that system's s/iteration divided by FlexMARL's;
- *util*: busy accelerator-seconds / total accelerator-seconds;
- *util x*: FlexMARL's utilisation divided by that system's;
- *lower bound*: max(the on-policy pipeline's per-iteration cycle, work / capacity), from that
  system's own run (so it differs between systems);
- *efficiency*: lower bound / s per iteration;
- *real s*: wall time of that one simulation on a 2-core machine shared with other jobs;
- *cpu s*: the CPU seconds that simulation took (what the machine's load does not inflate).

Pictures: {pictures} (one panel per system; one lane per worker, at most an equal number of
lanes per pool and agent; colour = agent; solid = rollout, hatched = training).

"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--out", default="docs/sim")
    parser.add_argument("--workload", action="append", default=None,
                        help=f"one of {', '.join(WORKLOADS)}; repeatable (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = ["flexmarl", *BASELINES, *ABLATIONS]
    tables = []
    for name in args.workload or WORKLOADS:
        with tempfile.TemporaryDirectory() as tmp:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                simulate(f"examples/sim/{name}.yaml", systems, args.iterations, out=tmp,
                         pictures=name in PICTURES)
            lines = [ln for ln in buf.getvalue().splitlines()
                     if not ln.startswith(("trace:", "gantt:"))]
            print("\n".join(lines), flush=True)
            tables.append("\n".join(lines))
            if name in PICTURES:
                shutil.copy(Path(tmp) / "gantt.png", out / f"{name}_gantt.png")
    header = HEADER.format(
        iterations=args.iterations, date=datetime.date.today().isoformat(),
        systems=", ".join(f"`{s}`" for s in systems[1:]),
        pictures=" and ".join(f"`{p}_gantt.png`" for p in PICTURES))
    (out / "results.md").write_text(header + "```\n" + "\n".join(tables) + "\n```\n")
    print(f"wrote {out / 'results.md'}")


if __name__ == "__main__":
    main()
