"""`flexmarl bench compare`: the simulator's systems as real runs of the local runtime, side by
side with the simulator's prediction for each (a short real comparison; the profile is a
recorded one so the test does not spend its time profiling)."""

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import yaml

from flexmarl.config.schema import ConfigError, RunConfig, load_config
from flexmarl.config.systems import NOT_YET, SYSTEM_SETTINGS, system_overrides
from flexmarl.policy.device import Placement, plan_placements
from flexmarl.sim.calibration.compare import compare, pinned_overrides, resimulate
from flexmarl.sim.calibration.profile import pipelined_config
from flexmarl.sim.simulate import SYSTEMS
from tests.sim.calibration.test_profile import _synthetic_profile, tiny_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_every_real_preset_and_every_refusal_is_a_simulated_system():
    assert set(SYSTEM_SETTINGS) | set(NOT_YET) == set(SYSTEMS)
    assert not NOT_YET  # every simulated system is a preset of the real runtime now
    with pytest.raises(ConfigError, match="--system fast: unknown system"):
        system_overrides("fast")


def _affinity(placement: Placement, queue) -> None:
    placement.apply()
    queue.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="pinning apart needs 2 CPUs")
def test_pools_pinned_apart_reach_the_worker_processes(tmp_path):
    cfg = tiny_config(runtime={"kind": "local", "rollout_cpus": [0], "train_cpus": [1]})
    rollout, train = plan_placements(cfg.runtime, 1, 1)
    assert (rollout[0].cpus, train[0].cpus) == ((0,), (1,))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_affinity, args=(train[0], queue))
    proc.start()
    assert queue.get(timeout=60) == [1]
    proc.join()
    with pytest.raises(ConfigError, match=r"runtime.train_cpus: .*CPU ids in 0\.\."):
        tiny_config(runtime={"kind": "local", "train_cpus": [4096]})


def test_compare_runs_each_system_and_prints_the_table(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config().model_dump(mode="json", exclude_none=True)))
    profile = _synthetic_profile().save(tmp_path / "profile.json")
    pin = (os.cpu_count() or 1) >= 2
    rows = compare(path, systems=["flexmarl", "marti"], rounds=1, iterations=2,
                   out=tmp_path / "out", profile=profile, pin=pin)
    assert [r.system for r in rows] == ["flexmarl", "marti"]
    assert all(r.measured_s > 0 and r.simulated_s > 0 for r in rows)
    table = capsys.readouterr().out
    assert "marti" in table and "flexmarl x" in table
    if pin:
        assert "pools pinned apart (colocated: marti, every core)" in table
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert len(saved["rows"]) == 2
    # each round's others' load window by window over its iterations, for --resimulate
    assert all(len(r["other_series"]) == 1 and r["makespan_s"][0] > 0 and len(r["own_load"]) == 1
               for r in saved["rows"])
    # and the host's speed probe around each run, for the mirror to run that round at
    assert all(len(r["speed_probe_s"]) == 1 and r["speed_probe_s"][0] > 0
               for r in saved["rows"])
    # the iterations' window from when they ran, ending before the run's teardown did
    for r in saved["rows"]:
        (start, end, wall), = r["windows"]
        assert end - start == pytest.approx(r["makespan_s"][0], abs=1e-3)
        assert 0 < start < end < wall + 0.5 and r["series_whole_run"][0]
    # --resimulate: the same real runs simulated again (the mirror is deterministic)
    again = {r.system: r for r in resimulate(tmp_path / "out")}
    for r in rows:
        assert again[r.system].measured_s == pytest.approx(r.measured_s)
        assert again[r.system].simulated_s == pytest.approx(r.simulated_s)
        # the run's own CPUs, measured and simulated, kept beside each other
        assert again[r.system].own_load == pytest.approx(r.own_load)
        assert len(r.simulated_own_load) == 1 and 0 < r.simulated_own_load[0] <= 2.0
    assert "own CPUs" in capsys.readouterr().out
    assert (tmp_path / "out" / "compare_resimulated.json").exists()
    # the colocated preset ran colocated (never pinned apart), and its replicas slept
    marti = load_config(tmp_path / "out" / "marti-0" / "config.yaml")
    assert (marti.pipeline.mode, marti.rollout.balance, marti.runtime.colocate) == (
        "sync", "static", True)
    assert marti.runtime.rollout_cpus is None and marti.runtime.train_cpus is None
    first, second = [json.loads(line) for line in
                     (tmp_path / "out" / "marti-0" / "metrics.jsonl").read_text().splitlines()
                     if line.startswith('{"iteration"')]
    # the replica's KV pool freed after each rollout, allocated again (the same bytes, as the
    # replica counted them) by the wake before the next
    assert first["pool/rollout/sleep_kv_bytes"] > 0 and "pool/rollout/wake_s" not in first
    assert second["pool/rollout/wake_kv_bytes"] == first["pool/rollout/sleep_kv_bytes"]
    run_cfg = load_config(tmp_path / "out" / "flexmarl-0" / "config.yaml")
    with pytest.raises(ConfigError, match="--pin: pools pinned apart need 2 CPUs or more"):
        pinned_overrides(1)
    if os.cpu_count() and os.cpu_count() >= 2:
        assert pinned_overrides()[0].startswith("runtime.rollout_cpus=[0")
        assert run_cfg.runtime.rollout_cpus == [0] or 0 in run_cfg.runtime.rollout_cpus


@pytest.mark.parametrize("system", ["marti", "mas-rl-like", "flexmarl-sync", "flexmarl"])
def test_the_driver_measures_pipelined_run_is_a_valid_config_for_every_system(system):
    """The profiler's pipelined real run of a colocated or turn-by-turn config (a comparison
    whose first system is marti) was async with colocate on: its workers refused it."""
    cfg = load_config(EXAMPLES / "relay_chain.yaml", system_overrides(system))
    piped = pipelined_config(cfg)
    assert piped.pipeline.mode != "sync"
    RunConfig.model_validate(piped.model_dump())  # what a worker does with its spec


def test_a_round_is_simulated_at_its_host_speed():
    """A profiled CPU second costs the round's speed probe over the profile's."""
    import asyncio

    from flexmarl.sim.calibration.compare import SystemRow, round_speed
    from flexmarl.sim.calibration.machine import speed_probe
    from flexmarl.sim.calibration.mirror import CpuShare
    from flexmarl.sim.runtime.clock import run_virtual

    probe = speed_probe(units=5, repeats=1)
    assert 0 < probe < 1.0
    prof = _synthetic_profile()
    row = SystemRow("flexmarl", speed_probe_s=[0.011, 0.009])
    assert round_speed(prof, row, 0) == 1.0  # a profile without a probe: as profiled
    prof.machine["speed_probe_s"] = 0.010
    assert round_speed(prof, row, 0) == pytest.approx(1.1)
    assert round_speed(prof, row, 1) == pytest.approx(0.9)
    assert round_speed(prof, row, 2) == 1.0  # an older comparison's round: none recorded

    async def one(cpu: CpuShare) -> float:
        await cpu.run(1.0, "train")
        return asyncio.get_running_loop().time()

    assert run_virtual(one(CpuShare(2, cpu_seconds=True, speed=1.1))) == pytest.approx(1.1)


def test_the_speed_probe_is_the_least_of_its_repeated_readings(monkeypatch):
    """Interference only slows the probe's unit: with repeats, the least median is the host's
    speed (a reading taken while a run winds down must not make the host look slow)."""
    import itertools

    from flexmarl.sim.calibration import machine

    # thread_time pairs (start, end) per unit: readings of 3, 2 and 4 ms (units=1)
    clock = itertools.chain.from_iterable((0.0, d) for d in (0.003, 0.002, 0.004))
    monkeypatch.setattr(machine.time, "thread_time", lambda: next(clock))
    assert machine.speed_probe(units=1, repeats=3, gap_s=0.0) == pytest.approx(0.002)
