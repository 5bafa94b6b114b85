"""The mirror charges what real runs spend (issue 31 item 5): the driver's CPU as a real run
measures it, a training slot's commands next to a busy replica, kept swap-ins as the token
path, swaps in the records, and a colocated replica's sleep and wake."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.fits import LocalProfile, constant
from flexmarl.sim.calibration.mirror import CpuShare, run_mirror
from flexmarl.sim.runtime.clock import run_virtual
from tests.sim.calibration.test_profile import _synthetic_profile, tiny_config


def _task(cfg):
    return load_task(cfg.task.builder, cfg.task.options)


def test_a_job_with_overlap_spends_more_cpu_while_another_worker_is_busy():
    async def jobs(overlap: float) -> tuple[float, float, CpuShare]:
        cpu = CpuShare(2)
        loop = asyncio.get_running_loop()
        ends: dict[str, float] = {}

        async def one(who: str, seconds: float, factor: float) -> None:
            await cpu.run(seconds, who, factor)
            ends[who] = loop.time()

        await asyncio.gather(one("train", 1.0, overlap), one("rollout", 1.0, 1.0))
        return ends["train"], ends["rollout"], cpu

    train, rollout, cpu = run_virtual(jobs(1.5))
    # 2 CPUs, 2 busy: the replica's second is done at 1.0; the slot spends 1.5 CPU seconds a
    # profiled one meanwhile (2/3 done), then the last third alone
    assert rollout == pytest.approx(1.0)
    assert train == pytest.approx(1.0 + 1.0 / 3.0)
    charged = sum(s for _, who, s in cpu.log if who == "train")
    assert charged == pytest.approx(1.0 + 1.0 / 3.0)  # the profiled second and the excess
    alone, _, _ = run_virtual(jobs(1.0))
    assert alone == pytest.approx(1.0)
    # the driver next to a slot does not count as another worker
    async def next_to_driver() -> float:
        cpu = CpuShare(2)
        await asyncio.gather(cpu.run(1.0, "train", 2.0), cpu.run(1.0, "driver"))
        return asyncio.get_running_loop().time()

    assert run_virtual(next_to_driver()) == pytest.approx(1.0)


def test_a_slots_overlap_stretches_its_work_only_next_to_another_busy_worker():
    cfg = tiny_config()
    task = _task(cfg)
    base, slowed = _synthetic_profile(), _synthetic_profile()
    slowed.overlap = {"train_accumulate": 2.0, "train_step": 2.0}
    assert LocalProfile.from_dict(slowed.to_dict()).overlap == slowed.overlap
    sync = [run_mirror(cfg, task, p, mode="sync").cpu_by_kind(False) for p in (base, slowed)]
    # sync, one slot: nothing of the run's is busy next to it, nothing more is spent
    assert sync[1]["train"] == pytest.approx(sync[0]["train"], rel=1e-6)
    # a slot per agent: the three accumulate side by side, each at the overlap's cost
    three = tiny_config(runtime={"kind": "local", "rollout_workers": 1, "train_workers": 3,
                                 "torch_threads": 1})
    apart = [run_mirror(three, task, p, mode="sync") for p in (base, slowed)]
    assert apart[1].cpu_by_kind(False)["train"] > apart[0].cpu_by_kind(False)["train"] * 1.2
    assert apart[1].per_iteration_s > apart[0].per_iteration_s


def test_the_driver_costs_what_the_run_measured_scaled_in_a_pipelined_mode():
    cfg = tiny_config()
    task = _task(cfg)
    prof = _synthetic_profile()
    prof.driver = {"per_request_s": 7e-5, "per_train_call_s": 4e-4, "pipelined": 2.0}
    assert prof.driver_scale("sync") == 1.0 and prof.driver_scale("async") == 2.0
    plain = _synthetic_profile()
    got = {m: run_mirror(cfg, task, p, mode=m).cpu_by_kind(False)["driver"]
           for m, p in (("sync", prof), ("async", prof))}
    base = {m: run_mirror(cfg, task, plain, mode=m).cpu_by_kind(False)["driver"]
            for m in ("sync", "async")}
    assert got["sync"] == pytest.approx(base["sync"], rel=1e-6)
    assert got["async"] == pytest.approx(2.0 * base["async"], rel=0.05)
    assert LocalProfile.from_dict(prof.to_dict()).driver == prof.driver


def test_a_kept_swap_in_costs_the_token_path_not_a_state_transfer():
    cfg = tiny_config()  # three agents, one slot: every swap-in after the first is kept
    task = _task(cfg)
    cheap, dear = _synthetic_profile(), _synthetic_profile()
    for p, kept in ((cheap, 1e-5), (dear, 1.0)):
        for a in p.agents.values():
            a.fits["swap_in"] = constant([1.0])
            a.fits["swap_in_kept"] = constant([kept])
    fast = run_mirror(cfg, task, cheap, mode="sync")
    slow = run_mirror(cfg, task, dear, mode="sync")
    swaps = sum(r["pool/train/swaps"] for r in fast.records)
    assert swaps >= 3
    # a full swap-in (1 s) is charged nowhere: the swap-ins after the three builds are kept
    # and cost their token path (1 s each in `dear`)
    its = len(fast.records)
    assert fast.cpu_by_kind(False)["train"] * its < 1.0
    kept = (slow.cpu_by_kind(False)["train"] - fast.cpu_by_kind(False)["train"]) * its
    assert kept == pytest.approx(round(kept), abs=1e-3) and round(kept) >= swaps - 3


def test_a_colocated_replicas_sleep_and_wake_cost_their_profiled_time():
    cfg = tiny_config(runtime={"kind": "local", "rollout_workers": 1, "train_workers": 1,
                               "torch_threads": 1, "colocate": True})
    task = _task(cfg)
    free, priced = _synthetic_profile(), _synthetic_profile()
    for a in priced.agents.values():
        a.fits["sleep"] = constant([0.01])
        a.fits["wake"] = constant([0.02])
    a, b = (run_mirror(cfg, task, p, mode="sync") for p in (free, priced))
    sleeps = [s for s in b.spans if s.label.startswith("sleep:")]
    wakes = [s for s in b.spans if s.label.startswith("wake:")]
    assert sleeps and wakes
    assert not any(s.label.startswith(("sleep:", "wake:")) for s in a.spans)
    # every sleep or wake: three engines on the replica
    extra = (b.cpu_by_kind(False)["rollout"] - a.cpu_by_kind(False)["rollout"]) * len(b.records)
    assert extra == pytest.approx(3 * (0.01 * len(sleeps) + 0.02 * len(wakes)), rel=1e-6)
    assert b.per_iteration_s > a.per_iteration_s


def test_a_collective_publication_stops_the_replica_for_the_measured_send():
    cfg = tiny_config()
    task = _task(cfg)
    plain, measured = _synthetic_profile(), _synthetic_profile()
    measured.driver = {"publish_s": 0.05}
    for mode in ("sync", "async"):
        a, b = (run_mirror(cfg, task, p, mode=mode) for p in (plain, measured))
        sends = [s for s in b.spans if s.label.startswith("publish:")]
        loads = [s for s in b.spans if s.label.startswith("load:")]
        # every version after the first goes out from its slot, and the replica loads it
        assert len(sends) >= len(cfg.agents) * (len(b.records) - 1) and len(loads) >= len(sends)
        assert min(s.end - s.start for s in sends) >= 0.05 - 1e-9
        assert not any(s.label.startswith("publish:") for s in a.spans)  # through the pipes
        if mode == "sync":  # nothing decodes meanwhile: each send is on the critical path
            assert b.makespan_s > a.makespan_s + 0.05 * (len(b.records) - 1)
    # `runtime.publication: pipe` (and one_step_off's auto) keeps the pipes
    piped = tiny_config(runtime={"kind": "local", "rollout_workers": 1, "train_workers": 1,
                                 "torch_threads": 1, "publication": "pipe"})
    sim = run_mirror(piped, task, measured, mode="async")
    assert not any(s.label.startswith("publish:") for s in sim.spans)


def test_a_niced_replica_gets_the_cpu_the_others_leave():
    """`runtime.rollout_nice`: CFS weights in the mirror's processor sharing (water filling,
    no process more than one CPU)."""
    from flexmarl.policy.device import nice_weight

    async def jobs(weights: dict[str, float] | None) -> tuple[dict[str, float], CpuShare]:
        cpu = CpuShare(2, cpu_seconds=True, weights=weights)
        loop = asyncio.get_running_loop()
        ends: dict[str, float] = {}

        async def one(who: str) -> None:
            await cpu.run(1.0, who)
            ends[who] = loop.time()

        await asyncio.gather(*(one(w) for w in ("driver", "train", "rollout")))
        return ends, cpu

    equal, _ = run_virtual(jobs(None))
    assert all(t == pytest.approx(1.5) for t in equal.values())  # 3 on 2 CPUs: 2/3 each
    w = nice_weight(10)
    assert w == pytest.approx(110 / 1024, rel=0.01)
    ends, cpu = run_virtual(jobs({"rollout": w}))
    first = (2 + w) / 2  # driver and slot at 2 / (2 + w) of a CPU each
    assert ends["train"] == pytest.approx(first) and ends["driver"] == pytest.approx(first)
    assert ends["rollout"] == pytest.approx(first + 1 - first * 2 * w / (2 + w))
    assert cpu.got_s == pytest.approx(3.0)  # every CPU second of work was got, once
    # next to 3 CPUs of other load: the others capped at what they can run, the rest shared
    share = CpuShare(2, external=3.0, cpu_seconds=True, weights={"rollout": w})
    share.jobs = {1: [1.0, None, "train", 1.0], 2: [1.0, None, "rollout", 1.0]}
    shares, others = share._shares()
    assert sum(shares.values()) + others == pytest.approx(2.0)
    assert shares[1] == pytest.approx(2 / (4 + w)) and shares[2] == pytest.approx(2 * w / (4 + w))


def test_in_situ_scales_make_the_mirror_spend_what_the_profiles_real_run_did():
    """`profile.in_situ_scales`: the profile's real sync run against its mirror, kind by kind.
    A "real" trace that is the mirror's own run 1.5x slower reads x1.5 for every kind of work
    it holds; the profile scaled by those ratios then spends 1.5x the busy seconds (the same
    window, the iterations after the first)."""
    import dataclasses

    from flexmarl.sim.calibration.mirror import mirror_config
    from flexmarl.sim.calibration.profile import in_situ_scales
    from flexmarl.sim.calibration.waits import figures

    cfg = tiny_config(train={"iterations": 4, "inputs_per_iteration": 4, "group_size": 2,
                             "micro_batch_size": 4})
    task, prof = _task(cfg), _synthetic_profile()
    sim = run_mirror(mirror_config(cfg, 4, "sync"), task, prof, external=0.0)
    slower = ([dataclasses.replace(s, start=1.5 * s.start, end=1.5 * s.end) for s in sim.spans],
              [{**e, "time": 1.5 * e["time"]} for e in sim.events])
    ratios = in_situ_scales(prof, cfg, task, slower, iterations=4)
    assert set(ratios) >= {"rollout", "train_accumulate", "train_step"}
    assert all(r == pytest.approx(1.5) for r in ratios.values()), ratios
    same = in_situ_scales(prof, cfg, task, (sim.spans, sim.events), 4)
    assert same == pytest.approx(dict.fromkeys(ratios, 1.0))
    scaled = dataclasses.replace(prof, worker_scale={k: prof.scale(k) * r
                                                     for k, r in ratios.items()})
    again = run_mirror(mirror_config(cfg, 4, "sync"), task, scaled, external=0.0)
    before, after = (figures(s.spans, s.events, 4) for s in (sim, again))
    for kind in ("busy:rollout:gen", "busy:train:acc"):
        assert after[kind] == pytest.approx(1.5 * before[kind], rel=0.1), kind
    assert in_situ_scales(prof, cfg, task, ()) == {}  # no trace read: as fitted


def test_in_situ_reads_a_real_sync_runs_trace(tmp_path):
    """The real path of the in-situ check: a real sync run of a tiny config (its worker
    processes, its trace.json, as `measure_driver` makes it) against the mirror of a
    synthetic profile gives a ratio for the decode and the micro-batches."""
    from flexmarl.sim.calibration.mirror import mirror_config
    from flexmarl.sim.calibration.profile import driver_marks, in_situ_scales

    cfg = tiny_config(train={"iterations": 4, "inputs_per_iteration": 4, "group_size": 2,
                             "micro_batch_size": 4})
    trace: list = []
    driver_marks(mirror_config(cfg, mode="sync"), 4, None, trace)
    assert len(trace) == 2 and trace[0] and trace[1]  # spans, events
    ratios = in_situ_scales(_synthetic_profile(), cfg, _task(cfg), trace, 4)
    assert {"rollout", "train_accumulate"} <= set(ratios), ratios
    assert all(r > 0 for r in ratios.values())
