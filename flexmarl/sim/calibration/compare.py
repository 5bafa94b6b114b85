"""`flexmarl bench compare CONFIG --systems ...`: the paper's table on real runs of this machine.

Each system is a preset of the real runtime (`config/systems.py`, the simulator's names). The
systems run one after another in rounds, the order reversed every other round so a drift of
the machine's load does not favour one of them; each row is the median over the rounds of
seconds per iteration (makespan / iterations, from the runs' `time_s`), next to the
simulator's prediction for the same system: the production orchestrator on the mirrored local
runtime (`mirror.py`) from one profile of the config's agents (`profile.py`), one simulated
run per real run with the other load that run saw (`run_mirror_measured`), the median over the
rounds. FlexMARL's speedup over each system is that system's s/iteration over
FlexMARL's (`flexmarl` must be among the systems for it).

With `pin`, every run pins its rollout workers to the first half of the CPUs and its training
workers to the second half (`runtime.rollout_cpus` / `train_cpus`): disaggregated pools on
separate cores; the colocated systems (`marti`, `marti-2025-05`, `mas-rl-like`) pin both pools
to every core, pinned or not. The mirror models the CPUs as shared, so with pinning its error
says how much the separation itself costs or gains.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flexmarl.config.schema import ConfigError, load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import prepare, train
from flexmarl.sim.calibration.calibrate import SAMPLE_S, load_or_profile
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.machine import (
    IterationClock,
    OtherLoad,
    host_speed,
    machine_info,
    profiled_load,
    speed_probe,
    window_load,
)
from flexmarl.sim.calibration.mirror import per_iteration, run_mirror, run_mirror_measured

DEFAULT_SYSTEMS = ("flexmarl", "flexmarl-sync", "flexmarl-static-balance", "sync-disaggregated")


@dataclass
class SystemRow:
    """One system's figures: medians over the rounds, the simulator's prediction beside."""

    system: str
    s_per_iteration: list[float] = field(default_factory=list)  # one per round
    rollout_busy: list[float] = field(default_factory=list)
    train_busy: list[float] = field(default_factory=list)
    swaps_per_iteration: list[float] = field(default_factory=list)
    final_success: list[float] = field(default_factory=list)
    # CPUs of others' work per round, over its iterations (over the whole run, start-up
    # included, in `other_load_whole_run`)
    other_load: list[float] = field(default_factory=list)
    other_load_whole_run: list[float] = field(default_factory=list)
    simulated_s: float = 0.0  # the median of the rounds' predictions
    simulated_rounds: list[float] = field(default_factory=list)  # one per round
    simulated_runnable: list[float] = field(default_factory=list)  # others' runnable, inferred
    # per round: the others' CPUs sampled over its iterations ([t since the first began, cpus],
    # `OtherLoad.series`) and the iterations' real length; older comparisons have neither
    other_series: list[list[list[float]]] = field(default_factory=list)
    makespan_s: list[float] = field(default_factory=list)
    # per round: the CPUs the run's own processes took over its iterations (what the mirror's
    # CPU seconds an iteration over the measured s/iteration should match)
    own_load: list[float] = field(default_factory=list)
    # per round: the iterations' [start, end] and the run's wall time, in seconds since its
    # load's sampling began (`IterationClock`), and that whole series, to cut other windows
    windows: list[list[float]] = field(default_factory=list)
    series_whole_run: list[list[list[float]]] = field(default_factory=list)
    # per round: the CPUs the mirror's own processes got over its simulated iterations, the
    # figure beside `own_load` (a profile charging too much or too little CPU shows here)
    simulated_own_load: list[float] = field(default_factory=list)
    # per round: the host's speed probe around the run (`machine.speed_probe`, CPU seconds of
    # a fixed unit, the mean of before and after); the mirror runs the round at it over the
    # profile's. Older comparisons have none (simulated at the profile's speed).
    speed_probe_s: list[float] = field(default_factory=list)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.s_per_iteration)

    @property
    def error(self) -> float:
        return (self.simulated_s - self.measured_s) / self.measured_s if self.measured_s else 0.0


def pinned_overrides(cpus: int | None = None) -> list[str]:
    """Rollout on the first half of the CPUs, training on the rest (at least one each)."""
    n = cpus or os.cpu_count() or 1
    if n < 2:  # the table would say "pinned apart" of pools that share the one CPU
        raise ConfigError(f"--pin: pools pinned apart need 2 CPUs or more, this machine has {n}")
    half = n // 2
    return [f"runtime.rollout_cpus=[{','.join(map(str, range(half)))}]",
            f"runtime.train_cpus=[{','.join(map(str, range(half, n)))}]"]


def colocated(system: str) -> bool:
    """Whether `system` runs its pools on the same cores (`runtime.colocate`)."""
    return "runtime.colocate=true" in system_overrides(system)


def compare(config: str | Path, overrides: list[str] | None = None,
            systems: tuple[str, ...] | list[str] = DEFAULT_SYSTEMS, rounds: int = 2,
            iterations: int | None = None, out: str | Path | None = None,
            profile: str | Path | None = None, pin: bool = False, reps: int = 3,
            log: Any = print) -> list[SystemRow]:
    """Run `systems` on `config` in alternating rounds, simulate each, print the table."""
    overrides = list(overrides or [])
    systems = list(dict.fromkeys(systems))
    # colocated systems (runtime.colocate) pin both pools to the same cores: never apart
    settings = {s: [*system_overrides(s), "runtime.kind=local",
                    *(pinned_overrides() if pin and not colocated(s) else []), *overrides]
                for s in systems}
    if iterations is not None:
        settings = {s: [*o, f"train.iterations={iterations}"] for s, o in settings.items()}
    cfgs = {s: load_config(config, o) for s, o in settings.items()}  # every error up front
    first = cfgs[systems[0]]
    task = prepare(first)
    base = Path(out or Path("runs") / "compare" / first.name)
    base.mkdir(parents=True, exist_ok=True)
    # the agents' costs on this machine: the config as given, on the local runtime (the one
    # the mirror simulates), whatever the first system's settings
    profiled = load_config(config, [*overrides, "runtime.kind=local"] +
                           ([f"train.iterations={iterations}"] if iterations is not None else []))
    prof = load_or_profile(profiled, task, profile, base, reps, log)
    rows = {s: SystemRow(s) for s in systems}
    saved = {"config": str(config), "overrides": overrides, "rounds": rounds, "pin": pin,
             "machine": machine_info(), "settings": settings,
             "profile": str(profile or base / "profile.json")}
    for r in range(rounds):
        for system in (systems if r % 2 == 0 else systems[::-1]):
            cfg = cfgs[system]
            probe = speed_probe()
            with OtherLoad(every=SAMPLE_S) as during:
                clock = IterationClock(during.t0)
                result = train(cfg, base / f"{system}-{r}", on_iteration=clock.mark)
            # the host's speed around the run: the least reading (`speed_probe`)
            rows[system].speed_probe_s.append(round(min(probe, speed_probe()),
                                                    7))
            # others' CPU time over the iterations (the run's start-up and teardown left
            # out): what the mirror simulates next to them
            whole = during.cpus if during.measured else 0.0
            makespan = float(result.records[-1]["time_s"]) if result.records else 0.0
            start, end = clock.window() or (max(0.0, result.wall_s - makespan), result.wall_s)
            rows[system].windows.append([round(start, 3), round(end, 3),
                                         round(result.wall_s, 3)])
            rows[system].series_whole_run.append([[round(t, 3), v] for t, v in during.series])
            add_run(rows[system], result.records,
                    window_load(during.series, start, start + makespan, whole))
            rows[system].other_load_whole_run.append(whole)
            rows[system].other_series.append(window_series(during.series, start,
                                                           start + makespan))
            rows[system].makespan_s.append(makespan)
            rows[system].own_load.append(window_load(during.own_series, start,
                                                     start + makespan, 0.0))
            log(f"  round {r + 1}/{rounds} {system:<24} "
                f"{rows[system].s_per_iteration[-1]:.3f} s/iteration (host speed probe "
                f"x{round_speed(prof, rows[system], r):.3f} of the profile's)")
    table = list(rows.values())
    save_rows(base, saved, table)  # the measurements first: a simulation may still fail
    simulate_rows(table, cfgs, task, prof)
    print_table(first.name, table, rounds, first.train.iterations, pin)
    save_rows(base, saved, table)
    log(f"compare: {base / 'compare.json'}")
    return table


def round_speed(prof: LocalProfile, row: SystemRow, r: int) -> float:
    """Round r's `machine.host_speed` (1.0 for an older comparison's round, without one)."""
    return host_speed(prof.machine, row.speed_probe_s[r] if r < len(row.speed_probe_s)
                      else None)


def add_run(row: SystemRow, records: list[dict[str, Any]], other_load: float) -> None:
    """One real run's figures into its system's row."""
    row.s_per_iteration.append(per_iteration(records)[0])
    row.rollout_busy.append(statistics.mean(x["pool/rollout/busy_frac"] for x in records))
    row.train_busy.append(statistics.mean(x["pool/train/busy_frac"] for x in records))
    row.swaps_per_iteration.append(statistics.mean(x.get("pool/train/swaps", 0)
                                                   for x in records))
    row.final_success.append(records[-1]["task/success_rate"])
    row.other_load.append(other_load)


def window_series(series: list[tuple[float, float]], start: float,
                  end: float) -> list[list[float]]:
    """The points of an `OtherLoad.series` over [start, end], as [t - start, cpus]: each
    sampled interval that overlaps the window, cut to it."""
    points, prev = [], 0.0
    for t, v in series:
        lo, hi = max(prev, start), min(float(t), end)
        if hi > lo:
            points.append([round(hi - start, 3), float(v)])
        prev = float(t)
    return points


def simulate_rows(rows: list[SystemRow], cfgs: dict[str, Any], task: Any,
                  prof: LocalProfile, load_model: str = "mean") -> None:
    """Each system's prediction: the mirror of each of its real runs, with the other load
    that run saw (one round's load may be far from another's), the median over its rounds,
    as the measured figure is. The others' runnable work is inferred from the CPU time they
    got over the round's iterations (`run_mirror_measured`; a mean read above the machine is
    held to what the run's own work left, `own_share_cap`); with `load_model` "series" and a
    round that sampled it, the runnable work follows the series window by window (bursts),
    "mean" holds it level. Each round runs at its host speed over the profile's
    (`round_speed`)."""
    prof_load = profiled_load(prof.machine)
    for row in rows:
        row.simulated_rounds, row.simulated_runnable, row.simulated_own_load = [], [], []
        for r, load in enumerate(row.other_load or [prof_load]):
            cfg = cfgs[row.system]
            if r < len(row.s_per_iteration):
                load = own_share_cap(cfg, task, prof, load, row.s_per_iteration[r])
            series = row.other_series[r] if r < len(row.other_series) else []
            speed = round_speed(prof, row, r)
            if load_model == "series" and series:
                sim = run_mirror_measured(cfg, task, prof, load, profiled_external=prof_load,
                                          series=[(t, v) for t, v in series],
                                          makespan=row.makespan_s[r], speed=speed)
            else:
                sim = run_mirror_measured(cfg, task, prof, load, profiled_external=prof_load,
                                          speed=speed)
            row.simulated_rounds.append(sim.per_iteration_s)
            row.simulated_own_load.append(sim.own_cpu_got_s / sim.makespan_s
                                          if sim.makespan_s > 0 else 0.0)
            row.simulated_runnable.append(sim.other_runnable)
        row.simulated_s = statistics.median(row.simulated_rounds)


def own_share_cap(cfg: Any, task: Any, prof: LocalProfile, load: float,
                  measured_s: float) -> float:
    """Others' mean CPUs read at or above the machine's (a sampling artifact older
    comparisons hold, 2.21 of 2 CPUs; `OtherLoad` now holds each reading to what the run left)
    held to what the run's own work left of it: a run that needed W CPU seconds an iteration
    (the mirror's) over its measured s/iteration took W / s of the CPUs. Uses the measured
    time, so only for a reading no machine can give; a plausible one is kept as read."""
    cores = float(prof.machine.get("cpus") or os.cpu_count() or 1)
    if prof.clock != "cpu" or load < cores or measured_s <= 0:
        return load
    own = run_mirror(cfg, task, prof, external=0.0)
    n = max(1, len(own.records))
    return min(load, max(0.0, cores - own.own_cpu_s / n / measured_s))


def save_rows(base: Path, saved: dict[str, Any], rows: list[SystemRow],
              name: str = "compare.json") -> None:
    (base / name).write_text(json.dumps({
        **saved, "rows": [{**asdict(r), "measured_s": r.measured_s, "error": r.error}
                          for r in rows]}, indent=2, default=str))


def resimulate(base: str | Path, profile: str | Path | None = None,
               log: Any = print, load_model: str = "mean") -> list[SystemRow]:
    """Simulate a finished comparison again (a changed simulator, another profile; default
    the comparison's own): the real runs are read from `base` (OUT/compare.json, or, where a
    comparison stopped before writing it, the run folders `SYSTEM-ROUND`, at the profile's
    load); their measurements
    are kept, the predictions recomputed, the table printed and written to
    OUT/compare_resimulated.json."""
    base = Path(base)
    saved = json.loads((base / "compare.json").read_text()) \
        if (base / "compare.json").exists() else {}
    profile = profile or saved.get("profile") or base / "profile.json"
    prof = LocalProfile.load(profile)
    rows: dict[str, SystemRow] = {}
    cfgs: dict[str, Any] = {}
    loads: dict[str, list[float]] = {}
    own: dict[str, list[float]] = {}
    probes: dict[str, list[float]] = {}
    sampled: dict[str, tuple[list, list]] = {}  # the rounds' series and makespans, if saved
    for r in saved.get("rows", []):
        loads[r["system"]] = [float(v) for v in r.get("other_load", [])]
        own[r["system"]] = [float(v) for v in r.get("own_load", [])]
        probes[r["system"]] = [float(v) for v in r.get("speed_probe_s", [])]
        sampled[r["system"]] = (r.get("other_series", []), r.get("makespan_s", []))
    for run in sorted(base.glob("*-[0-9]*")):
        system, _, rnd = run.name.rpartition("-")
        metrics = run / "metrics.jsonl"
        if not rnd.isdigit() or not metrics.exists():
            continue
        records = [json.loads(line) for line in metrics.read_text().splitlines()
                   if line.startswith('{"iteration"')]
        if not records:
            continue
        row = rows.setdefault(system, SystemRow(system))
        cfgs.setdefault(system, load_config(run / "config.yaml"))
        seen = loads.get(system, [])
        add_run(row, records, seen[int(rnd)] if int(rnd) < len(seen) else
                profiled_load(prof.machine))
    if not rows:
        raise ConfigError(f"{base}: no comparison runs (SYSTEM-ROUND folders) in it")
    table = list(rows.values())
    for row in table:
        row.other_series, row.makespan_s = sampled.get(row.system, ([], []))
        row.own_load = own.get(row.system, [])
        row.speed_probe_s = probes.get(row.system, [])
    first = next(iter(cfgs.values()))
    simulate_rows(table, cfgs, prepare(first), prof, load_model)
    print_table(first.name, table, max(len(r.s_per_iteration) for r in table),
                first.train.iterations, False)
    save_rows(base, {"resimulated_with": str(profile), "load_model": load_model}, table,
              "compare_resimulated.json")
    return table


def print_table(name: str, rows: list[SystemRow], rounds: int, iterations: int,
                pin: bool) -> None:
    ref = next((r.measured_s for r in rows if r.system == "flexmarl"), None)
    apart = ""
    if pin:
        shared = [r.system for r in rows if colocated(r.system)]
        apart = ", pools pinned apart" + (f" (colocated: {', '.join(shared)}, every core)"
                                          if shared else "")
    print(f"\n{name}: {len(rows)} systems x {rounds} rounds of {iterations} iterations "
          f"({os.cpu_count()} CPUs{apart})")
    print(f"{'system':<24}{'s/iteration':>12}{'flexmarl x':>11}{'rollout busy':>13}"
          f"{'train busy':>11}{'swaps/it':>9}{'success':>9}{'simulated':>11}{'error':>8}"
          f"{'own CPUs':>10}{'sim':>6}")
    for r in rows:
        speedup = f"{r.measured_s / ref:.2f}" if ref else "-"
        print(f"{r.system:<24}{r.measured_s:>12.3f}{speedup:>11}"
              f"{statistics.median(r.rollout_busy):>13.2f}{statistics.median(r.train_busy):>11.2f}"
              f"{statistics.median(r.swaps_per_iteration):>9.1f}"
              f"{statistics.median(r.final_success):>9.3f}{r.simulated_s:>11.3f}"
              f"{r.error:>+8.1%}{_median(r.own_load):>10.2f}{_median(r.simulated_own_load):>6.2f}")
    print("(medians over the rounds; flexmarl x = the system's s/iteration over FlexMARL's, "
          "FlexMARL's speedup over it; simulated = the median over the rounds of the mirrored "
          "local runtime from one profile with each round's other load; the error is reported, "
          "not enforced; own CPUs = the CPUs the run's own processes took over its iterations, "
          "measured and simulated, nan where not recorded)")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
