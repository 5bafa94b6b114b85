"""The worker probes' CPU seconds: a worker's busy spans turned into CPU time call by call
from the scheduler's nanosecond counters (real processes sharing one real CPU), and the
mirror's CPU charge by process kind (what `benchmarks/pipeline_cpu.py` sets beside a real
run's), and the window of a real run's iterations the others' load is read over."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.machine import IterationClock, on_cpu_share, sched_times_s
from flexmarl.sim.calibration.mirror import CpuShare, run_mirror
from flexmarl.sim.calibration.profile import _OnCpu, _Spans
from flexmarl.sim.runtime.clock import run_virtual
from tests.sim.calibration.test_profile import _synthetic_profile, tiny_config

SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass"

needs_counters = pytest.mark.skipif(
    sched_times_s(os.getpid()) is None or not hasattr(os, "sched_setaffinity"),
    reason="no per-thread scheduler counters (/proc/PID/task/*/schedstat) or no affinity")


def test_on_cpu_share_of_two_readings():
    assert on_cpu_share((1.0, 2.0), (1.3, 2.1)) == pytest.approx(0.75)
    assert on_cpu_share((1.0, 2.0), (1.5, 2.0)) == pytest.approx(1.0)
    assert on_cpu_share(None, (1.0, 1.0)) is None
    assert on_cpu_share((1.0, 1.0), (1.0, 1.5)) is None  # never on a CPU in between


def _spinners_on(cpu: int, n: int, seconds: float) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)])
             for _ in range(n)]
    for p in procs:
        os.sched_setaffinity(p.pid, {cpu})
    return procs


@needs_counters
def test_two_processes_on_one_cpu_each_get_at_most_about_half():
    """Two spinners pinned to one CPU: each is runnable throughout, on it about half the time
    (others' work only lowers that), and together they got no more than the one CPU."""
    cpu = min(os.sched_getaffinity(0))
    procs = _spinners_on(cpu, 2, 0.6)
    try:
        time.sleep(0.1)  # both started and pinned
        before = [sched_times_s(p.pid) for p in procs]
        t0 = time.perf_counter()
        time.sleep(0.3)
        after = [sched_times_s(p.pid) for p in procs]
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.wait()
    shares = [on_cpu_share(b, a) for b, a in zip(before, after, strict=True)]
    assert all(s is not None and 0.02 < s < 0.7 for s in shares), shares
    on = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    assert on <= wall * 1.05


@needs_counters
def test_a_preempted_calls_spans_turn_into_its_cpu_seconds():
    """A 'worker' (this process, pinned to one CPU next to a spinner) reports a busy span of
    0.25 s wall: `_OnCpu` turns it into about the CPU seconds it got, not the wall time."""
    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    sink = _Spans()
    on_cpu = _OnCpu(SimpleNamespace(process=SimpleNamespace(pid=os.getpid())), sink)
    spinner = _spinners_on(cpu, 1, 0.6)[0]

    async def work() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < 0.25:
            pass
        sink.span("train", 0, t0, time.perf_counter(), "acc:a")
        return time.process_time() - c0

    try:
        os.sched_setaffinity(0, {cpu})
        got: list[float] = []

        async def main() -> list:
            async def timed() -> None:
                got.append(await work())
            return await on_cpu.measure(timed())

        spans = asyncio.run(main())
    finally:
        os.sched_setaffinity(0, mine)
        spinner.wait()
    (kind, wall, share), = spans
    assert kind == "acc" and share is not None
    cpu_s = on_cpu.cpu_s(spans)
    assert cpu_s == pytest.approx(got[0], abs=0.03)
    assert cpu_s < 0.8 * wall  # preempted: the wall span is not its CPU time


def test_the_mirrors_cpu_charge_by_kind_sums_to_its_own_cpu():
    cfg = tiny_config()
    task = load_task(cfg.task.builder, cfg.task.options)
    res = run_mirror(cfg, task, _synthetic_profile(), mode="sync")
    every = res.cpu_by_kind(after_first=False)
    assert set(every) == {"rollout", "train", "driver"}
    assert sum(every.values()) * len(res.records) == pytest.approx(res.own_cpu_s, rel=1e-9)
    later = res.cpu_by_kind()
    assert 0 < later["train"] <= every["train"] * len(res.records)
    # no contention curve, no other load: the CPU time its processes got is what they charged
    assert res.own_cpu_got_s == pytest.approx(res.own_cpu_s, rel=1e-6)


def test_cpu_time_got_grows_where_contention_slows_a_cpu_second():
    async def main(cpu: CpuShare) -> None:
        await asyncio.gather(cpu.run(1.0), cpu.run(1.0))

    plain, slowed = CpuShare(2), CpuShare(2, curve=[1.0, 0.8], cpu_seconds=True)
    for cpu in (plain, slowed):
        run_virtual(main(cpu))
    assert plain.got_s == pytest.approx(2.0) and plain.busy_s == pytest.approx(2.0)
    # two busy on 2 CPUs, each CPU second doing 0.8 of one's work: 2.5 CPU seconds taken
    assert slowed.got_s == pytest.approx(2.5) and slowed.busy_s == pytest.approx(2.0)


def test_the_iterations_window_ends_at_the_last_iteration_not_the_teardown():
    clock = IterationClock(time.perf_counter() - 10.0)  # the load's sampling began 10 s ago
    clock.mark({"iteration": 0, "time_s": 0.5})
    time.sleep(0.02)
    clock.mark({"iteration": 1, "time_s": 1.0})
    start, end = clock.window()
    assert 10.0 < end < 11.0 and end - start == pytest.approx(1.0)
    assert IterationClock(0.0).window() is None
