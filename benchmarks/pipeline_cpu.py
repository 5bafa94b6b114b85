"""CPU seconds per iteration, by process kind, rounds alternating: where the cores go, and
what the simulator charges for the same work.

`python benchmarks/pipeline_cpu.py CONFIG [--iterations N] [--rounds R] [--set k=v]
[--systems a,b] [--profile profile.json]` runs the config in both modes (or, with `--systems`,
as each of the `bench compare` systems) and prints per run, over its iterations after the
first: the wall time, the CPU seconds of the driver (this process), of the rollout replicas
and of the training slots (each worker process with its descendants, /proc), their sum, the
share of the machine's cores the run left idle, and the CPUs other users' work took meanwhile
(`OtherLoad`). If async did more work than sync the CPU seconds would show it; if the pipeline
only overlaps, async's wall time falls by at most what sync left idle.

With `--profile FILE[,FILE...]`, each configuration is also simulated once per profile (the
mirror, no other load) and its charged CPU seconds an iteration by the same kinds are printed
under the measured medians, over the same iterations (`MirrorResult.cpu_by_kind`): each
profile's excess or shortfall, kind by kind.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import prepare, train
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.machine import OtherLoad, tree_cpu_s, window_load
from flexmarl.sim.calibration.mirror import run_mirror

KINDS = ("driver", "rollout", "train")


def run(cfg: Any, out: Path) -> dict[str, float]:
    pids: dict[str, list[int]] = {"rollout": [], "train": []}
    marks: list[tuple[float, float, float, dict[str, float]]] = []

    def on_runtime(runtime: Any) -> None:
        for kind, pool in (("rollout", runtime.rollout), ("train", runtime.train)):
            pids[kind] = [w.process.pid for w in getattr(pool, "workers", [])
                          if getattr(w, "process", None) is not None]

    def mark(_: dict) -> None:
        by_kind = {k: sum(tree_cpu_s(p) or 0.0 for p in v) for k, v in pids.items()}
        marks.append((time.perf_counter(), time.process_time(), tree_cpu_s() or 0.0, by_kind))

    with OtherLoad(every=0.5) as others:
        t0 = time.perf_counter()
        train(cfg, out, on_iteration=mark, on_runtime=on_runtime)
    (wa, da, ta, ka), (wb, db, tb, kb) = marks[0], marks[-1]
    n = len(marks) - 1
    wall, total = (wb - wa) / n, (tb - ta) / n
    cores = os.cpu_count() or 1
    return {"wall": wall, "driver": (db - da) / n, "total": total,
            "rollout": (kb["rollout"] - ka["rollout"]) / n,
            "train": (kb["train"] - ka["train"]) / n,
            "idle": 1 - total / (cores * wall),
            "others": window_load(others.series, wa - t0, wb - t0, others.cpus)}


def simulated(cfg: Any, profile: LocalProfile) -> dict[str, float]:
    """The mirror's charged CPU seconds an iteration by kind (no other load)."""
    by_kind = run_mirror(cfg, prepare(cfg), profile, external=0.0).cpu_by_kind()
    return {**{k: by_kind.get(k, 0.0) for k in KINDS}, "total": sum(by_kind.values())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/longtail_experts.yaml")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--systems", default="", help="bench compare systems instead of modes")
    parser.add_argument("--profile", default="",
                        help="profile.json[,...]: also print the mirror's CPU charge")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="flexmarl-cpu-"))
    overrides = [*args.set, f"train.iterations={args.iterations}"]
    names = args.systems.split(",") if args.systems else ["sync", "async"]
    cfgs = {name: load_config(args.config, [
        *(system_overrides(name) + ["runtime.kind=local"] if args.systems
          else [f"pipeline.mode={name}"]), *overrides]) for name in names}
    profiles = {p: LocalProfile.load(p) for p in args.profile.split(",") if p}
    width = max(6, *(len(n) + 1 for n in names))
    print(f"{'run':<{width}}{'s/it':>7}{'driver':>8}{'rollout':>8}{'train':>8}{'total':>8}"
          f"{'idle':>6}{'others':>7}   (CPU s/it over the iterations after the first)")
    got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            f = run(cfgs[name], base / f"{name}-{r}")
            got[name].append(f)
            print(f"{name:<{width}}{f['wall']:>7.3f}{f['driver']:>8.3f}{f['rollout']:>8.3f}"
                  f"{f['train']:>8.3f}{f['total']:>8.3f}{f['idle']:>6.2f}{f['others']:>7.2f}",
                  flush=True)
    print("medians and the mirror's charge for the same work, CPU s/it:")
    print(f"{'run':<{width}}{'source':<40}{'driver':>8}{'rollout':>8}{'train':>8}{'total':>8}")
    for name, v in got.items():
        print(f"{name:<{width}}{'measured (median)':<40}" + "".join(
            f"{statistics.median(x[k] for x in v):>8.3f}" for k in (*KINDS, "total")))
        for path, prof in profiles.items():
            sim = simulated(cfgs[name], prof)
            print(f"{name:<{width}}{'mirror ' + Path(path).name[-33:]:<40}"
                  + "".join(f"{sim[k]:>8.3f}" for k in (*KINDS, "total")))
