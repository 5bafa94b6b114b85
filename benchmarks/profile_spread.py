"""How much one profile differs from the next: several fresh profiles of one config, each
simulating the same systems, and the spread of what they predict.

`python benchmarks/profile_spread.py CONFIG [--profiles 3] [--systems a,b] [--reps 3]
[--iterations 4] [--before CHECKOUT] [--out DIR]` profiles CONFIG `--profiles` times with this
checkout's profiler (`profile_local`, each in its own process, as `bench compare` and
`simulate --profile-local` do); with `--before`, alternately with the profiler of another
checkout of the project (e.g. a worktree of main: its code on PYTHONPATH), so both see the same
drift of the machine's load. Every profile is then simulated with this checkout's mirror (no
other load: what the profile alone predicts) as each of `--systems`, and the table prints per
profile the worker scales, two costs (a decode step's fixed part, accumulate's per token) and
the driver's CPU an iteration in a real sync run and its async factor, accumulate's overlap
with a busy replica (nan for an older profiler), and each system's simulated s/iteration, then
per code its spread over the profiles,
(max - min) / median, and the other load during each profiling.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import prepare
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.mirror import run_mirror

PROFILE = """
import sys
from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import prepare
from flexmarl.sim.calibration.profile import profile_local
cfg = load_config(sys.argv[1], ["runtime.kind=local"])
profile_local(cfg, prepare(cfg), reps=int(sys.argv[3])).save(sys.argv[2])
"""

SCALES = ("rollout", "train_bind", "train_accumulate", "train_step")
EXTRA = ("drv sync", "drv x", "ovl acc")


def profile_with(code: str, config: str, out: Path, reps: int) -> LocalProfile:
    env = {**os.environ, "PYTHONPATH": code}
    subprocess.run([sys.executable, "-c", PROFILE, config, str(out), str(reps)], env=env,
                   check=True, cwd=code)
    return LocalProfile.load(out)


def spread(xs: list[float]) -> float:
    mid = statistics.median(xs)
    return (max(xs) - min(xs)) / mid if mid else 0.0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/paper_workload.yaml")
    parser.add_argument("--profiles", type=int, default=3)
    parser.add_argument("--systems", default="flexmarl,flexmarl-sync")
    parser.add_argument("--reps", type=int, default=3, help="the profiler's repeats (compare: 3)")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--before", default="", help="another checkout to alternate with")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    config = str(Path(args.config).resolve())
    out = Path(args.out or tempfile.mkdtemp(prefix="flexmarl-spread-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    codes = {"after": str(Path.cwd())}
    if args.before:
        codes = {"before": str(Path(args.before).resolve()), **codes}
    systems = args.systems.split(",")
    cfgs = {s: load_config(config, [*system_overrides(s), "runtime.kind=local",
                                    f"train.iterations={args.iterations}"]) for s in systems}
    task = prepare(cfgs[systems[0]])
    got: dict[str, list[dict[str, float]]] = {c: [] for c in codes}
    head = (f"{'code':<7}{'#':>2}{'others':>7}" + "".join(f"{k.replace('train_', ''):>11}"
                                                        for k in SCALES)
            + f"{'decode 1':>10}{'acc/tok':>9}" + "".join(f"{k:>9}" for k in EXTRA)
            + "".join(f"{s:>16}" for s in systems))
    print(head, flush=True)
    for i in range(args.profiles):
        for code, path in (codes.items() if i % 2 == 0 else reversed(codes.items())):
            prof = profile_with(path, config, out / f"{code}-{i}.json", args.reps)
            agent = next(iter(prof.agents.values()))
            row = {**{k: prof.scale(k) for k in SCALES},
                   "decode 1": agent.fits["decode"].coef.get("1", 0.0) * 1e3,
                   "acc/tok": agent.fits["accumulate"].coef.get("tokens", 0.0) * 1e6,
                   "others": float(prof.machine.get("other_load", 0.0)),
                   # the driver's CPU an iteration of a real sync run, its async factor, and
                   # accumulate's cost next to a busy replica (nan: an older profiler's)
                   "drv sync": prof.driver.get("sync_per_iteration_s", float("nan")),
                   "drv x": prof.driver.get("pipelined", float("nan")),
                   "ovl acc": prof.overlap.get("train_accumulate", float("nan"))}
            for s, cfg in cfgs.items():
                row[s] = run_mirror(cfg, task, prof, external=0.0).per_iteration_s
            got[code].append(row)
            print(f"{code:<7}{i + 1:>2}{row['others']:>7.2f}"
                  + "".join(f"{row[k]:>11.2f}" for k in SCALES)
                  + f"{row['decode 1']:>10.3f}{row['acc/tok']:>9.1f}"
                  + "".join(f"{row[k]:>9.3f}" for k in EXTRA)
                  + "".join(f"{row[s]:>16.3f}" for s in systems), flush=True)
    print("spread over the profiles, (max - min) / median:")
    for code, rows in got.items():
        print(f"{code:<7}   " + "".join(f"{spread([r[k] for r in rows]):>11.0%}" for k in SCALES)
              + f"{spread([r['decode 1'] for r in rows]):>10.0%}"
              + f"{spread([r['acc/tok'] for r in rows]):>9.0%}"
              + "".join(f"{spread([r[k] for r in rows]):>9.0%}" for k in EXTRA)
              + "".join(f"{spread([r[s] for r in rows]):>16.0%}" for s in systems))
    (out / "spread.json").write_text(json.dumps(got, indent=1))
    print(f"profiles: {out}")
