"""Checkpoint generations on a real disk: atomic publication, pruning, corrupt and truncated
files refused, a failing save (ENOSPC) keeps the previous generation; trainer state round trip
and NaN/inf steps skipped (real tiny models, no worker processes)."""

import errno
import json
import math

import numpy as np
import pytest
import torch

from flexmarl.config.schema import AgentConfig
from flexmarl.orchestrator import checkpoint as ck
from flexmarl.orchestrator.checkpoint import CheckpointError, CheckpointManager
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Sample, decode_array, encode_array

VOCAB, SEQ = 30, 16


def _trainer(agent="a"):
    return AgentTrainer(agent, AgentConfig(), VOCAB, SEQ, run_seed=0)


def _samples(n=4, version=0, advantage=1.0, prefix="0"):
    rng = np.random.default_rng(0)
    return [Sample(sample_id=f"{prefix}-{i}_0_0", prompt=[1, 2, 3],
                   response=[int(rng.integers(4, VOCAB))],
                   old_logprobs=[-1.0], advantage=advantage * (-1) ** i, allowed=None,
                   temperature=1.0, policy_version=version) for i in range(n)]


def _save(manager, completed, trainer, rows=None):
    arrays, meta = trainer.get_state()
    position = {"completed": completed, "records": [], "agents": ["a"]}
    return manager.save(completed, position, {"a": (arrays, meta)}, rows or [])


def test_trainer_state_round_trip_continues_bit_for_bit():
    a, b = _trainer(), _trainer()
    a.accumulate(_samples())
    a.step()
    b.set_state(*a.get_state())  # b: a fresh process restored from a's state
    for t in (a, b):
        t.accumulate(_samples(version=1, prefix="1"))
        t.step()
    wa, wb = a.weights(), b.weights()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) == 0.0
    assert a.version == b.version == 2


def test_generations_published_atomically_and_pruned(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", keep=2)
    trainer = _trainer()
    rows = [{"sample_id": "3-0_0_1", "status": "ready", "arrays": {
        "logprobs": encode_array(np.arange(3, dtype=np.float32))}}]
    for completed in (1, 2, 3):
        _save(manager, completed, trainer, rows)
    assert [p.name for p in manager.generations()] == ["gen-000002", "gen-000003"]
    assert (tmp_path / "ck" / "LATEST").read_text().strip() == "gen-000003"
    loaded = manager.load()
    assert loaded.completed == 3 and loaded.rows[0]["sample_id"] == "3-0_0_1"
    assert decode_array(loaded.rows[0]["arrays"]["logprobs"]).tolist() == [0.0, 1.0, 2.0]
    arrays, meta = loaded.trainer_states["a"]
    fresh = _trainer()
    fresh.set_state(arrays, meta)
    w0, w1 = trainer.weights(), fresh.weights()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the weights folder is a transformers model folder
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(loaded.path / "agents" / "a"))
    assert model.config.vocab_size == VOCAB


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_or_truncated_snapshot_is_refused_naming_the_file(tmp_path, damage):
    manager = CheckpointManager(tmp_path / "ck")
    _save(manager, 1, _trainer(), [{"sample_id": "1-0_0_0", "status": "pending", "arrays": {}}])
    store = tmp_path / "ck" / "gen-000001" / "store.msgpack"
    data = bytearray(store.read_bytes())
    if damage == "truncate":
        store.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        store.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="store.msgpack: truncated or corrupt") as info:
        manager.load()
    assert str(store) in str(info.value)


def test_full_disk_during_save_keeps_previous_generation(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "ck")
    trainer = _trainer()
    _save(manager, 1, trainer)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck" / "gen-000001").rglob("*")
              if p.is_file()}
    real = ck._write_bytes

    def full_disk(path, data):  # the disk fills up while the snapshot is written
        if path.name == "store.msgpack":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ck, "_write_bytes", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        _save(manager, 2, trainer)
    assert "gen-000001 is intact" in str(info.value)
    assert (tmp_path / "ck" / "LATEST").read_text().strip() == "gen-000001"
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    assert not (tmp_path / "ck" / "gen-000002").exists()
    after = {p.name: p.read_bytes() for p in (tmp_path / "ck" / "gen-000001").rglob("*")
             if p.is_file()}
    assert after == before
    assert manager.load().completed == 1


def test_missing_pointer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoints found"):
        ck.find_checkpoints(tmp_path)


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_nan_or_inf_step_is_skipped_with_a_reason(poison):
    trainer = _trainer()
    before = {k: v.clone() for k, v in trainer.weights().items()}
    bad = _samples(advantage=math.nan if poison == "loss" else 1.0)
    if poison == "grad":  # a finite loss whose gradient overflows
        trainer.accumulate(bad)
        next(iter(trainer.params)).grad.fill_(math.inf)
    else:
        trainer.accumulate(bad)
    metrics = trainer.step()
    assert metrics["skipped"] == 1.0
    reason = "non-finite loss" if poison == "loss" else "non-finite gradient"
    assert reason in metrics["skip_reason"]
    after = trainer.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.version == 1
    # the next step is a normal one
    trainer.accumulate(_samples(version=1, prefix="1"))
    assert "skip_reason" not in trainer.step()
    json.dumps(metrics)  # the reason travels into metrics.jsonl


def test_cli_refuses_a_corrupt_snapshot_naming_the_file(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    _save(manager, 1, _trainer(), [{"sample_id": "1-0_0_0", "status": "pending", "arrays": {}}])
    store = tmp_path / "run" / "checkpoints" / "gen-000001" / "store.msgpack"
    store.write_bytes(store.read_bytes()[:-3])
    proc = subprocess.run(
        [sys.executable, "-m", "flexmarl", "train",
         str(root / "examples" / "referential_game.yaml"),
         "--resume", str(tmp_path / "run")], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{store}: truncated or corrupt" in proc.stderr
