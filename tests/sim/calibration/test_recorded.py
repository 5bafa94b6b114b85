"""The simulator's prediction for each preset against a recorded profile and the real runs
measured with it (issue 31, item 5): `flexmarl bench compare examples/paper_workload.yaml
--iterations 4 --rounds 3` on the 2-CPU development machine under other agents' load (load
average 5-12; tests/data/sim/: the profile, each run's s/iteration and the other users' CPU
time over its iterations).
The mirror runs in virtual time, so its predictions are deterministic: these tests fail when
the model moves away from what was measured."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import prepare
from flexmarl.sim.calibration.compare import SystemRow, simulate_rows
from flexmarl.sim.calibration.fits import LocalProfile
from flexmarl.sim.calibration.machine import profiled_load
from flexmarl.sim.calibration.mirror import run_mirror, run_mirror_measured

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "sim"


def _recorded() -> tuple[LocalProfile, dict]:
    return (LocalProfile.load(DATA / "paper_workload_profile.json"),
            json.loads((DATA / "paper_workload_compare.json").read_text()))


def _config(recorded: dict, system: str):
    return load_config(ROOT / recorded["config"], recorded["settings"][system])


def test_flexmarl_is_predicted_within_10_percent_of_its_recorded_runs():
    prof, recorded = _recorded()
    row = next(r for r in recorded["rows"] if r["system"] == "flexmarl")
    cfg = _config(recorded, "flexmarl")
    task = prepare(cfg)
    measured = statistics.median(row["s_per_iteration"])
    load = statistics.median(row["other_load"])
    sim = run_mirror_measured(cfg, task, prof, load, profiled_external=profiled_load(
        prof.machine))
    assert abs(sim.per_iteration_s - measured) / measured <= 0.10
    # the others got 1.0 of the 2 CPUs next to the run's busy processes: more runnable
    # work of theirs than that, which the simulated others get the same CPU time from
    assert sim.other_runnable > load
    assert sim.other_cpus == pytest.approx(load, rel=0.05)
    # read as that many runnable processes, the machine would give the pipeline more CPU
    # than it did: the under-prediction issue 31 reported for the pipelined rows
    naive = run_mirror(cfg, task, prof, external=load)
    assert naive.per_iteration_s < sim.per_iteration_s


@pytest.mark.slow
def test_every_preset_against_its_recorded_runs():
    prof, recorded = _recorded()
    errors = {}
    for row in recorded["rows"]:
        cfg = _config(recorded, row["system"])
        task = prepare(cfg)
        sims = [run_mirror_measured(cfg, task, prof, load,
                                    profiled_external=profiled_load(prof.machine))
                .per_iteration_s for load in row["other_load"]]
        measured = statistics.median(row["s_per_iteration"])
        errors[row["system"]] = (statistics.median(sims) - measured) / measured
    # the rounds of one system differed by up to 4.9x under this load (flexmarl 9.04 .. 1.83
    # s/iteration): the worst rows are within their rounds' spread, the typical row close
    assert all(abs(e) <= 0.30 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.12, errors
    for system in ("flexmarl", "flexmarl-sync", "sync-disaggregated", "marti"):
        assert abs(errors[system]) <= 0.10, (system, errors)
    # what the command printed when the runs were measured (the mirror is deterministic)
    for row in recorded["rows"]:
        assert statistics.median(row["simulated_rounds"]) == pytest.approx(
            statistics.median(row["s_per_iteration"]) * (1 + errors[row["system"]]), rel=1e-6)


def _heldout() -> tuple[LocalProfile, dict]:
    """A second comparison, recorded after the model changes it checks (nothing fitted on it),
    with each round's others' load sampled window by window."""
    return (LocalProfile.load(DATA / "paper_workload_profile.json"),
            json.loads((DATA / "paper_workload_compare_heldout.json").read_text()))


def _simulated(prof: LocalProfile, recorded: dict, systems: list[str],
               load_model: str) -> dict[str, SystemRow]:
    rows, cfgs = [], {}
    for r in recorded["rows"]:
        if r["system"] in systems:
            rows.append(SystemRow(r["system"], s_per_iteration=r["s_per_iteration"],
                                  other_load=r["other_load"], other_series=r["other_series"],
                                  makespan_s=r["makespan_s"]))
            cfgs[r["system"]] = _config(recorded, r["system"])
    simulate_rows(rows, cfgs, prepare(next(iter(cfgs.values()))), prof, load_model)
    return {r.system: r for r in rows}


@pytest.mark.slow
def test_the_held_out_comparison_shows_the_gap_left():
    """Not a goal: today's errors on the held-out comparison, so a change that moves them is
    seen. Both load models over-predict most rows there (the mean model +3.7% .. +63%),
    one-step-off and mas-rl-like within 6%; a window-by-window load is closer on the
    pipelined rows and no worse elsewhere."""
    prof, recorded = _heldout()
    systems = [r["system"] for r in recorded["rows"]]
    level = {s: r.error for s, r in _simulated(prof, recorded, systems, "mean").items()}
    bursts = {s: r.error for s, r in _simulated(prof, recorded, systems, "series").items()}
    for errors in (level, bursts):
        assert all(-0.10 <= e <= 0.70 for e in errors.values()), errors
        assert abs(errors["one-step-off"]) <= 0.06 and abs(errors["mas-rl-like"]) <= 0.05
        assert sum(e > 0.15 for e in errors.values()) >= 4, errors  # the gap: over-predicted
    assert statistics.median(abs(e) for e in bursts.values()) < statistics.median(
        abs(e) for e in level.values())


def _dec6() -> tuple[LocalProfile, dict]:
    """A third comparison (Dec 6, 08:37-08:54 UTC, load average 4.5-7), recorded with the
    worker probes' call-by-call CPU share and the others' load over each run's iterations as
    they ran (`IterationClock`, teardown left out), with the profile it took then."""
    return (LocalProfile.load(DATA / "paper_workload_profile_dec6.json"),
            json.loads((DATA / "paper_workload_compare_dec6.json").read_text()))


@pytest.mark.slow
def test_the_dec6_comparison_predicts_the_sync_rows_and_misses_the_pipelined_ones():
    """Not a goal: the errors as measured, so a change that moves them is seen. The
    synchronous, disaggregated rows are within 8%; the pipelined rows and the colocated
    `marti` are under-predicted by 28-35%: their real runs spend more CPU an iteration than
    the mirror charges (the gap left of issue 31's item 5)."""
    prof, recorded = _dec6()
    systems = [r["system"] for r in recorded["rows"]]
    rows = _simulated(prof, recorded, systems, "mean")
    errors = {s: r.error for s, r in rows.items()}
    for system in ("flexmarl-sync", "sync-disaggregated", "mas-rl-like"):
        assert abs(errors[system]) <= 0.08, (system, errors)
    for system in ("flexmarl", "flexmarl-stage", "flexmarl-static-balance", "one-step-off",
                   "marti"):
        assert -0.40 <= errors[system] <= -0.20, (system, errors)
    # what the command printed when the runs were measured (the mirror is deterministic)
    for r in recorded["rows"]:
        assert errors[r["system"]] == pytest.approx(r["error"], abs=1e-6)


def _dec6b() -> tuple[LocalProfile, dict]:
    """A fourth comparison (Dec 6, 11:00-11:18 UTC, load average 5-9, recorded with the code
    before the mirror charged what real runs spend) and a profile taken after it with the
    profiler that measures those costs: the driver in real runs of the config, a training
    worker's CPU over each whole command, next to a busy replica, a kept swap-in, a colocated
    engine's sleep and wake."""
    return (LocalProfile.load(DATA / "paper_workload_profile_dec6b.json"),
            json.loads((DATA / "paper_workload_compare_dec6b.json").read_text()))


# the errors as `benchmarks/resimulate_profiles.py` printed them for this profile (level load)
DEC6B_ERRORS: dict[str, float] = {
    "flexmarl": -0.1733942178549692,
    "flexmarl-sync": -0.14100276821441488,
    "flexmarl-stage": 0.007824145313784149,
    "flexmarl-static-balance": -0.11563670142890768,
    "sync-disaggregated": -0.09979163751499082,
    "one-step-off": -0.4033984037957191,
    "marti": -0.24793628661532952,
    "mas-rl-like": -0.057906047964041064,
}


@pytest.mark.slow
def test_the_dec6b_comparison_with_what_real_runs_spend():
    """Not a goal: the errors as measured, so a change that moves them is seen; and the
    mirror's driver charges what the profile's real runs of the config measured."""
    prof, recorded = _dec6b()
    systems = [r["system"] for r in recorded["rows"]]
    errors = {s: r.error for s, r in _simulated(prof, recorded, systems, "mean").items()}
    for system, error in DEC6B_ERRORS.items():
        assert errors[system] == pytest.approx(error, abs=1e-6), (system, errors)
    # the driver's CPU an iteration, as the sync and async real runs of the profile spent it
    for system, measured in (("flexmarl-sync", prof.driver["sync_per_iteration_s"]),
                             ("flexmarl", prof.driver["pipelined_per_iteration_s"])):
        cfg = _config(recorded, system)
        sim = run_mirror(cfg, prepare(cfg), prof, external=0.0)
        assert sim.cpu_by_kind()["driver"] == pytest.approx(measured, rel=0.25), system
        # the records count the slots' swaps as a real run's do
        assert sum(r["pool/train/swaps"] for r in sim.records) > 0
