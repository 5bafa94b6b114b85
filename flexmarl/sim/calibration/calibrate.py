"""`flexmarl simulate --profile-local CONFIG`: the simulator against this machine.

1. profile the config's agents on this machine (`profile`; the profile JSON is written to
   OUT/profile.json, and `--profile FILE` reuses one);
2. run the real config on the local runtime for N iterations, `pipeline.mode=sync` and then
   `async` (OUT/real-sync, OUT/real-async: the usual run folders);
3. simulate the same config, both modes, on the mirrored local runtime (`mirror`),
   each with the other users' load its real run saw (`OtherLoad` during it: their CPU time
   from /proc/stat, niced work left out) next to the load the profile was measured under, the
   same measure over the profiling (`machine.profiled_load`): load that changed between the
   profile and the run is simulated (`CpuShare`); the spinning probe before and after each run
   is reported;
4. print measured vs simulated seconds per iteration (makespan / N, from the runs' `time_s`)
   and the relative error (and the simulation without the load correction), and write
   OUT/calibration.json (`resimulate` reruns the mirror on its measurements).

The error is reported, not enforced: timing on a shared machine is noisy.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.config.schema import RunConfig, load_config
from flexmarl.orchestrator.run import prepare, train
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.machine import (
    IterationClock,
    OtherLoad,
    host_speed,
    machine_info,
    measure_external_load,
    profiled_load,
    speed_probe,
    window_load,
)
from flexmarl.sim.calibration.mirror import (
    MirrorResult,
    mirror_config,
    per_iteration,
    run_mirror,
    run_mirror_measured,
)
from flexmarl.sim.calibration.profile import profile_local

TOLERANCE = 0.25  # issue 6, item 6: within 25% of the measured local makespan
SAMPLE_S = 0.5  # the other load's series during a real run: one point every SAMPLE_S


@dataclass
class CalibrationRow:
    mode: str
    measured_s: float  # seconds per iteration, whole run (makespan / N)
    simulated_s: float
    measured_steady_s: float  # iterations after the first
    simulated_steady_s: float
    real_wall_s: float  # the real run's wall time, worker start-up included
    external_load: float = 0.0  # other users' work (CPUs) measured during the real run
    probe_load: float = 0.0  # the spinning probe before and after it (reported)
    simulated_unloaded_s: float = 0.0  # the mirror without the load correction (as profiled)
    load_series: list[tuple[float, float]] | None = None  # (s since the run's start, CPUs)
    niced_load: float = 0.0  # other users' niced work (CPUs), left out of external_load

    @property
    def error(self) -> float:
        return (self.simulated_s - self.measured_s) / self.measured_s if self.measured_s else 0.0

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "measured_s_per_iteration": self.measured_s,
                "simulated_s_per_iteration": self.simulated_s, "error": self.error,
                "within_25pct": self.within, "measured_steady_s": self.measured_steady_s,
                "simulated_steady_s": self.simulated_steady_s, "real_wall_s": self.real_wall_s,
                "external_load": self.external_load, "probe_load": self.probe_load,
                "simulated_unloaded_s_per_iteration": self.simulated_unloaded_s,
                "unloaded_error": self.unloaded_error, "load_series": self.load_series,
                "niced_load": self.niced_load}

    @property
    def unloaded_error(self) -> float:
        m = self.measured_s
        return (self.simulated_unloaded_s - m) / m if m and self.simulated_unloaded_s else 0.0


def _local(config: str | Path, overrides: list[str] | None = None) -> tuple[RunConfig, Any]:
    """The config on the local runtime (whatever its `runtime.kind`), and its task."""
    cfg = load_config(config, overrides)
    if cfg.runtime.kind != "local":
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"kind": "local"})})
    return cfg, prepare(cfg)


def load_or_profile(cfg: RunConfig, task: Any, profile: str | Path | None, out: Path,
                    reps: int, log: Any) -> LocalProfile:
    """A saved profile, or one measured now and written to OUT/profile.json."""
    if profile is not None:
        log(f"profile: {profile} (reused)")
        return LocalProfile.load(profile)
    log(f"profiling {cfg.name} on this machine (torch_threads={cfg.runtime.torch_threads})")
    t0 = time.perf_counter()
    prof = profile_local(cfg, task, reps=reps, log=lambda s: log(f"  {s}"))
    log(f"profile: {prof.save(out / 'profile.json')} ({time.perf_counter() - t0:.1f} s)")
    return prof


def calibrate(config: str | Path, overrides: list[str] | None = None, iterations: int = 5,
              out: str | Path | None = None, profile: str | Path | None = None,
              modes: tuple[str, ...] = ("sync", "async"),
              log: Any = print, reps: int = 5) -> list[CalibrationRow]:
    cfg, task = _local(config, overrides)
    out = Path(out or Path("runs") / "calibrate" / cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    prof = load_or_profile(cfg, task, profile, out, reps, log)
    rows: list[CalibrationRow] = []
    sims: dict[str, MirrorResult] = {}
    loads = {"before": machine_info()["loadavg"]}
    prof_load = profiled_load(prof.machine)
    for mode in modes:
        mcfg = mirror_config(cfg, iterations, mode)
        log(f"real run: {cfg.name}, pipeline.mode={mode}, {iterations} iterations "
            f"-> {out / f'real-{mode}'}")
        probe, host = measure_external_load(), speed_probe()
        with OtherLoad(every=SAMPLE_S) as during:
            clock = IterationClock(during.t0)
            real = train(mcfg, out / f"real-{mode}", on_iteration=clock.mark)
        records, wall = real.records, real.wall_s
        probe = (probe + measure_external_load()) / 2  # before and after the run
        # around the run: the least reading (`speed_probe`)
        speed = host_speed(prof.machine, min(host, speed_probe()))
        # others' CPU time over the run's iterations (its start-up and teardown left out, as
        # `bench compare` reads it); the probe only where there is no /proc/stat
        window = clock.window()
        external = probe if not during.measured else (
            window_load(during.series, *window, during.cpus) if window else during.cpus)
        loads[f"after_{mode}"] = machine_info()["loadavg"]
        # the profiled costs hold the load they were measured under: the mirror simulates the
        # run's other load next to the profile's (`CpuShare`), and without it for comparison
        sim = run_mirror_measured(cfg, task, prof, external, iterations=iterations, mode=mode,
                                  profiled_external=prof_load, speed=speed)
        plain = run_mirror(cfg, task, prof, iterations=iterations, mode=mode)
        sims[mode] = sim
        mean, steady = per_iteration(records)
        rows.append(CalibrationRow(mode, mean, sim.per_iteration_s, steady,
                                   sim.steady_per_iteration_s, wall, external,
                                   probe_load=probe, simulated_unloaded_s=plain.per_iteration_s,
                                   load_series=list(during.series), niced_load=during.niced))
    print_table(cfg.name, rows, iterations, loads, prof_load)
    (out / "calibration.json").write_text(json.dumps({
        "config": str(config), "iterations": iterations, "tolerance": TOLERANCE,
        "machine": machine_info(), "loadavg": loads,
        "profile": str(profile or out / "profile.json"),
        "profiled_load": prof_load, "rows": [r.to_dict() for r in rows],
        "simulated_records": {m: s.records for m, s in sims.items()},
    }, indent=2, default=str))
    log(f"calibration: {out / 'calibration.json'}")
    return rows


def print_table(name: str, rows: list[CalibrationRow], iterations: int,
                loads: dict[str, Any], profile_load: float = 0.0) -> None:
    print(f"calibration of {name}: {iterations} iterations on this machine "
          f"({os.cpu_count()} CPUs, load average {loads})")
    print(f"{'mode':<7}{'measured s/it':>15}{'simulated s/it':>16}{'error':>9}"
          f"{'within 25%':>12}{'other load':>12}{'as profiled':>13}   steady s/it (meas / sim)")
    for r in rows:
        print(f"{r.mode:<7}{r.measured_s:>15.3f}{r.simulated_s:>16.3f}{r.error:>+9.1%}"
              f"{'yes' if r.within else 'NO':>12}{r.external_load:>12.2f}"
              f"{r.unloaded_error:>+13.1%}"
              f"   {r.measured_steady_s:.3f} / {r.simulated_steady_s:.3f}")
    print("(s/it = makespan / iterations, from the runs' time_s; steady leaves out the first "
          "iteration; other load = CPUs' worth of other users' work during the real run "
          "(/proc/stat less this run's own CPU time, niced work left out), simulated next to "
          f"the profile's {profile_load:.2f}; as profiled = the "
          "error without that (the profile's load throughout); the error is reported, not "
          "enforced)")


def resimulate(calibration: str | Path, profile: str | Path | None = None,
               external: str = "mean", log: Any = print) -> list[CalibrationRow]:
    """Rerun the mirror on a calibration's measurements (OUT/calibration.json and its profile):
    `external` "mean" simulates each run's mean other load, "series" its sampled series (mapped
    onto the simulated run by the fraction of the real run elapsed), "none" the profile's load
    throughout (no correction)."""
    data = json.loads(Path(calibration).read_text())
    prof = LocalProfile.load(profile or data["profile"])
    cfg, task = _local(data["config"])
    n = int(data["iterations"])
    prof_load = profiled_load(prof.machine)
    rows = []
    for row in data["rows"]:
        mode, measured = row["mode"], float(row["measured_s_per_iteration"])
        ext = float(row.get("external_load", 0.0))
        plain = run_mirror(cfg, task, prof, iterations=n, mode=mode)
        sim = plain
        if external != "none":
            sim = run_mirror_measured(cfg, task, prof, ext, iterations=n, mode=mode,
                                      profiled_external=prof_load)
        if external == "series" and row.get("load_series"):
            series = series_in_virtual_time(row["load_series"], ext, measured * n,
                                            float(row["real_wall_s"]), sim.makespan_s)
            sim = run_mirror(cfg, task, prof, iterations=n, mode=mode, external=series,
                             profiled_external=prof_load)
        rows.append(CalibrationRow(mode, measured, sim.per_iteration_s,
                                   float(row["measured_steady_s"]), sim.steady_per_iteration_s,
                                   float(row["real_wall_s"]), ext,
                                   probe_load=float(row.get("probe_load", 0.0)),
                                   simulated_unloaded_s=plain.per_iteration_s,
                                   load_series=row.get("load_series"),
                                   niced_load=float(row.get("niced_load", 0.0))))
    print_table(cfg.name, rows, n, data.get("loadavg", {}), prof_load)
    return rows


def series_in_virtual_time(series: list[Any], mean: float, makespan: float, wall: float,
                           simulated: float) -> list[tuple[float, float]]:
    """A real run's sampled other load (`OtherLoad.series`: seconds since the run's start, the
    load over the interval ending then) as piecewise-constant points in the simulated run's
    virtual time: the run's start-up (wall time before its iterations, wall - makespan) left
    out, the rest mapped by the fraction of the iterations elapsed, and shifted so that its
    time-weighted mean over the iterations is `mean` (which may also hold the spinning probe)."""
    start = max(0.0, wall - makespan)
    points, prev = [], 0.0
    for t, v in series:
        t0, t1, prev = prev, float(t), float(t)
        lo, hi = max(t0, start), min(t1, start + makespan)
        if hi > lo:  # the interval (t0, t1] overlaps the iterations
            points.append(((lo - start) / makespan * simulated, float(v), hi - lo))
    if not points:
        return [(0.0, mean)]
    seen = sum(v * w for _, v, w in points) / sum(w for _, _, w in points)
    return [(0.0 if i == 0 else t, max(0.0, v + mean - seen))
            for i, (t, v, _) in enumerate(points)]
