"""Profiles in CPU seconds (issue 31, item 5): the mirror's sharing of load-free costs, the
replica overhead counted on the turns the mirror charges it, the profile's spread, and the
replica's weight loads that arrive while another one runs."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.fits import Fit, LocalProfile
from flexmarl.sim.calibration.machine import window_load
from flexmarl.sim.calibration.mirror import (
    CpuShare,
    ParentProcess,
    SimRolloutWorker,
    run_mirror,
    run_mirror_measured,
)
from flexmarl.sim.calibration.profile import _spread, replay_batch
from flexmarl.sim.runtime.clock import run_virtual
from flexmarl.telemetry.recorder import Telemetry
from tests.sim.calibration.test_profile import _synthetic_profile, tiny_config


def _cpu_profile(**machine: float) -> LocalProfile:
    prof = _synthetic_profile()
    prof.clock = "cpu"
    prof.machine.update(machine)
    return prof


async def _jobs(cpu: CpuShare, n: int) -> float:
    await asyncio.gather(*(cpu.run(1.0) for _ in range(n)))
    return asyncio.get_running_loop().time()


def test_cpu_seconds_share_the_cpus_with_the_runs_own_other_load():
    # 2 CPUs, 1 CPU of others' work: three runnable, each 2/3 of a CPU
    assert run_virtual(_jobs(CpuShare(2, 1.0, cpu_seconds=True), 2)) == pytest.approx(1.5)
    # the load the profile was measured under plays no part: its costs hold none
    assert run_virtual(_jobs(CpuShare(2, 1.0, profiled_external=3.0, cpu_seconds=True),
                             2)) == pytest.approx(1.5)
    # a quiet run: two busy processes on two CPUs, a CPU second at the curve's speed for 2
    curve = [1.0, 0.8, 0.5]
    assert run_virtual(_jobs(CpuShare(2, 0.0, curve=curve, cpu_seconds=True),
                             2)) == pytest.approx(1 / 0.8)
    cpu = CpuShare(2, curve=curve, cpu_seconds=True)
    assert cpu.efficiency(1.0) == 1.0 and cpu.efficiency(2.5) == pytest.approx(0.65)
    assert cpu.efficiency(9.0) == pytest.approx(0.5)  # held past the last point
    # 3 busy next to 1 other on 2 CPUs: half a CPU each, at the curve's speed for 4 (held)
    assert cpu.rate(3, 1.0) == pytest.approx(0.5 * 0.5)


def test_a_cpu_profile_runs_at_its_own_load_unless_told_and_older_profiles_keep_theirs():
    cfg = tiny_config(pipeline={"mode": "async"})
    task = load_task(cfg.task.builder, cfg.task.options)
    quiet = run_mirror(cfg, task, _cpu_profile(other_load=0.0))
    loaded = run_mirror(cfg, task, _cpu_profile(other_load=2.0))
    assert loaded.makespan_s > quiet.makespan_s  # the profile's load, simulated
    told = run_mirror(cfg, task, _cpu_profile(other_load=2.0), external=0.0)
    assert told.makespan_s == pytest.approx(quiet.makespan_s)
    # a wall-clock profile (older): its costs already hold its load, nothing added
    wall = _synthetic_profile()
    wall.machine["other_load"] = 2.0
    assert run_mirror(cfg, task, wall).makespan_s == pytest.approx(
        run_mirror(cfg, task, _synthetic_profile()).makespan_s)


def test_profile_json_keeps_the_clock_and_the_spread(tmp_path):
    prof = _cpu_profile()
    prof.spread = {"rollout": 0.12, "contention_2": 0.05}
    back = LocalProfile.load(prof.save(tmp_path / "profile.json"))
    assert back.clock == "cpu" and back.spread == prof.spread
    data = prof.to_dict()
    del data["clock"], data["spread"]  # an older profile
    old = LocalProfile.from_dict(data)
    assert old.clock == "wall" and old.spread == {}
    assert _spread([1.0, 1.2, 0.9]) == pytest.approx(0.3) and _spread([5.0]) == 0.0


def test_replay_counts_the_turns_the_mirror_charges_the_loop_for():
    prof = _synthetic_profile().agents["relay"]
    bare = type(prof)({k: f for k, f in prof.fits.items() if k != "replica_overhead"})
    # lengths 1, 3, 3, 5: the admission turn (which also answers the 1), the 3s, the 5
    engine_s, turns = replay_batch("relay", bare, 4, [1, 3, 3, 5], 8)
    assert turns == 3
    with_loop, same = replay_batch("relay", prof, 4, [1, 3, 3, 5], 8)
    over = prof.fits["replica_overhead"]
    # the loop's work on exactly those turns: a fixed part each, per request on admission
    assert same == 3
    assert with_loop - engine_s == pytest.approx(3 * over(requests=0) + over.coef["requests"]
                                                 * 4)
    # uniform lengths answer in one turn after admission
    assert replay_batch("relay", bare, 4, [4, 4], 8)[1] == 2


def test_a_weight_load_arriving_while_another_runs_is_served():
    """The replica's loop once lost a load that came in while the one before it ran (the
    one-step-off mirror then waited for it forever)."""
    prof = _synthetic_profile()
    for agent in prof.agents.values():
        agent.fits["load_weights"] = Fit(["1"], {"1": 1.0})

    async def main() -> tuple[int, int, float]:
        cpu = CpuShare(2)
        worker = SimRolloutWorker(0, ["speaker", "relay"], prof, 4, 1 << 20,
                                  Telemetry(None), cpu, ParentProcess(cpu))

        async def later() -> int:
            await asyncio.sleep(0.5)  # while the first load's second runs
            return await worker.call("load_weights", ("relay", 2, None))

        try:
            got = await asyncio.gather(worker.call("load_weights", ("speaker", 1, None)),
                                       later())
        finally:
            await worker.stop()
        return got[0], got[1], asyncio.get_running_loop().time()

    first, second, end = run_virtual(main())
    assert (first, second) == (1, 2)
    assert end == pytest.approx(2.0, abs=0.01)  # one after the other, a second each


def test_the_others_runnable_work_is_inferred_from_the_cpu_time_they_got():
    async def one_job() -> float:
        cpu = CpuShare(2, 2.0, cpu_seconds=True)
        await cpu.run(1.0)  # 3 runnable on 2 CPUs: 2/3 each, 1.5 s
        return cpu.others_cpu_s(asyncio.get_running_loop().time())

    assert run_virtual(one_job()) == pytest.approx(2 * 2 / 3 * 1.5)
    cfg = tiny_config(pipeline={"mode": "async"})
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _cpu_profile(other_load=0.0)
    sim = run_mirror_measured(cfg, task, prof, 1.5)
    # on 2 CPUs next to the run's busy processes the others got less than their runnable work
    assert sim.other_runnable > 1.5
    assert sim.other_cpus == pytest.approx(1.5, rel=0.1)
    assert sim.makespan_s > run_mirror(cfg, task, prof, external=1.5).makespan_s
    wall = run_mirror_measured(cfg, task, _synthetic_profile(), 1.5)  # an older profile
    assert wall.other_runnable == 1.5


def test_the_others_load_over_a_runs_iterations_leaves_its_start_up_out():
    # sampled every second: 2 CPUs of others while the run started up, then 1
    series = [(1.0, 2.0), (2.0, 2.0), (3.0, 1.0), (4.0, 1.0), (5.0, 1.0)]
    assert window_load(series, 2.0, 5.0, 9.0) == pytest.approx(1.0)
    assert window_load(series, 1.5, 3.0, 9.0) == pytest.approx((0.5 * 2 + 1.0) / 1.5)
    assert window_load([], 0.0, 5.0, 9.0) == 9.0  # nothing sampled: the whole run's
