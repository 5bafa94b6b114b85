"""CPU seconds per iteration, sync against async, rounds alternating: where the cores go.

`python benchmarks/pipeline_cpu.py CONFIG [--iterations N] [--rounds R] [--set k=v]` runs the
config in both modes and prints per run, over its iterations after the first: the wall time,
the driver's CPU seconds (this process) and the workers' (its process tree less itself), their
sum, the share of the machine's cores the run left idle, and the CPUs other users' work took
meanwhile (`OtherLoad`). If async did more work than sync the CPU seconds would show it; if the
pipeline only overlaps, async's wall time falls by at most what sync left idle.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from flexmarl.sim.calibration.machine import OtherLoad, tree_cpu_s, window_load


def run(config: str, overrides: list[str], mode: str, out: Path) -> dict[str, float]:
    marks: list[tuple[float, float, float]] = []  # (wall, driver CPU, tree CPU) per iteration

    def mark(_: dict) -> None:
        marks.append((time.perf_counter(), time.process_time(), tree_cpu_s() or 0.0))

    cfg = load_config(config, [*overrides, f"pipeline.mode={mode}"])
    with OtherLoad(every=0.5) as others:
        t0 = time.perf_counter()
        train(cfg, out, on_iteration=mark)
    (wa, da, ta), (wb, db, tb) = marks[0], marks[-1]
    n = len(marks) - 1
    wall, driver, total = (wb - wa) / n, (db - da) / n, (tb - ta) / n
    cores = os.cpu_count() or 1
    return {"wall": wall, "driver": driver, "workers": total - driver, "total": total,
            "idle": 1 - total / (cores * wall),
            "others": window_load(others.series, wa - t0, wb - t0, others.cpus)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/longtail_experts.yaml")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="flexmarl-cpu-"))
    overrides = [*args.set, f"train.iterations={args.iterations}"]
    got: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    print(f"{'mode':<6}{'s/it':>7}{'driver CPU s/it':>16}{'workers CPU s/it':>17}"
          f"{'total CPU s/it':>15}{'cores idle':>11}{'others CPUs':>12}")
    for r in range(args.rounds):
        for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            f = run(args.config, overrides, mode, base / f"{mode}-{r}")
            got[mode].append(f)
            print(f"{mode:<6}{f['wall']:>7.3f}{f['driver']:>16.3f}{f['workers']:>17.3f}"
                  f"{f['total']:>15.3f}{f['idle']:>11.2f}{f['others']:>12.2f}", flush=True)
    print("medians: " + "; ".join(
        f"{m} {statistics.median(x['wall'] for x in v):.3f} s/it, "
        f"{statistics.median(x['total'] for x in v):.3f} CPU s/it" for m, v in got.items()))
