"""Other users' load window by window (issue 31, item 5): bursts cost what they cost, nice
weights drop out of the inferred runnable work, a reading above the machine is held to it."""

from __future__ import annotations

import asyncio
import os

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.compare import window_series
from flexmarl.sim.calibration.machine import OtherLoad
from flexmarl.sim.calibration.mirror import (
    CpuShare,
    _series_mean,
    run_mirror,
    run_mirror_measured,
    series_on_progress,
)
from flexmarl.sim.runtime.clock import run_virtual
from tests.sim.calibration.test_cpu_clock import _cpu_profile
from tests.sim.calibration.test_profile import tiny_config


async def _one_job(cpu: CpuShare, seconds: float) -> float:
    await cpu.run(seconds)
    return asyncio.get_running_loop().time()


@pytest.mark.parametrize("weight", [1.0, 1024 / 335, 335 / 1024])  # nice 0 vs 5, 5 vs 0
@pytest.mark.parametrize("n,runnable", [(1, 6.0), (3, 4.0), (2, 2.5)])
def test_nice_weights_drop_out_of_the_inferred_runnable_work(weight, n, runnable):
    # CFS on 2 CPUs, the others' D runnable at weight w next to the run's n at weight 1 (no
    # cap of one CPU binding): what the others get, c, is what the runnable work is inferred
    # from; equal-weight sharing with wD runnable gives both sides the same CPUs
    cores = 2.0
    ours = cores / (n + weight * runnable)
    assert ours < 1.0 and weight * runnable * ours / runnable < 1.0  # no cap binds
    took = weight * runnable * ours
    inferred = took * n / (cores - took)  # equal weights: cores * D' / (n + D') = took
    assert inferred == pytest.approx(weight * runnable)
    assert CpuShare(cores, inferred, cpu_seconds=True).rate(n) == pytest.approx(ours)


def test_a_burst_costs_more_than_its_mean():
    # no other work for a second, then 4 runnable on 2 CPUs: a 1.5 CPU-second job of one
    # process runs 1 s at full speed, then 0.5 at 2/5 of a CPU: 2.25 s, while the others got
    # 0.89 CPUs on average. Level runnable work that gets them the same leaves a CPU free
    # throughout: the job would take 1.5 s
    burst = CpuShare(2, [(0.0, 0.0), (1.0, 4.0)], cpu_seconds=True)
    assert run_virtual(_one_job(burst, 1.5)) == pytest.approx(2.25)
    got = burst.others_cpu_s(2.25) / 2.25
    # the level with the same mean CPU for the others: D / (1 + D) * 2 = got, held by one CPU
    level = got / (2 - got) if got > 1 else got
    flat = CpuShare(2, level, cpu_seconds=True)
    flat_s = run_virtual(_one_job(flat, 1.5))
    assert flat.others_cpu_s(flat_s) / flat_s == pytest.approx(got, rel=0.01)
    assert flat_s < 0.75 * 2.25


def test_a_reading_above_the_machine_is_held_to_what_the_run_left():
    cpus = float(os.cpu_count() or 1)
    assert OtherLoad._clamped(cpus + 0.21, 0.3) == pytest.approx(cpus - 0.3)
    assert OtherLoad._clamped(0.5, 0.3) == 0.5
    assert OtherLoad._clamped(-0.1, 0.3) == 0.0


def test_series_windows_and_their_place_in_virtual_time():
    # sampled every 0.5 s from the run's start; its iterations ran from 1.2 to 2.7
    series = [(0.5, 1.9), (1.0, 1.8), (1.5, 0.4), (2.0, 1.2), (2.5, 0.0), (3.0, 0.7)]
    window = window_series(series, 1.2, 2.7)
    assert window == [[0.3, 0.4], [0.8, 1.2], [1.3, 0.0], [1.5, 0.7]]
    assert _series_mean(window) == pytest.approx((0.3 * 0.4 + 0.5 * 1.2 + 0.2 * 0.7) / 1.5)
    # the same fraction of a simulated run three times as long
    points = series_on_progress([(t, v) for t, v in window], 1.5, 4.5)
    assert points == [(0.0, 0.4), pytest.approx((0.9, 1.2)), pytest.approx((2.4, 0.0)),
                      pytest.approx((3.9, 0.7))]


def test_the_mirror_next_to_a_bursty_series_is_slower_than_next_to_its_mean():
    cfg = tiny_config(pipeline={"mode": "sync"})
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _cpu_profile(other_load=0.0)
    quiet = run_mirror(cfg, task, prof, external=0.0)
    span = quiet.makespan_s
    # the others busy with 3 runnable in every other tenth of the run, idle in between
    series = [(span * (i + 1) / 10, 1.5 if i % 2 else 0.0) for i in range(10)]
    got = _series_mean(series)
    mean = run_mirror_measured(cfg, task, prof, got)
    bursty = run_mirror_measured(cfg, task, prof, got, series=series, makespan=span)
    assert bursty.other_cpus == pytest.approx(got, rel=0.1)
    assert mean.other_cpus == pytest.approx(got, rel=0.05)
    assert bursty.makespan_s > 1.1 * mean.makespan_s
