"""Snapshots at an fsspec URL and recovery: restore the snapshot's parameters, hand back every
row claimed after it (claimed mid-update, or trained into weights the crash lost), never one
it holds; `--update-every` / `--snapshot-every` durations."""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import yaml

from flexmarl.config.schema import ConfigError
from flexmarl.serving.agents import load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.cli import duration
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.service import Service
from flexmarl.serving.snapshots import SnapshotStore
from tests.serving.test_online import _rows


@pytest.mark.parametrize("url", ["memory://snapshots-test/a", "file://{tmp}/snaps",
                                 "{tmp}/plain"])
def test_snapshot_store_round_trip(url, tmp_path):
    store = SnapshotStore(url.format(tmp=tmp_path))
    assert store.read("listener") is None
    store.write("listener", {"w": np.arange(6.0).reshape(2, 3)}, {"steps": 3, "version": 7})
    path = store.write("listener", {"w": np.ones(2)}, {"steps": 5, "version": 9})
    arrays, meta = store.read("listener")
    assert meta["steps"] == 5 and meta["version"] == 9 and path.endswith("training-00000005.npz")
    assert np.array_equal(arrays["w"], np.ones(2))
    left = [str(p) for p in store.fs.glob(f"{store.root}/listener/training-*.npz")]
    assert len(left) == 1 and left[0].endswith("00000005.npz")  # the older one removed
    if "memory" not in url:
        assert Path(store.root, "listener", "training.json").is_file()


def test_a_snapshot_url_without_its_package_is_a_clear_error():
    with pytest.raises(ConfigError, match="--snapshot-url nope://x: Protocol not known"):
        SnapshotStore("nope://x")


def test_durations():
    assert duration("900") == 900.0 and duration("15m") == 900.0
    assert duration("90s") == 90.0 and duration("1.5h") == 5400.0 and duration("1d") == 86400.0
    for bad in ("15 minutes", "m", "", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


def _service(run_dir: Path, db: Path, url: str) -> Service:
    cfg = DeployConfig(learn=["listener"], batch=8, heldout=0, canary_every=10_000,
                       canary_min_feedback=10_000, snapshot_url=url, lr=0.01)
    return Service(load_run(run_dir, "cpu"), capture=Capture(db), deploy=cfg)


def _crash(service: Service) -> None:
    """Leave `service` as a SIGKILL would: no closing snapshot, the store's file closed."""
    for w in service.workers.values():
        w.stop()
    assert service.capture is not None
    service.capture.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-adapter"])
def test_recovery_restores_and_redelivers_exactly_the_lost_rows(toy_run, tmp_path, lora):
    """Through a `memory://` URL (an fsspec file system other than the local disk, built in),
    for a full-weight agent and for a LoRA agent learning its adapter online."""
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    if lora:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["agents"]["listener"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    db, url = tmp_path / "served.sqlite", f"memory://recovery-{tmp_path.name}"
    first = _service(run, db, url)
    assert first.deployment is not None and first.capture is not None
    dep = first.deployment.agents["listener"]
    ids = _rows(first.capture, dep.spec.model, 40, version=1)
    dep.tick()
    dep.tick()
    assert dep.learner is not None and dep.learner.steps == 2
    dep.snapshot_training()  # holds steps 1 and 2
    snap_arrays, snap_meta = SnapshotStore(url).read("listener")
    dep.tick()  # step 3: trained, then lost with the crash
    claimed = first.capture.claim("listener", 8, 4)  # step 4: claimed, the crash mid-update
    assert dep.learner.steps == 3 and len(claimed) == 8
    con = sqlite3.connect(db)
    step_of = dict(con.execute("SELECT response_id, step FROM consumed").fetchall())
    held = {i for i, s in step_of.items() if s <= 2}
    lost = {i for i, s in step_of.items() if s > 2}
    assert len(held) == 16 and len(lost) == 16
    _crash(first)

    second = _service(run, db, url)
    try:
        assert second.deployment is not None and second.capture is not None
        dep2 = second.deployment.agents["listener"]
        events = [json.loads(x) for x in (run / "serving" / "events.jsonl").read_text()
                  .splitlines()]
        resumed = [e for e in events if e["event"] == "training_resumed"][-1]
        assert resumed["steps"] == 2 and resumed["snapshot"] is True
        assert set(resumed["redelivered_ids"]) == lost and resumed["redelivered"] == 16
        assert resumed["restore_s"] >= 0 and resumed["redeliver_s"] >= 0
        arrays, meta = dep2.learner.state()
        assert meta["steps"] == 2 and meta["version"] == snap_meta["version"]
        for k, v in snap_arrays.items():
            if not k.startswith("rng."):
                assert np.array_equal(arrays[k], v), k
        assert {r[0] for r in con.execute("SELECT response_id FROM consumed")} == held
        for _ in range(3):  # 40 rows, 16 held: 24 left, 3 steps of 8
            dep2.tick()
        trained_again = {i for e in dep2.events.recent if e["event"] in ("train_step", "kl_stop")
                         for i in e["ids"]}
        assert lost <= trained_again and not trained_again & held
        assert {r[0] for r in con.execute("SELECT response_id FROM consumed")} == set(ids)
        assert (dep2.spec.adapter is not None) == lora
        if lora:  # only the adapter trained: the trainer's base is the served base
            trained = {k for k, v in dep2.learner.trainer.model.named_parameters()
                       if v.requires_grad}
            assert trained and all(".lora_" in k for k in trained)
    finally:
        second.close()
