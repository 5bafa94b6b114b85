"""The online trainer outside the server: fed by the server's capture store, publishing a
canary over the admin API, following the server's verdict; and, as separate processes, a
SIGKILL of the trainer under load (the server keeps answering, nothing held is re-trained)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from flexmarl.serving.adapters import is_adapter_file
from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.trainer_process import OnlineTrainer, TrainerConfig
from tests.serving.conftest import free_port, post, start, wait_for_serve


def _traffic(url: str, n: int, base: int) -> None:
    for i in range(n):
        status, ep = post(f"{url}/episodes", {"seed": base + i, "temperature": 1.0})
        assert status == 200, ep
        post(f"{url}/feedback", {"id": ep["id"], "reward": float(ep["success"])})


@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-adapter"])
def test_trainer_publishes_a_canary_and_follows_the_verdict(toy_run, tmp_path, lora):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    if lora:  # a LoRA listener: the trainer publishes its adapter alone
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["agents"]["listener"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    db = tmp_path / "served.sqlite"
    running = start(run, capture=Capture(db),
                    deploy=DeployConfig(heldout=0, canary_min_feedback=10_000))
    try:
        _traffic(running.url, 24, 0)
        trainer = OnlineTrainer(run, db, "listener", running.url.removesuffix("/v1"),
                                TrainerConfig(batch=8, canary_every=2, lr=0.01, kl_max=100.0),
                                f"memory://trainer-{tmp_path.name}")
        assert trainer.step() and trainer.step()  # two updates, then the candidate
        assert trainer.pending is not None
        version = trainer.pending[0]
        _, dep = post(f"{running.url}/admin/deployment", method="GET")
        canary = dep["agents"]["listener"]["canary"]
        assert canary["version"] == version and "published" in canary["source"]
        published = Path(next(e["path"] for e in trainer.events.read()
                              if e["event"] == "published"))
        assert is_adapter_file(published) == lora
        status, body = post(f"{running.url}/admin/canary/decide", {"agent": "listener"})
        assert status == 200, body
        verdict = body["event"]["event"]
        trainer.step()
        followed = [e for e in trainer.events.read() if e["event"] == "followed"]
        assert followed and followed[-1]["version"] == version
        assert followed[-1]["verdict"] == verdict
        assert trainer.pending is None
        trained = [i for e in trainer.events.read() if e["event"] == "train_step"
                   for i in e["ids"]]
        assert len(trained) == 24 and len(set(trained)) == 24  # three updates of 8
        trainer.capture.close()
    finally:
        running.close()


@pytest.mark.slow
def test_sigkill_of_the_trainer_process_under_load(toy_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    db = tmp_path / "served.sqlite"
    root = Path(__file__).resolve().parents[2]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "flexmarl", "serve", str(run), "--port", str(port), "--device",
         "cpu", "--capture", str(db), "--deploy", "--heldout", "16", "--canary-min-feedback",
         "4", "--canary-share", "0.25"], cwd=root, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    events = run / "serving" / "trainer-listener.jsonl"
    stop = threading.Event()
    failures: list[str] = []

    def load(k: int) -> None:
        j = 0
        while not stop.is_set():
            status, ep = post(f"{url}/episodes", {"seed": k * 10**6 + j, "temperature": 1.0})
            j += 1
            if status != 200:
                failures.append(str(ep))
                continue
            post(f"{url}/feedback", {"id": ep["id"], "reward": float(ep["success"])})

    def trainer() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "flexmarl", "serve-learn", str(run), "--capture", str(db),
             "--agent", "listener", "--server", f"http://127.0.0.1:{port}", "--online-batch",
             "8", "--canary-every", "2", "--online-lr", "0.001", "--snapshot-every", "2s",
             "--threads", "1"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)

    def count(kind: str) -> int:
        if not events.is_file():
            return 0
        return sum(json.loads(x)["event"] == kind for x in events.read_text().splitlines())

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    procs = []
    try:
        wait_for_serve(openai.OpenAI(base_url=url, api_key="x", max_retries=0), server)
        for t in threads:
            t.start()
        for _life in range(2):
            procs.append(trainer())
            goal = count("train_step") + 4
            deadline = time.time() + 120
            while count("train_step") < goal and time.time() < deadline:
                assert procs[-1].poll() is None, procs[-1].stdout.read()
                time.sleep(0.2)
            assert count("train_step") >= goal
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(30)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for p in [*procs, server]:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    assert not failures, failures[:3]  # the server answered throughout
    lineage: list[tuple[int, str]] = []
    for e in map(json.loads, events.read_text().splitlines()):
        if e["event"] == "training_resumed":
            kept = [(s, i) for s, i in lineage if s <= e["steps"]]
            assert not {i for _, i in kept} & set(e["redelivered_ids"])
            lineage = kept
        elif e["event"] == "train_step":
            lineage += [(e["step"], i) for i in e["ids"]]
    ids = [i for _, i in lineage]
    assert len(ids) == len(set(ids)) and len(ids) >= 32
    assert count("training_resumed") >= 1 and count("published") >= 1
