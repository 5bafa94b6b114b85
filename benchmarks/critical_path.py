"""A real run's waits next to the mirror's for the same config (issue 31 item 5): where the
pipelined runs' wall time goes that their CPU seconds do not show.

`python benchmarks/critical_path.py examples/paper_workload.yaml --system flexmarl
--iterations 4 --rounds 1 --profile PROFILE.json [--runs DIR ...] [--json OUT.json]`

Each round runs the system for real (as `flexmarl bench compare` does: others' CPUs read over
its iterations), then the mirror of the same config from PROFILE with that load
(`run_mirror_measured`), and reads both traces' waits (`sim.calibration.waits`: wall time by
which pools were busy, the replica's and the slots' idle gaps by what ended them, busy time by
span kind), in seconds an iteration over the iterations after the first. `--runs` reads
finished runs instead (bench compare's SYSTEM-ROUND folders, their others' load from the
compare.json beside them) and runs nothing real. Prints real, simulated and their difference
per figure (medians over the rounds) and the load average.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import prepare, train
from flexmarl.sim.calibration.calibrate import SAMPLE_S
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.machine import IterationClock, OtherLoad, profiled_load, window_load
from flexmarl.sim.calibration.mirror import run_mirror_measured
from flexmarl.sim.calibration.waits import figures
from flexmarl.telemetry.recorder import read_trace

ORDER = ("state:both", "state:rollout", "state:train", "state:none",
         "busy:rollout:gen", "busy:rollout:load", "replica_wait:gen", "replica_wait:load",
         "busy:train:swap", "busy:train:acc", "busy:train:step", "busy:train:publish",
         "slot_wait:swap", "slot_wait:acc", "slot_wait:step", "slot_wait:publish")


def real_run(cfg, out: Path) -> tuple[list[dict], float]:
    with OtherLoad(every=SAMPLE_S) as during:
        clock = IterationClock(during.t0)
        result = train(cfg, out, on_iteration=clock.mark)
    whole = during.cpus if during.measured else 0.0
    makespan = float(result.records[-1]["time_s"])
    start, _ = clock.window() or (max(0.0, result.wall_s - makespan), result.wall_s)
    return result.records, window_load(during.series, start, start + makespan, whole)


def finished(run: Path) -> tuple[list[dict], float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.startswith('{"iteration"')]
    system, _, rnd = run.name.rpartition("-")
    saved = run.parent / "compare.json"
    load = 0.0
    if saved.exists():
        for row in json.loads(saved.read_text())["rows"]:
            if row["system"] == system and int(rnd) < len(row["other_load"]):
                load = float(row["other_load"][int(rnd)])
    return records, load


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--system", default="flexmarl")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--runs", nargs="*", default=[])
    parser.add_argument("--out", default="runs/critical_path")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    prof = LocalProfile.load(args.profile)
    if args.runs:
        cfgs = [load_config(Path(r) / "config.yaml") for r in args.runs]
    else:
        cfgs = [load_config(args.config, [*system_overrides(args.system), "runtime.kind=local",
                                          f"train.iterations={args.iterations}"])] * args.rounds
    task = prepare(cfgs[0])
    real: dict[str, list[float]] = {}
    sim: dict[str, list[float]] = {}
    for r, cfg in enumerate(cfgs):
        if args.runs:
            out = Path(args.runs[r])
            records, load = finished(out)
        else:
            out = Path(args.out) / f"{args.system}-{r}"
            records, load = real_run(cfg, out)
        trace = read_trace(out / "trace.json")
        assert trace is not None, f"{out}: no trace.json"
        n = len(records)
        got = figures(trace[0], trace[1], n)
        mirror = run_mirror_measured(cfg, task, prof, load,
                                     profiled_external=profiled_load(prof.machine))
        want = figures(mirror.spans, mirror.events, len(mirror.records))
        for k in {*got, *want}:
            real.setdefault(k, []).append(got.get(k, 0.0))
            sim.setdefault(k, []).append(want.get(k, 0.0))
        real.setdefault("s/iteration", []).append(float(records[-1]["time_s"]) / n)
        sim.setdefault("s/iteration", []).append(mirror.per_iteration_s)
        real.setdefault("others' CPUs", []).append(load)
        sim.setdefault("others' CPUs", []).append(mirror.other_cpus)
        print(f"round {r + 1}/{len(cfgs)} {out}: {real['s/iteration'][-1]:.3f} s/it real, "
              f"{sim['s/iteration'][-1]:.3f} simulated, others {load:.2f} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    keys = ["s/iteration", "others' CPUs", *ORDER,
            *sorted(k for k in real if k not in ORDER and k not in ("s/iteration",
                                                                   "others' CPUs"))]
    print(f"\n{args.system}: real vs mirror, seconds an iteration over the iterations after "
          f"the first (medians of {len(cfgs)} rounds; n_ = gaps an iteration)")
    print(f"{'figure':<26}{'real':>9}{'mirror':>9}{'mirror-real':>12}")
    for k in keys:
        if k not in real:
            continue
        a, b = statistics.median(real[k]), statistics.median(sim[k])
        print(f"{k:<26}{a:>9.3f}{b:>9.3f}{b - a:>+12.3f}")
    print(f"load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"real": real, "sim": sim}, indent=1))
