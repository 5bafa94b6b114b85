"""The production orchestrator on the simulated runtime: virtual time, baselines, reports."""

import time
from pathlib import Path

import pytest

from flexmarl.sim.simulate import SYSTEMS, simulate, simulate_system
from flexmarl.sim.workload import load_workload

WORKLOAD = Path(__file__).resolve().parents[3] / "examples" / "sim" / "solver_verifier.yaml"


@pytest.fixture(scope="module")
def wl():
    return load_workload(WORKLOAD)


def test_simulated_hours_take_seconds_and_are_deterministic(wl):
    started = time.perf_counter()
    a = simulate_system(wl, "flexmarl", iterations=2)
    real = time.perf_counter() - started
    b = simulate_system(wl, "flexmarl", iterations=2)
    assert a.makespan_s == b.makespan_s and a.utilisation == b.utilisation
    assert a.makespan_s > 10 * real  # virtual time runs far ahead of the wall clock
    assert [r["iteration"] for r in a.records] == [0, 1]
    assert 0 < a.utilisation <= 1 and 0 < a.efficiency <= 1.0 + 1e-9
    # every agent stepped once per iteration, through the real orchestrator's version gates
    for agent in a.runtime.trainable:
        assert a.records[-1][f"agent/{agent}/policy_version"] == 2


def test_baselines_are_the_same_simulator_with_features_switched(wl):
    flex = simulate_system(wl, "flexmarl", iterations=2)
    sync = simulate_system(wl, "flexmarl-sync", iterations=2)
    marti = simulate_system(wl, "marti-like", iterations=2)
    # the async pipeline never loses to the same system run synchronously
    assert flex.makespan_s <= sync.makespan_s * 1.001
    # the colocated baseline pays engine sleep/wake and trains agents one after another
    kinds = {s.kind for s in marti.runtime.spans}
    assert "sleep" in kinds
    assert set(SYSTEMS) >= {"marti-like", "sync-disaggregated", "flexmarl"}
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        simulate_system(wl, "nope")


def test_report_writes_trace_and_gantt(tmp_path, capsys):
    simulate(WORKLOAD, ["marti-like"], iterations=1, out=tmp_path)
    out = capsys.readouterr().out
    assert "speedup" in out and "marti-like" in out and "efficiency" in out
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"
