"""Other users' load that differs between the profile and the run: `CpuShare`'s external and
profiled_external, a time-varying external load, the mirror under load, and the calibration's
load measurements (real /proc, real processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.calibrate import series_in_virtual_time
from flexmarl.sim.calibration.machine import OtherLoad, profiled_load, tree_cpu_s
from flexmarl.sim.calibration.mirror import CpuShare, run_mirror
from flexmarl.sim.runtime.clock import run_virtual
from tests.sim.calibration.test_profile import _synthetic_profile, tiny_config

LOADED = [1.0, 0.67, 0.42]  # a curve measured next to one CPU's worth of other work, 2 CPUs


def _jobs(cpu: CpuShare, n: int, seconds: float = 1.0) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(cpu.run(seconds) for _ in range(n)))
        return loop.time()

    return run_virtual(main())


def test_equal_profiled_and_run_load_cancel():
    curve = [1.0, 0.9, 0.6]
    for n in (1, 2, 3):
        plain = _jobs(CpuShare(2, curve=curve), n)
        assert _jobs(CpuShare(2, 1.3, 1.3, curve), n) == pytest.approx(plain)
        assert _jobs(CpuShare(2, 0.4, 0.4, curve), n) == pytest.approx(plain)
    # without a curve: processor sharing, one process alone runs as profiled
    assert _jobs(CpuShare(2, 1.0, 1.0), 1) == pytest.approx(_jobs(CpuShare(2), 1))
    assert _jobs(CpuShare(4, 3.0, 3.0), 1) == pytest.approx(1.0)


def test_more_other_load_than_profiled_is_slower():
    curve = [1.0, 0.9, 0.6]
    times = [_jobs(CpuShare(2, e, 0.0, curve), 2) for e in (0.0, 0.5, 1.0, 2.0)]
    assert times == sorted(times) and times[0] < times[-1]
    # one more CPU's worth than profiled: two busy read the curve at 3
    assert times[2] == pytest.approx(1 / 0.6)
    # processor sharing: 2 CPUs, one job next to 3 others gets half a CPU
    assert _jobs(CpuShare(2, 3.0), 1) == pytest.approx(2.0)


def test_run_quieter_than_the_profile_is_faster():
    # profiled next to one CPU of other work: two busy ran at 0.67 each; with that work gone
    # they run as one did (the curve read at 1)
    assert _jobs(CpuShare(2, 1.0, 1.0, LOADED), 2) == pytest.approx(1 / 0.67)
    assert _jobs(CpuShare(2, 0.0, 1.0, LOADED), 2) == pytest.approx(1.0)
    # 1 CPU, profiled next to one other task: the profiled costs are twice the idle machine's
    assert _jobs(CpuShare(1, 0.0, 1.0), 1) == pytest.approx(0.5)
    assert _jobs(CpuShare(1, 0.0, 1.0, [1.0, 0.5]), 1) == pytest.approx(0.5)
    cpu = CpuShare(2, 0.0, 1.0, LOADED)
    assert cpu.rate(1) == pytest.approx(1.0)  # 2 CPUs: one alone was not slowed by one other
    assert cpu.rate(3) == pytest.approx(0.67)


def test_a_time_varying_load_is_followed():
    # 1 CPU: 2 s of work, alone for the first second, then next to one other task (half speed)
    assert _jobs(CpuShare(1, [(0.0, 0.0), (1.0, 1.0)]), 1, 2.0) == pytest.approx(3.0)
    # the load goes away again at 2: 1 s alone, 1 s at half speed, the last 0.5 s alone
    assert _jobs(CpuShare(1, [(0.0, 0.0), (1.0, 1.0), (2.0, 0.0)]), 1, 2.0) == pytest.approx(2.5)
    # a change while nothing runs does not count
    cpu = CpuShare(1, [(0.0, 1.0), (0.5, 0.0)])

    async def late() -> float:
        await asyncio.sleep(1.0)
        await cpu.run(1.0)
        return asyncio.get_running_loop().time()

    assert run_virtual(late()) == pytest.approx(2.0)
    assert cpu.external_at(0.2) == 1.0 and cpu.external_at(0.7) == 0.0
    # a constant series is the number
    assert _jobs(CpuShare(2, [(0.0, 1.5)], 0.5, LOADED), 2) == pytest.approx(
        _jobs(CpuShare(2, 1.5, 0.5, LOADED), 2))


def test_mirror_under_other_load():
    cfg = tiny_config(pipeline={"mode": "async"})
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _synthetic_profile()
    prof.contention = [1.0, 0.9, 0.6]
    base = run_mirror(cfg, task, prof).makespan_s
    spans = [run_mirror(cfg, task, prof, external=e, profiled_external=0.0).makespan_s
             for e in (0.0, 1.0, 2.0)]
    assert spans[0] == pytest.approx(base)
    assert spans[0] < spans[1] < spans[2]
    # the profile's own load (its probe or its other load, the larger) is the default
    prof.machine.update(external_load=0.3, other_load=1.0)
    assert profiled_load(prof.machine) == 1.0
    assert run_mirror(cfg, task, prof, external=1.0).makespan_s == pytest.approx(base)
    quieter = run_mirror(cfg, task, prof, external=0.0).makespan_s
    assert quieter < base
    # load for the second half only: between none and all along
    half = run_mirror(cfg, task, prof, external=[(0.0, 1.0), (base / 2, 3.0)]).makespan_s
    allalong = run_mirror(cfg, task, prof, external=3.0).makespan_s
    assert base < half < allalong


def test_series_in_virtual_time():
    # 1 s of start-up, then 4 s of iterations with no other load and then 1 CPU, half each;
    # simulated in 2 s
    series = [(0.5, 5.0), (1.0, 5.0), (2.0, 0.0), (3.0, 0.0), (4.0, 1.0), (5.0, 1.0)]
    got = series_in_virtual_time(series, 0.5, 4.0, 5.0, 2.0)
    assert got == [(0.0, 0.0), (0.5, 0.0), (1.0, 1.0), (1.5, 1.0)]
    # a mean that also holds the probe shifts the series up
    got = series_in_virtual_time(series, 1.0, 4.0, 5.0, 2.0)
    assert [v for _, v in got] == [0.5, 0.5, 1.5, 1.5]
    assert series_in_virtual_time([], 0.7, 4.0, 5.0, 2.0) == [(0.0, 0.7)]


def test_the_process_tree_and_other_load_series():
    t0 = tree_cpu_s()
    assert t0 is not None and t0 > 0
    # the child spins until it has used 0.3 CPU seconds, however loaded the machine is
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nwhile time.process_time() < 0.3: pass"])
    try:
        with OtherLoad(every=0.1) as load:
            entered = time.monotonic()
            mid = t0
            deadline = time.monotonic() + 30.0
            # the child's work is this tree's own, not other load
            while mid - t0 <= 0.05 and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                mid = tree_cpu_s() or t0
            time.sleep(max(0.0, 0.45 - (time.monotonic() - entered)))  # a few samples
    finally:
        child.wait()
    assert mid - t0 > 0.05
    assert len(load.series) >= 2
    assert all(v >= 0.0 for _, v in load.series)
    assert [t for t, _ in load.series] == sorted(t for t, _ in load.series)


def test_resimulate_reruns_the_mirror_on_a_calibrations_measurements(tmp_path, capsys):
    import json

    import yaml

    from flexmarl.sim.calibration.calibrate import resimulate

    cfg = tiny_config()
    config = tmp_path / "tiny.yaml"
    # in the config's agent order (the slots and replicas take agents in that order)
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _synthetic_profile()
    prof.contention = [1.0, 0.9, 0.6]
    rows = [{"mode": m, "measured_s_per_iteration": 0.1, "measured_steady_s": 0.1,
             "real_wall_s": 1.0, "external_load": 1.0,
             "load_series": [[0.5, 0.0], [1.0, 2.0]]} for m in ("sync", "async")]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({
        "config": str(config), "iterations": 2, "rows": rows,
        "profile": str(prof.save(tmp_path / "profile.json"))}))
    runs = {e: resimulate(calibration, external=e) for e in ("none", "mean", "series")}
    assert "measured s/it" in capsys.readouterr().out
    for i, mode in enumerate(("sync", "async")):
        plain = run_mirror(cfg, task, prof, mode=mode).per_iteration_s
        loaded = run_mirror(cfg, task, prof, mode=mode, external=1.0,
                            profiled_external=0.0).per_iteration_s
        # (the config and profile went through YAML and JSON: equal up to rounding)
        assert runs["none"][i].simulated_s == pytest.approx(plain, rel=1e-9)
        assert runs["mean"][i].simulated_s == pytest.approx(loaded, rel=1e-9)
        assert loaded > plain * 1.01  # one CPU more than profiled
        assert runs["mean"][i].simulated_unloaded_s == pytest.approx(plain, rel=1e-9)
        assert runs["mean"][i].error == pytest.approx((loaded - 0.1) / 0.1)
        assert runs["series"][i].simulated_s > plain * 1.01  # the run's second half loaded
