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


RECORDED_ERRORS: dict[str, float] = {
    "flexmarl": -0.0668037688936944,
    "flexmarl-sync": -0.07335212199226063,
    "flexmarl-stage": -0.1664053101706791,
    "flexmarl-static-balance": 0.04849016666331143,
    "sync-disaggregated": -0.018187108874461774,
    "one-step-off": -0.3268561102551858,
    "marti": -0.08378820468933602,
    "mas-rl-like": -0.28707481937167834,
}


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
    assert all(abs(e) <= 0.35 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.12, errors
    for system in ("flexmarl", "flexmarl-sync", "sync-disaggregated", "marti"):
        assert abs(errors[system]) <= 0.10, (system, errors)
    # today's mirror, deterministic (re-pinned on Dec 6 evening: the slot's send-ahead, which
    # these older runs did not have, and the earlier mirror changes moved every row)
    assert errors == pytest.approx(RECORDED_ERRORS, abs=1e-6)


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


HELDOUT_LEVEL: dict[str, float] = {
    "flexmarl": 0.10840876180236025,
    "flexmarl-sync": 0.283633945602864,
    "flexmarl-stage": 0.07110558219281106,
    "flexmarl-static-balance": 0.6670892976904236,
    "sync-disaggregated": 0.2213819860817693,
    "one-step-off": -0.08090737430600793,
    "marti": 0.18192472698086073,
    "mas-rl-like": -0.07229600984880834,
}
HELDOUT_SERIES: dict[str, float] = {
    "flexmarl": 0.12134903714398809,
    "flexmarl-sync": 0.2722267490526305,
    "flexmarl-stage": 0.07292437065656977,
    "flexmarl-static-balance": 0.4659879277751517,
    "sync-disaggregated": 0.21429629092209565,
    "one-step-off": -0.057284576751678064,
    "marti": 0.1702377547615345,
    "mas-rl-like": -0.08126661263341507,
}


@pytest.mark.slow
def test_the_held_out_comparison_shows_the_gap_left():
    """Not a goal: today's errors on the held-out comparison, so a change that moves them is
    seen. Both load models over-predict most rows there (the mean model +7% .. +67%),
    one-step-off and mas-rl-like within 9%."""
    prof, recorded = _heldout()
    systems = [r["system"] for r in recorded["rows"]]
    level = {s: r.error for s, r in _simulated(prof, recorded, systems, "mean").items()}
    bursts = {s: r.error for s, r in _simulated(prof, recorded, systems, "series").items()}
    for errors in (level, bursts):
        assert all(-0.10 <= e <= 0.70 for e in errors.values()), errors
        assert abs(errors["one-step-off"]) <= 0.09 and abs(errors["mas-rl-like"]) <= 0.09
        assert sum(e > 0.15 for e in errors.values()) >= 4, errors  # the gap: over-predicted
    # today's mirror (re-pinned on Dec 6 evening, as above): the window-by-window load is no
    # longer closer in the median (0.146 against 0.145), closer on the static-balance row
    assert level == pytest.approx(HELDOUT_LEVEL, abs=1e-6)
    assert bursts == pytest.approx(HELDOUT_SERIES, abs=1e-6)
    assert abs(bursts["flexmarl-static-balance"]) < abs(level["flexmarl-static-balance"])


def _dec6() -> tuple[LocalProfile, dict]:
    """A third comparison (Dec 6, 08:37-08:54 UTC, load average 4.5-7), recorded with the
    worker probes' call-by-call CPU share and the others' load over each run's iterations as
    they ran (`IterationClock`, teardown left out), with the profile it took then."""
    return (LocalProfile.load(DATA / "paper_workload_profile_dec6.json"),
            json.loads((DATA / "paper_workload_compare_dec6.json").read_text()))


DEC6_ERRORS: dict[str, float] = {
    "flexmarl": -0.31204974066667973,
    "flexmarl-sync": -0.1262267100796069,
    "flexmarl-stage": -0.3537963797666333,
    "flexmarl-static-balance": -0.3123809766483024,
    "sync-disaggregated": -0.14825939278149763,
    "one-step-off": -0.3077870438658636,
    "marti": -0.3304712587610155,
    "mas-rl-like": -0.05477498411032847,
}


@pytest.mark.slow
def test_the_dec6_comparison_predicts_the_sync_rows_and_misses_the_pipelined_ones():
    """Not a goal: the errors as measured, so a change that moves them is seen. The
    synchronous, disaggregated rows are within 15% (8% before this evening's mirror); the
    pipelined rows and the colocated `marti` are under-predicted by 20-40%: their real runs
    spend more CPU an iteration than the mirror charges (the gap left of issue 31's item 5)."""
    prof, recorded = _dec6()
    systems = [r["system"] for r in recorded["rows"]]
    rows = _simulated(prof, recorded, systems, "mean")
    errors = {s: r.error for s, r in rows.items()}
    for system in ("flexmarl-sync", "sync-disaggregated", "mas-rl-like"):
        assert abs(errors[system]) <= 0.15, (system, errors)
    for system in ("flexmarl", "flexmarl-stage", "flexmarl-static-balance", "one-step-off",
                   "marti"):
        assert -0.40 <= errors[system] <= -0.20, (system, errors)
    # today's mirror (re-pinned on Dec 6 evening, as above; the sync rows were within 8%)
    assert errors == pytest.approx(DEC6_ERRORS, abs=1e-6)


def _dec6b() -> tuple[LocalProfile, dict]:
    """A fourth comparison (Dec 6, 11:00-11:18 UTC, load average 5-9, recorded with the code
    before the mirror charged what real runs spend) and a profile taken after it with the
    profiler that measures those costs: the driver in real runs of the config, a training
    worker's CPU over each whole command, next to a busy replica, a kept swap-in, a colocated
    engine's sleep and wake."""
    return (LocalProfile.load(DATA / "paper_workload_profile_dec6b.json"),
            json.loads((DATA / "paper_workload_compare_dec6b.json").read_text()))


# the errors of today's mirror for this profile, level load (re-pinned on Dec 6 evening,
# as above; `benchmarks/resimulate_profiles.py` prints them)
DEC6B_ERRORS: dict[str, float] = {
    "flexmarl": -0.20046511798290667,
    "flexmarl-sync": -0.23052428397558386,
    "flexmarl-stage": -0.06575243466397371,
    "flexmarl-static-balance": -0.17200449765664552,
    "sync-disaggregated": -0.19466518716595949,
    "one-step-off": -0.3518036834046313,
    "marti": -0.32657274493608063,
    "mas-rl-like": -0.1550948595907371,
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
