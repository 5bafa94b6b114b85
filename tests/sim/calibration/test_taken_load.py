"""The others' load as the CPU time they took, window by window (issue 31, item 5): bursts
cost what they cost, nice weights drop out, a reading above the machine is held to it."""

from __future__ import annotations

import asyncio
import os

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.compare import window_series
from flexmarl.sim.calibration.machine import OtherLoad
from flexmarl.sim.calibration.mirror import (
    CpuShare,
    run_mirror,
    run_mirror_series,
    series_on_progress,
)
from flexmarl.sim.runtime.clock import run_virtual
from tests.sim.calibration.test_cpu_clock import _cpu_profile
from tests.sim.calibration.test_profile import tiny_config


async def _one_job(cpu: CpuShare, seconds: float) -> float:
    await cpu.run(seconds)
    return asyncio.get_running_loop().time()


def test_the_runs_processes_share_what_the_others_left():
    cpu = CpuShare(2, 1.5, cpu_seconds=True, taken=True)
    assert cpu.rate(1) == pytest.approx(0.5)  # one busy: the half CPU left
    assert cpu.rate(2) == pytest.approx(0.25)
    assert CpuShare(2, 0.5, cpu_seconds=True, taken=True).rate(1) == 1.0  # a CPU free
    # a reading at or above the machine: a guard, never a stop
    assert CpuShare(2, 2.3, cpu_seconds=True, taken=True).rate(1) == pytest.approx(
        CpuShare.MIN_LEFT)


@pytest.mark.parametrize("weight", [1.0, 1024 / 335, 335 / 1024])  # nice 5 against 0, 0 against 5
@pytest.mark.parametrize("n,runnable", [(1, 3.0), (3, 4.0), (2, 0.5)])
def test_nice_weights_drop_out_of_what_the_others_took(weight, n, runnable):
    # weighted processor sharing (CFS) on 2 CPUs: the others' D runnable at weight w next to
    # the run's n at weight 1; what they took, c, is all the mirror is given
    cores = 2.0
    share = cores / (n + weight * runnable)  # per unit of weight, before caps
    ours, took = share, weight * runnable * share
    if n + runnable <= cores:
        ours, took = 1.0, runnable
    elif took > runnable:  # each of theirs at most a CPU: the rest is ours
        ours, took = min(1.0, (cores - runnable) / n), runnable
    elif share > 1.0:
        ours, took = 1.0, min(runnable, cores - n)
    got = CpuShare(cores, took, cpu_seconds=True, taken=True).rate(n)
    assert got == pytest.approx(ours)


def test_a_burst_costs_more_than_its_mean():
    # the others take nothing for a second, then 1.6 of 2 CPUs: a 1.5 CPU-second job of one
    # process runs 1 s at full speed, then 0.5 at 0.4: 2.25 s; at their mean (0.8) 1.5 s
    burst = run_virtual(_one_job(CpuShare(2, [(0.0, 0.0), (1.0, 1.6)], cpu_seconds=True,
                                          taken=True), 1.5))
    mean = run_virtual(_one_job(CpuShare(2, 0.8, cpu_seconds=True, taken=True), 1.5))
    assert burst == pytest.approx(2.25)
    assert mean == pytest.approx(1.5)
    # the others got what they took, by construction
    cpu = CpuShare(2, [(0.0, 0.0), (1.0, 1.6)], cpu_seconds=True, taken=True)
    run_virtual(_one_job(cpu, 1.5))
    assert cpu.others_cpu_s(2.25) == pytest.approx(1.25 * 1.6)


def test_a_reading_above_the_machine_is_held_to_what_the_run_left():
    cpus = float(os.cpu_count() or 1)
    assert OtherLoad._clamped(cpus + 0.21, 0.3) == pytest.approx(cpus - 0.3)
    assert OtherLoad._clamped(0.5, 0.3) == 0.5
    assert OtherLoad._clamped(-0.1, 0.3) == 0.0


def test_series_windows_and_their_place_in_virtual_time():
    # sampled every 0.5 s from the run's start; its iterations ran from 1.2 to 2.7
    series = [(0.5, 1.9), (1.0, 1.8), (1.5, 0.4), (2.0, 1.2), (2.5, 0.0), (3.0, 0.7)]
    assert window_series(series, 1.2, 2.7) == [[0.3, 0.4], [0.8, 1.2], [1.3, 0.0], [1.5, 0.7]]
    # the same fraction of a simulated run three times as long
    points = series_on_progress([(0.3, 0.4), (0.8, 1.2), (1.3, 0.0), (1.5, 0.7)], 1.5, 4.5)
    assert points == [(0.0, 0.4), pytest.approx((0.9, 1.2)), pytest.approx((2.4, 0.0)),
                      pytest.approx((3.9, 0.7))]


def test_the_mirror_next_to_a_bursty_series_is_slower_than_next_to_its_mean():
    cfg = tiny_config(pipeline={"mode": "sync"})
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _cpu_profile(other_load=0.0)
    quiet = run_mirror(cfg, task, prof, external=0.0, taken=True)
    span = quiet.makespan_s
    # the others take 1.8 CPUs in every other tenth of the run, nothing in between: a mean
    # of 0.9 leaves a whole CPU to the sync run's one busy process throughout
    series = [(span * (i + 1) / 10, 1.8 if i % 2 else 0.0) for i in range(10)]
    mean = run_mirror(cfg, task, prof, external=0.9, taken=True)
    bursty = run_mirror_series(cfg, task, prof, series, span)
    assert mean.makespan_s == pytest.approx(quiet.makespan_s, rel=0.02)
    assert bursty.makespan_s > 1.3 * mean.makespan_s
