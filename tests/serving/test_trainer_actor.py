"""The online trainer as a Ray actor on a real local Ray cluster: fed by the server's capture
store, it trains in its own worker process and publishes a canary to the server; killed with
its actor, the next actor restores its snapshot and re-delivers what was claimed after it (no
row trained twice into one lineage)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.trainer_process import TrainerConfig
from tests.serving.conftest import post, start

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")])))  # the actor imports this tree
    temp = tempfile.mkdtemp(prefix="fmsr-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # ~20 s, most of it starting Ray
def test_online_trainer_as_a_ray_actor_publishes_and_recovers(toy_run, tmp_path, local_ray):
    from flexmarl.serving.trainer_actor import start_trainer_actor

    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    db = tmp_path / "served.sqlite"
    running = start(run, capture=Capture(db),
                    deploy=DeployConfig(heldout=0, canary_min_feedback=10_000))
    try:
        for i in range(32):
            status, ep = post(f"{running.url}/episodes", {"seed": i, "temperature": 1.0})
            assert status == 200, ep
            post(f"{running.url}/feedback", {"id": ep["id"], "reward": float(ep["success"])})
        cfg = TrainerConfig(batch=8, canary_every=2, lr=0.01, kl_max=100.0,
                            snapshot_every_s=1e9)
        server = running.url.removesuffix("/v1")
        snaps = str(tmp_path / "snapshots")
        actor = start_trainer_actor(run, db, "listener", server, cfg, snaps, threads=1)
        out = ray.get(actor.run.remote(max_applied=2, timeout_s=120), timeout=180)
        assert out["pid"] != os.getpid() and out["applied"] == 2  # its own worker process
        _, dep = post(f"{running.url}/admin/deployment", method="GET")
        canary = dep["agents"]["listener"]["canary"]
        assert canary["version"] == out["pending"] and "published" in canary["source"]
        # train on, with no snapshot after step 2; killed once both updates are done
        actor.run.remote()
        deadline = time.time() + 120
        while ray.get(actor.status.remote())["steps"] < 4:
            assert time.time() < deadline
            time.sleep(0.1)
        ray.kill(actor)  # the actor's process dies: steps 3 and 4 are lost, their rows back
        again = start_trainer_actor(run, db, "listener", server, cfg, snaps, threads=1)
        out2 = ray.get(again.run.remote(max_applied=4, timeout_s=120), timeout=180)
        assert out2["pid"] != out["pid"] and out2["applied"] == 4
        ray.kill(again)
    finally:
        running.close()
    events = [json.loads(x) for x in (run / "serving" / "trainer-listener.jsonl")
              .read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "training_resumed"]
    assert resumed and resumed[-1]["steps"] == 2 and resumed[-1]["redelivered"] == 16
    lineage: list[tuple[int, str]] = []
    for e in events:
        if e["event"] == "training_resumed":
            kept = [(s, i) for s, i in lineage if s <= e["steps"]]
            assert not {i for _, i in kept} & set(e["redelivered_ids"])
            lineage = kept
        elif e["event"] == "train_step":
            lineage += [(e["step"], i) for i in e["ids"]]
    ids = [i for _, i in lineage]
    assert len(ids) == len(set(ids)) == 32


def test_serve_learn_ray_names_an_address_nobody_listens_on(toy_run, tmp_path, capsys):
    from flexmarl.cli.main import main

    db = tmp_path / "c.sqlite"
    Capture(db).close()
    code = main(["serve-learn", str(toy_run), "--capture", str(db), "--agent", "listener",
                 "--server", "http://127.0.0.1:9", "--ray", "127.0.0.1:9"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: serve-learn: --ray 127.0.0.1:9: no Ray head")
    assert "\n" not in err
