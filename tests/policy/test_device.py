"""Placement and precision: pools own disjoint GPUs, each worker sees only its own, dtypes
resolve per device. Device lists are given as counts here (no GPU needed); a spawned worker
process shows the visibility it really gets."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from pydantic import ValidationError

from flexmarl.config.schema import ModelConfig, RuntimeConfig
from flexmarl.policy.device import (
    CPU_MAX_BATCH_TOKENS,
    Placement,
    PlacementError,
    compute_dtype,
    kv_bytes_per_token,
    kv_token_budget,
    mps_active,
    plan_placements,
    pool_devices,
    resolve_kind,
    worker_placements,
)
from flexmarl.policy.model import build_model


def test_kind_follows_the_machine():
    assert resolve_kind("auto", gpu_count=0) == "cpu"
    assert resolve_kind("auto", gpu_count=2) == "cuda"
    assert resolve_kind("cpu", gpu_count=8) == "cpu"
    with pytest.raises(PlacementError, match="runtime.devices is 'cuda'"):
        resolve_kind("cuda", gpu_count=0)


def test_default_split_rollout_first_and_a_single_gpu_is_shared():
    assert pool_devices(None, None, 1) == ([0], [0])
    assert pool_devices(None, None, 4) == ([0, 1], [2, 3])
    assert pool_devices(None, None, 3) == ([0, 1], [2])


def test_counts_and_lists():
    assert pool_devices(3, None, 8) == ([0, 1, 2], [3, 4, 5, 6, 7])
    assert pool_devices(2, 2, 8) == ([0, 1], [2, 3])
    assert pool_devices([4, 5], [0], 8) == ([4, 5], [0])
    assert pool_devices(None, [6, 7], 8) == ([0, 1, 2, 3, 4, 5], [6, 7])


def test_bad_device_lists_name_the_field():
    with pytest.raises(PlacementError, match=r"runtime.train_devices: device\(s\) \[9\]"):
        pool_devices([0], [9], 4)
    with pytest.raises(PlacementError, match="runtime.rollout_devices: 5 device"):
        pool_devices(5, None, 4)
    with pytest.raises(PlacementError, match="share device"):
        pool_devices([0, 1], [1, 2], 4)
    assert pool_devices([0, 1], [1, 2], 4, share=True) == ([0, 1], [1, 2])
    with pytest.raises(PlacementError, match="takes every GPU"):
        pool_devices([0, 1], None, 2)


def test_config_refuses_overlap_and_gpus_on_cpu():
    with pytest.raises(ValidationError, match="share device"):
        RuntimeConfig(rollout_devices=[0, 1], train_devices=[1])
    RuntimeConfig(rollout_devices=[0, 1], train_devices=[1], share_devices=True)
    with pytest.raises(ValidationError, match="runtime.devices is 'cpu'"):
        RuntimeConfig(devices="cpu", train_devices=2)
    with pytest.raises(ValidationError, match="lists an index twice"):
        RuntimeConfig(rollout_devices=[0, 0])
    with pytest.raises(ValidationError, match="must be > 0"):
        RuntimeConfig(rollout_devices=0)


def test_workers_spread_over_their_pool_one_device_each():
    at = worker_placements("cuda", [2, 3], 3)
    assert [p.visible for p in at] == [(2,), (3,), (2,)]
    assert at[0].env() == {"CUDA_VISIBLE_DEVICES": "2"}
    assert at[0].device == "cuda:0"  # its only visible device renumbers to 0
    assert Placement("cpu").env() == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU worker sees no GPU


def test_plan_keeps_the_pools_apart():
    cfg = RuntimeConfig(rollout_workers=3, train_workers=2, rollout_devices=2, train_devices=2)
    rollout, train = plan_placements(cfg, 3, 2, gpu_count=4)
    r = {d for p in rollout for d in p.visible}
    t = {d for p in train for d in p.visible}
    assert r == {0, 1} and t == {2, 3} and not r & t
    cpu_r, cpu_t = plan_placements(RuntimeConfig(), 2, 1, gpu_count=0)
    assert {p.kind for p in cpu_r + cpu_t} == {"cpu"}


def _report(placement, conn):  # runs in a spawned worker, as the runtime's workers do
    from flexmarl.policy.device import process_device
    from flexmarl.runtime.local.workers import WorkerSpec, _setup_torch

    spec = WorkerSpec({}, 16, 16, [], 1, False, placement=placement)
    _setup_torch(spec)
    import os

    conn.send((os.environ.get("CUDA_VISIBLE_DEVICES"), process_device()))


@pytest.mark.parametrize("placement,expected", [
    (Placement("cuda", (3,)), ("3", "cuda:0")),
    (Placement("cpu"), ("", "cpu")),
])
def test_a_worker_process_sees_only_its_devices(placement, expected):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report, args=(placement, child))
    proc.start()
    assert parent.poll(300), "the spawned worker did not report (import under load?)"
    assert parent.recv() == expected
    proc.join(30)


def test_dtypes():
    assert compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    assert compute_dtype("float16", "cpu") == torch.float16


def test_kv_budget_from_the_model_shape():
    model = build_model("a", ModelConfig(hidden_size=64, num_heads=4, num_layers=3), 32, 64, 0)
    # keys and values, 3 layers, 4 heads of 16, 4 bytes
    assert kv_bytes_per_token(model.config, torch.float32) == 2 * 3 * 4 * 16 * 4
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 2 * 3 * 4 * 16 * 2
    assert kv_token_budget(None, model, 0.5) == CPU_MAX_BATCH_TOKENS  # CPU: not memory-bound
    assert kv_token_budget(1234, model, 0.5) == 1234


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_budget_on_a_gpu_follows_free_memory():
    model = build_model("a", ModelConfig(), 32, 64, 0, "cuda", torch.bfloat16)
    free, _ = torch.cuda.mem_get_info()
    budget = kv_token_budget(None, model, 0.5)
    assert abs(budget - free * 0.5 // kv_bytes_per_token(model.config, torch.bfloat16)) < 2048


def test_mps_is_seen_by_its_control_pipe(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_active()
    (tmp_path / "control").touch()
    assert mps_active()


def _niceness(placement, conn) -> None:
    import os

    from flexmarl.runtime.local.workers import WorkerSpec, _setup_torch

    _setup_torch(WorkerSpec({}, 16, 16, [], 1, False, placement=placement))
    conn.send(os.nice(0))


def test_a_rollout_worker_runs_at_its_niceness():
    import os

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_niceness, args=(Placement("cpu", nice=5), child))
    proc.start()
    assert parent.poll(300), "the spawned worker did not report (import under load?)"
    assert parent.recv() == min(19, os.nice(0) + 5)
    proc.join(30)


@pytest.mark.parametrize("sets,cores,expected", [
    ([], 2, 10),  # async, 3 threads (driver, replica, slot) on 2 cores: the slot first
    ([], 4, 0),  # a core each: nothing to order
    (["pipeline.mode=sync"], 2, 0),  # the pools take turns
    (["pipeline.mode=one_step_off"], 2, 10),
    (["runtime.rollout_nice=3"], 64, 3),  # given: as given
    (["runtime.rollout_nice=0"], 2, 0),
    (["runtime.torch_threads=2"], 4, 10),  # 6 threads on 4 cores
])
def test_rollout_niceness_resolves_from_the_run(monkeypatch, sets, cores, expected):
    import os
    from pathlib import Path

    from flexmarl.config.schema import load_config
    from flexmarl.policy.device import rollout_nice

    examples = Path(__file__).resolve().parents[2] / "examples"
    cfg = load_config(examples / "relay_chain.yaml", overrides=sets)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert rollout_nice(cfg, "cpu", 1, 1) == expected  # driver, one replica, one slot
    assert rollout_nice(cfg, "cuda", 1, 1) == (3 if "runtime.rollout_nice=3" in sets else 0)
    with pytest.raises(ValidationError, match="rollout_nice"):
        RuntimeConfig(rollout_nice=20)
