"""The local profiler's fits and JSON, the mirrored local runtime, and --profile-local end to
end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from flexmarl.config.schema import config_from_dict
from flexmarl.graph.task import load_task
from flexmarl.sim.calibration.fits import AgentProfile, Fit, LocalProfile, constant, fit_linear
from flexmarl.sim.calibration.mirror import CpuShare, run_mirror
from flexmarl.sim.runtime.clock import run_virtual

MODEL = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2}


def tiny_config(**over):
    data = {
        "name": "tiny_relay",
        "seed": 0,
        "task": {"builder": "flexmarl.tasks.referential:build_relay_chain",
                 "options": {"num_objects": 4, "num_candidates": 2, "message_length": 1,
                             "relay_length": 2, "num_symbols": 4}},
        "agents": {a: {"model": MODEL} for a in ("speaker", "relay", "listener")},
        "train": {"iterations": 2, "inputs_per_iteration": 4, "group_size": 2,
                  "micro_batch_size": 4},
        "pipeline": {"mode": "sync"},
        "rollout": {"max_batch_seqs": 8},
        "runtime": {"kind": "local", "rollout_workers": 1, "train_workers": 1,
                    "torch_threads": 1},
    }
    data.update(over)
    return config_from_dict(data, "tiny")


def test_fit_recovers_known_constants():
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for seqs in [1, 2, 4, 8, 16, 32]:
        for width in [1, 4, 16, 64]:
            x = {"seqs": seqs, "tokens": seqs * width}
            xs.append(x)
            ys.append(0.002 + 3e-5 * seqs + 1e-6 * x["tokens"] + rng.normal(0, 1e-7))
    fit = fit_linear(["1", "seqs", "tokens"], xs, ys)
    assert fit.coef["1"] == pytest.approx(0.002, rel=1e-2)
    assert fit.coef["seqs"] == pytest.approx(3e-5, rel=2e-2)
    assert fit.coef["tokens"] == pytest.approx(1e-6, rel=2e-2)
    assert fit(seqs=10, tokens=100) == pytest.approx(0.002 + 3e-4 + 1e-4, rel=1e-2)
    assert fit.n == len(ys) and fit.rmse < 1e-6


def test_fit_drops_a_negative_term_and_refits():
    xs = [{"rows": r, "tokens": t} for r in (1, 2, 4, 8) for t in (10, 40, 160)]
    # the cost shrinks with rows: impossible for work, so `rows` goes and the rest is refitted
    ys = [0.01 + 2e-5 * x["tokens"] - 1e-4 * x["rows"] for x in xs]
    fit = fit_linear(["1", "rows", "tokens"], xs, ys)
    assert fit.coef["rows"] == 0.0
    assert all(c >= 0 for c in fit.coef.values())
    assert fit.coef["tokens"] > 0
    assert constant([3.0, 1.0, 2.0]).coef == {"1": 2.0}
    assert constant([3.0, 1.0, 2.0], "min").coef == {"1": 1.0}


def _synthetic_profile(scale: float = 1.0) -> LocalProfile:
    fits = {
        "prefill": Fit(["1", "seqs", "tokens"], {"1": 2e-3 * scale, "seqs": 1e-4 * scale,
                                                "tokens": 1e-5 * scale}),
        "decode": Fit(["1", "seqs", "tokens"], {"1": 2e-3 * scale, "seqs": 2e-5 * scale,
                                               "tokens": 0.0}),
        "load_weights": constant([1e-3 * scale]),
        "accumulate": Fit(["1", "rows", "tokens"], {"1": 5e-3 * scale, "rows": 0.0,
                                                   "tokens": 2e-5 * scale}),
        "step": constant([3e-3 * scale]),
        "weights": constant([5e-4 * scale]),
        "get_state": constant([1e-3 * scale]),
        "swap_out": constant([2e-3 * scale]),
        "swap_in": constant([1e-2 * scale]),
        "build": constant([1e-2 * scale]),
        "replica_overhead": Fit(["1", "requests"], {"1": 5e-4 * scale, "requests": 2e-5}),
    }
    agents = {a: AgentProfile(dict(fits), [1, 2], [4, 5], False, 40_000)
              for a in ("speaker", "relay", "listener")}
    ipc = {"ipc_generate": Fit(["1", "requests"], {"1": 2e-4, "requests": 1e-5}),
           "ipc_call": Fit(["1", "bytes"], {"1": 3e-4, "bytes": 1e-9})}
    return LocalProfile("tiny_relay", 1, agents, ipc, 7e-5, {"cpus": 2, "external_load": 0.0},
                        1.0, 4e-4)


def test_profile_json_round_trips(tmp_path):
    prof = _synthetic_profile()
    path = prof.save(tmp_path / "run" / "profile.json")
    back = LocalProfile.load(path)
    assert back.to_dict() == prof.to_dict()
    assert back.agents["relay"].fits["decode"](seqs=4, tokens=40) == pytest.approx(
        prof.agents["relay"].fits["decode"](seqs=4, tokens=40))
    data = prof.to_dict()
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        LocalProfile.from_dict(data)


def test_cpu_share_is_processor_sharing():
    async def two_jobs(cores: float, external: float) -> float:
        cpu = CpuShare(cores, external)
        loop = asyncio.get_running_loop()
        await asyncio.gather(cpu.run(1.0), cpu.run(1.0))
        return loop.time()

    assert run_virtual(two_jobs(1, 0)) == pytest.approx(2.0)
    assert run_virtual(two_jobs(2, 0)) == pytest.approx(1.0)
    assert run_virtual(two_jobs(2, 1)) == pytest.approx(1.5)  # 2 CPUs for 3 runnable tasks


def test_mirror_simulates_the_local_runtime_both_modes():
    cfg = tiny_config()
    task = load_task(cfg.task.builder, cfg.task.options)
    prof = _synthetic_profile()
    runs = {m: run_mirror(cfg, task, prof, mode=m) for m in ("sync", "async")}
    for mode, res in runs.items():
        assert len(res.records) == 2, mode
        assert res.per_iteration_s > 0
        assert res.requests == 2 * 4 * 2 * 3  # iterations x inputs x group x nodes
        # one slot for three agents: they take turns, swapping (the production allocator),
        # and the records count the swaps as a real run's do (the slot's `swap:` spans)
        assert any(s.label.startswith("swap:") for s in res.spans)
        assert sum(r["pool/train/swaps"] for r in res.records) > 0
    again = run_mirror(cfg, task, prof, mode="sync")
    assert again.per_iteration_s == runs["sync"].per_iteration_s  # deterministic
    slower = run_mirror(cfg, task, _synthetic_profile(scale=2.0), mode="sync")
    assert slower.per_iteration_s > runs["sync"].per_iteration_s
    # more training slots: fewer swaps
    three = tiny_config(runtime={"kind": "local", "rollout_workers": 1, "train_workers": 3})
    spread = run_mirror(three, task, prof, mode="sync")
    assert sum(s.label.startswith("swap:") for s in spread.spans) < sum(
        s.label.startswith("swap:") for s in runs["sync"].spans)


@pytest.mark.slow
def test_profile_local_end_to_end(tmp_path, capsys):
    """Profiles a tiny config, runs it for real in both modes, simulates it, prints the table.
    (The 25% target is reported by the command, not asserted: timing here is shared.)"""
    import yaml

    from flexmarl.cli.main import main
    from flexmarl.sim.calibration.fits import LocalProfile as Profile

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config().model_dump(mode="json")))
    out = tmp_path / "cal"
    assert main(["simulate", "--profile-local", str(config), "--iterations", "2",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured s/it" in text and "simulated s/it" in text
    lines = [line.split() for line in text.splitlines() if line.split()[:1] in (["sync"],
                                                                               ["async"])]
    assert [row[0] for row in lines] == ["sync", "async"]
    prof = Profile.load(out / "profile.json")
    assert set(prof.agents) == {"speaker", "relay", "listener"}
    assert prof.agents["relay"].fits["decode"].coef["1"] > 0
    # CPU seconds, and how much each repeated quantity's rounds differed
    assert prof.clock == "cpu" and "rollout" in prof.spread and "contention_2" in prof.spread
    # what real runs spend beyond the fits: the driver in real runs of the config, a slot's
    # commands next to a busy replica, a kept swap-in, a colocated engine's sleep and wake
    assert prof.driver["per_request_s"] > 0 and prof.driver["per_train_call_s"] > 0
    assert prof.parent_per_request_s == prof.driver["per_request_s"]
    assert prof.driver["pipelined"] > 0 and prof.driver["echo_per_request_s"] > 0
    assert prof.overlap and set(prof.overlap) <= {"train_bind", "train_accumulate", "train_step"}
    # the fits checked against the profile's own real sync run (`in_situ_scales`): decode
    # and micro-batches at least, each ratio folded into the worker scale
    assert {"rollout", "train_accumulate"} <= set(prof.in_situ)
    assert all(0.0 < r < 10.0 for r in prof.in_situ.values()), prof.in_situ  # swaps: ~0.15
    fits = prof.agents["relay"].fits
    assert {"swap_in_kept", "sleep", "wake"} <= set(fits)
    assert fits["swap_in_kept"]() < fits["swap_in"]()
    assert (out / "calibration.json").exists()
    assert (out / "real-sync" / "metrics.jsonl").exists()
    assert (out / "real-async" / "metrics.jsonl").exists()


def _span_sums(res) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in res.spans:
        kind = s.label.split(":")[0]
        out[kind] = out.get(kind, 0.0) + s.end - s.start
    return out


def test_mirror_serves_each_request_once_and_counts_every_busy_turn():
    cfg = tiny_config()
    task = load_task(cfg.task.builder, cfg.task.options)
    res = run_mirror(cfg, task, _synthetic_profile(), mode="sync")
    # relay_length 2: the relay's requests take one turn (admission + one decode step), the
    # 1-token nodes one turn: 3 agents x 2 iterations, each batch of 8 in one turn
    gens = [s for s in res.spans if s.label.startswith("gen:")]
    assert len(gens) == 3 * 2
    assert all(s.end > s.start for s in gens)


def test_worker_scale_stretches_that_commands_work_in_virtual_time():
    cfg = tiny_config()
    task = load_task(cfg.task.builder, cfg.task.options)
    base = _synthetic_profile()
    scaled = _synthetic_profile()
    scaled.worker_scale = {"train_accumulate": 2.0, "rollout": 3.0}
    a, b = (_span_sums(run_mirror(cfg, task, p, mode="sync")) for p in (base, scaled))
    # sync: nothing else is busy while the slot accumulates or the replica decodes (the
    # parent waits), so the spans stretch by exactly the factor; other commands do not
    assert b["acc"] == pytest.approx(2.0 * a["acc"], rel=1e-6)
    assert b["gen"] == pytest.approx(3.0 * a["gen"], rel=1e-6)
    assert b["step"] == pytest.approx(a["step"], rel=1e-6)
    assert LocalProfile.from_dict(scaled.to_dict()).scale("rollout") == 3.0
    assert base.scale("train_bind") == 1.0  # not measured: the fits as they are


def test_ipc_one_way_costs():
    from flexmarl.sim.calibration.mirror import SimTrainWorker

    prof = _synthetic_profile()
    w = SimTrainWorker(0, prof, None, None, None)  # type: ignore[arg-type]
    # a call's payload travels one way: half the fixed round trip, all of the per-byte cost
    assert w._ipc("ipc_call", bytes=1e6) == pytest.approx(1.5e-4 + 1e-3)
    # generate round trips carried requests out and replies back: half of all of it
    assert w._ipc("ipc_generate", requests=10) == pytest.approx((2e-4 + 1e-4) / 2)
    # a bind carrying a swapped-out state back in: weights and two Adam moments
    assert w._payload_bytes("bind", ("relay", ("host", b""))) == 3 * 40_000
    assert w._payload_bytes("bind", ("relay", None)) == 256


def test_other_load_is_in_cpus_and_leaves_out_this_process():
    import time as _time

    from flexmarl.sim.calibration.machine import OtherLoad

    with OtherLoad() as load:
        t0 = _time.perf_counter()
        while _time.perf_counter() - t0 < 0.3:  # our own busy work is not other load
            pass
    assert 0.0 <= load.cpus <= 2.5  # 2 CPUs here; others' work may come and go


def test_cpu_share_follows_a_measured_contention_curve():
    async def jobs(cpu: CpuShare, n: int) -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(cpu.run(1.0) for _ in range(n)))
        return loop.time()

    # 2 cores, no curve: processor sharing, two busy processes each at full speed
    assert run_virtual(jobs(CpuShare(2), 2)) == pytest.approx(1.0)
    # a curve saying two busy processes each run at 50%: twice as long
    half = [1.0, 0.5, 0.4]
    assert run_virtual(jobs(CpuShare(2, curve=half), 2)) == pytest.approx(2.0)
    assert run_virtual(jobs(CpuShare(2, curve=half), 3)) == pytest.approx(1 / 0.4)
    assert run_virtual(jobs(CpuShare(2, curve=half), 1)) == pytest.approx(1.0)
    cpu = CpuShare(2, curve=half)
    assert cpu.speed(1.5) == pytest.approx(0.75)  # linear between the points
    assert cpu.speed(6) == pytest.approx(0.4 * 3 / 6)  # past the curve: its throughput shared
    assert CpuShare(2, curve=[]).speed(3) == pytest.approx(2 / 3)  # empty: cores / n


def test_mirror_uses_the_profiles_contention_curve():
    cfg = tiny_config(pipeline={"mode": "async"})
    task = load_task(cfg.task.builder, cfg.task.options)
    old = _synthetic_profile()  # no curve: an older profile, cores / n
    flat = _synthetic_profile()
    flat.contention = [1.0, 1.0, 2 / 3]  # what cores / n says on 2 CPUs
    slow = _synthetic_profile()
    slow.contention = [1.0, 0.5, 1 / 3]
    a, b, c = (run_mirror(cfg, task, p) for p in (old, flat, slow))
    assert b.makespan_s == pytest.approx(a.makespan_s, rel=1e-9)
    # async overlaps the replica, the slot and the parent: contention slows the run down,
    # by less than 2x (not everything overlaps)
    assert a.makespan_s < c.makespan_s < 2.0 * a.makespan_s
    # an explicit core count is a what-if: processor sharing, whatever the curve
    assert run_mirror(cfg, task, slow, cores=2).makespan_s == pytest.approx(a.makespan_s)


def test_profile_json_round_trips_the_contention_curve(tmp_path):
    prof = _synthetic_profile()
    prof.contention = [1.0, 0.62, 0.41]
    back = LocalProfile.load(prof.save(tmp_path / "p.json"))
    assert back.contention == [1.0, 0.62, 0.41]
    data = prof.to_dict()
    del data["contention"]  # a profile written before the curve existed
    assert LocalProfile.from_dict(data).contention == []


@pytest.mark.slow
def test_contention_probe_runs_real_processes():
    from flexmarl.sim.calibration.machine import measure_contention

    cfg = tiny_config()
    curve = measure_contention(cfg, 8, 16, max_procs=2, reps=1, seconds=0.05)
    assert len(curve) == 2 and curve[0] == 1.0
    assert 0.0 < curve[1] <= 1.0


def test_a_gpu_run_is_profiled_on_its_gpus(monkeypatch):
    """A run on CUDA is measured where it computes: the probes' workers get the pools' worker-0
    placements and the in-process trainers build on the training GPU (before, every profile
    measured the CPU, and predicted an H100 run at half its time); a CPU run keeps the default
    placement."""
    import torch

    from flexmarl.policy.device import computing_on, process_device
    from flexmarl.sim.calibration.profile import run_placements

    assert run_placements(tiny_config()) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    runtime = {"kind": "local", "rollout_workers": 1, "train_workers": 1, "torch_threads": 1,
               "devices": "cuda"}
    rollout, train = run_placements(tiny_config(runtime=runtime))
    assert (rollout.kind, rollout.visible, train.kind, train.visible) == ("cuda", (0,),
                                                                          "cuda", (1,))
    with computing_on("cuda:1"):
        assert process_device() == "cuda:1"
    assert process_device() == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_a_gpu_times_the_device_not_the_launches():
    """On a GPU the engine's fits are the device's time, read after it drained."""
    import torch

    from flexmarl.policy.model import build_model
    from flexmarl.sim.calibration import profile as prof

    model = build_model("a", tiny_config().agents["speaker"].model, 16, 64, 0, "cuda:0")
    prof._on_gpu[:] = [torch.device("cuda:0")]
    try:
        fits = prof.profile_engine(model, 8, 32, 16, reps=3)
    finally:
        prof._on_gpu.clear()
    assert fits["decode"](seqs=8, tokens=64) > 0 and fits["prefill"](seqs=8, tokens=64) > 0


def test_the_worker_scale_times_the_same_rows_in_this_process():
    """`_train_scale` scales a worker's CPU against the same micro-batches run here within the
    same seconds: one trainer per distinct agent config, its gradients dropped after."""
    from flexmarl.sim.calibration.profile import _accumulate_here, _samples, _side_trainers

    cfg = tiny_config()
    task = load_task(cfg.task.builder, cfg.task.options)
    trainable = list(cfg.agents)
    side = _side_trainers(cfg, task.vocab_size, task.max_seq_len, trainable)
    assert set(side) == set(trainable)
    assert len({id(t) for t in side.values()}) == 1  # the three agents share one config
    trainer = side["relay"]
    batch = _samples(4, 5, 2, task.vocab_size, 7, "x", None)  # another version: re-stamped
    assert _accumulate_here(trainer, batch) > 0
    assert _accumulate_here(trainer, batch) > 0  # the same ids again: the step was cleared
    assert all(p.grad is None for p in trainer.params)
