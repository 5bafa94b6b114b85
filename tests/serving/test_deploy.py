"""Triple-buffer deployment on a real server with the real `openai` client: the canary's
traffic share, promotion and rollback (feedback through /v1/feedback, held-out scores),
in-flight requests through a transition, the events log and the promoted snapshot; and a
SIGKILL of a learning server under load (slow)."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from flexmarl.cli.main import main
from flexmarl.config.schema import ConfigError
from flexmarl.serving.agents import load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.toy import save_llama
from tests.serving.conftest import free_port, post, start, wait_for_serve

PROMPT = [5, 9, 40, 41, 42]


@pytest.fixture
def run_copy(toy_run, tmp_path) -> Path:
    """A private copy of the toy run: deployments write RUN_DIR/serving/."""
    dest = tmp_path / "run"
    shutil.copytree(toy_run, dest)
    return dest


def _weights(tmp_path: Path, vocab: int, seed: int) -> Path:
    folder = tmp_path / f"w{seed}"
    folder.mkdir()
    save_llama(folder, vocab, seed=seed)
    return folder


def _version(out) -> int:
    return out.model_extra["flexmarl"]["version"]


def _ask(client, seed: int):
    return client.completions.create(model="listener", prompt=PROMPT, max_tokens=2, seed=seed,
                                     temperature=1.0)


def _versions(client, n: int) -> list[int]:
    """The versions that served `n` requests sent 8 at a time (the canary's count does not
    depend on the order of admission: after n admissions it has had floor(n * share))."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: _version(_ask(client, i)), range(n)))


def test_canary_gets_its_share_of_new_requests(run_copy, tmp_path):
    running = start(run_copy, capture=Capture(tmp_path / "c.sqlite"),
                    deploy=DeployConfig(heldout=0, canary_min_feedback=10_000))
    try:
        vocab = running.service.run.agents["listener"].vocab
        status, body = post(f"{running.url}/admin/canary",
                            {"agent": "listener", "path": str(_weights(tmp_path, vocab, 7))})
        assert status == 200, body
        assert body["event"]["version"] == 2 and body["event"]["share"] == 0.05  # default 5%
        client = running.client()
        versions = _versions(client, 60)
        assert versions.count(2) == 3 and versions.count(1) == 57
        # a new canary replaces the old one (which drains); its share is configurable
        status, body = post(f"{running.url}/admin/canary",
                            {"agent": "listener", "path": str(_weights(tmp_path, vocab, 8)),
                             "share": 0.25})
        assert body["event"]["version"] == 3
        versions = _versions(client, 20)
        assert versions.count(3) == 5 and versions.count(1) == 15
        # a stream is served wholly by one version, reported in every chunk
        seen = set()
        for i in range(8):
            chunks = list(client.completions.create(model="listener", prompt=PROMPT,
                                                    max_tokens=3, seed=i, stream=True))
            seen.add(frozenset(c.system_fingerprint for c in chunks))
        assert all(len(s) == 1 for s in seen) and len(seen) == 2
        status, body = post(f"{running.url}/admin/canary", {"agent": "nobody", "path": "x"})
        assert status == 404 and body["error"]["param"] == "agent"
        status, body = post(f"{running.url}/admin/canary", {"agent": "listener", "share": 2})
        assert status == 400 and body["error"]["param"] == "share"
        status, body = post(f"{running.url}/admin/canary", {"agent": "listener"})
        assert status == 400 and "--learn" in body["error"]["message"]
    finally:
        running.close()


def test_promotion_and_rollback_by_traffic_feedback(run_copy, tmp_path):
    cfg = DeployConfig(heldout=0, feedback_weight=1.0, canary_min_feedback=10_000,
                       canary_share=0.5)
    running = start(run_copy, capture=Capture(tmp_path / "c.sqlite"), deploy=cfg)
    try:
        vocab = running.service.run.agents["listener"].vocab
        client = running.client()
        good = _weights(tmp_path, vocab, 11)
        post(f"{running.url}/admin/canary", {"agent": "listener", "path": str(good)})

        def traffic(canary_reward: float, shadow_reward: float, n: int) -> list[int]:
            canary = running.service.workers["listener"].canary_version.number

            def one(i: int) -> int:
                resp = _ask(client, 1000 + i)
                v = _version(resp)
                status, _ = post(f"{running.url}/feedback", {
                    "id": resp.id, "reward": canary_reward if v == canary else shadow_reward})
                assert status == 200
                return v

            with ThreadPoolExecutor(6) as pool:
                return list(pool.map(one, range(n)))

        assert set(traffic(1.0, 0.0, 12)) == {1, 2}
        # requests in flight while the decision happens: none fails, each names its version
        errors, during = [], []
        stop = threading.Event()

        def load(k: int) -> None:
            j = 0
            while not stop.is_set():
                try:
                    during.append(_version(_ask(client, 10_000 * k + j)))
                except Exception as exc:  # noqa: BLE001 - counted; the test fails on it
                    errors.append(repr(exc))
                j += 1

        threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        status, body = post(f"{running.url}/admin/canary/decide", {"agent": "listener"})
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(60)
        assert status == 200, body
        event = body["event"]
        assert event["event"] == "promote" and event["version"] == 2
        assert event["canary_score"] == 1.0 and event["shadow_score"] == 0.0
        assert errors == [] and set(during) <= {1, 2}
        assert set(_versions(client, 10)) == {2}
        assert (run_copy / "serving" / "listener" / "SHADOW").read_text() == "v2"
        # a canary that scores worse is rolled back; the shadow keeps serving
        post(f"{running.url}/admin/canary",
             {"agent": "listener", "path": str(_weights(tmp_path, vocab, 12))})
        assert set(traffic(0.0, 1.0, 12)) == {2, 3}
        status, body = post(f"{running.url}/admin/canary/decide", {"agent": "listener"})
        assert body["event"]["event"] == "rollback" and body["event"]["version"] == 3
        assert body["event"]["canary_score"] < body["event"]["shadow_score"]
        assert set(_versions(client, 10)) == {2}
        status, body = post(f"{running.url}/admin/canary/decide", {"agent": "listener"})
        assert status == 409
        _, state = post(f"{running.url}/admin/deployment", method="GET")
        assert state["agents"]["listener"]["shadow"]["version"] == 2
        assert state["agents"]["listener"]["canary"] is None
        _, health = post(running.url.replace("/v1", "/health"), method="GET")
        assert health["status"] == "ok" and health["heartbeats"]["listener.engine"]["ok"]
    finally:
        running.close()
    kinds = [e["event"] for e in map(json.loads, (run_copy / "serving" / "events.jsonl")
                                     .read_text().splitlines())]
    assert kinds == ["deployment_start", "canary_start", "promote", "canary_start", "rollback"]
    # a restarted server serves the promoted shadow, from its snapshot
    again = load_run(run_copy, "cpu").agents["listener"]
    assert again.version.source == "promoted-v2" and again.version.number == 2
    ref = load_run(run_copy, "cpu", ["listener"])  # same weights as the canary's file
    from safetensors.torch import load_file

    good_w = load_file(str(good / "model.safetensors"))
    got = ref.agents["listener"].model.state_dict()
    assert all(torch.equal(got[k], good_w[k].to(got[k].dtype)) for k in good_w if k in got)


def test_heldout_score_decides_with_the_margin(run_copy, tmp_path):
    # the shadow's own weights (the toy listener's model folder)
    same = Path(load_run(run_copy, "cpu").cfg.agents["listener"].model.path)
    for margin, expected in ((0.0, "promote"), (0.5, "rollback")):
        cfg = DeployConfig(heldout=48, feedback_weight=0.0, margin=margin, tick_s=0.05)
        running = start(run_copy, deploy=cfg)
        try:
            status, body = post(f"{running.url}/admin/canary",
                                {"agent": "listener", "path": str(same)})
            assert status == 200, body
            deadline = time.time() + 60
            dep = running.service.deployment.agents["listener"]
            while dep.canary is not None:  # decided by the deployment loop on its own
                assert time.time() < deadline
                time.sleep(0.05)
        finally:
            running.close()
        event = [json.loads(x) for x in (run_copy / "serving" / "events.jsonl").read_text()
                 .splitlines()][-1]
        assert event["event"] == expected
        # the same weights on the same held-out inputs and noise: the same score
        assert event["canary_heldout"] == event["shadow_heldout"]
        assert 0.0 <= event["shadow_heldout"] <= 1.0


def test_bad_deployment_settings_name_the_flag(toy_run, tmp_path, capsys):
    with pytest.raises(ConfigError, match="--canary-share"):
        DeployConfig(canary_share=0).validate()
    with pytest.raises(ConfigError, match="--kl-max"):
        DeployConfig(kl_max=-1).validate()
    with pytest.raises(ConfigError, match="--heldout 0 with --feedback-weight 0"):
        DeployConfig(heldout=0, feedback_weight=0).validate()
    assert main(["serve", str(toy_run), "--learn", "listener"]) == 2
    assert "--capture" in capsys.readouterr().err
    assert main(["serve", str(toy_run), "--device", "cpu", "--capture",
                 str(tmp_path / "c.sqlite"), "--learn", "nobody"]) == 2
    err = capsys.readouterr().err
    assert "--learn nobody" in err and "speaker, listener" in err
    assert main(["serve", str(toy_run), "--deploy", "--canary-share", "1.5"]) == 2
    assert "--canary-share" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_of_a_learning_server_under_load(run_copy, tmp_path):
    """Two server lives, each SIGKILLed under load while it trains online: every acknowledged
    episode and feedback is in the store, and no captured row was trained on twice."""
    db = tmp_path / "served.sqlite"
    root = Path(__file__).resolve().parents[2]
    events = run_copy / "serving" / "events.jsonl"
    acked_eps: list[str] = []
    acked_fb: list[str] = []

    def steps() -> list[dict]:
        if not events.is_file():
            return []
        return [e for e in map(json.loads, events.read_text().splitlines())
                if e["event"] in ("train_step", "kl_stop")]

    for life in range(2):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "flexmarl", "serve", str(run_copy), "--port", str(port),
             "--device", "cpu", "--capture", str(db), "--learn", "listener", "--online-batch",
             "8", "--canary-every", "2", "--heldout", "32", "--canary-share", "0.25",
             "--canary-min-feedback", "4", "--online-lr", "0.001"], cwd=root,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}/v1"
        stop = threading.Event()
        try:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30)
            wait_for_serve(client, proc)
            deadline = time.time() + 120

            def load(k: int, url: str, base: int, stop: threading.Event) -> None:
                j = 0
                while not stop.is_set():
                    try:
                        status, ep = post(f"{url}/episodes", {"seed": base + k * 10**4 + j,
                                                              "temperature": 1.0})
                        j += 1
                        if status != 200:
                            return
                        acked_eps.append(ep["id"])
                        status, _ = post(f"{url}/feedback", {"id": ep["id"],
                                                             "reward": float(ep["success"])})
                        if status == 200:
                            acked_fb.append(ep["id"])
                    except (OSError, http.client.HTTPException, ValueError):
                        return  # the server is gone

            before = len(steps())
            threads = [threading.Thread(target=load, args=(k, url, life * 10**6, stop))
                       for k in range(6)]
            for t in threads:
                t.start()
            while len(steps()) < before + 3 and time.time() < deadline + 120:
                time.sleep(0.1)
            assert len(steps()) >= before + 3, proc.stdout.read() if proc.poll() else ""
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for t in threads:
            t.join(30)
    con = sqlite3.connect(db)
    stored_eps = {r[0] for r in con.execute("SELECT DISTINCT episode FROM interactions")}
    fed = {r[0] for r in con.execute(
        "SELECT DISTINCT i.episode FROM feedback f JOIN interactions i ON i.id = f.response_id")}
    consumed = [r[0] for r in con.execute("SELECT response_id FROM consumed")]
    assert len(acked_eps) >= 20
    assert not set(acked_eps) - stored_eps, "acknowledged episodes lost"
    assert not set(acked_fb) - fed, "acknowledged feedback lost"
    # the lineage of the training weights: a restart restores the last snapshot (its steps)
    # and hands back the rows of later steps, whose training the crash lost
    lineage: list[tuple[int, str]] = []
    for e in map(json.loads, events.read_text().splitlines()):
        if e["event"] == "training_resumed":
            kept = [(step, i) for step, i in lineage if step <= e["steps"]]
            assert not {i for _, i in kept} & set(e["redelivered_ids"]), "a held row handed back"
            lineage = kept
        elif e["event"] == "train_step":
            lineage += [(e["step"], i) for i in e["ids"]]
    trained = [i for _, i in lineage]
    assert len(trained) >= 24 and len(trained) == len(set(trained)), "a row trained twice"
    assert set(trained) <= set(consumed)
    kinds = [json.loads(x)["event"] for x in events.read_text().splitlines()]
    assert kinds.count("deployment_start") == 2


def test_a_dead_engine_thread_is_replaced_and_its_requests_answered(run_copy, tmp_path):
    from flexmarl.serving.worker import Job, ServeRequest

    running = start(run_copy, deploy=DeployConfig(heldout=0, canary_min_feedback=10_000))
    try:
        vocab = running.service.run.agents["listener"].vocab
        post(f"{running.url}/admin/canary", {"agent": "listener", "share": 0.5,
                                             "path": str(_weights(tmp_path, vocab, 21))})
        old = running.service.workers["listener"]
        got: list[tuple] = []
        # a request the engine cannot size (no prompt) kills the engine thread: a real fault
        old.submit(Job(ServeRequest("poison", "listener", 0, None, 4), got.append))
        deadline = time.time() + 30
        while old.alive:
            assert time.time() < deadline
            time.sleep(0.02)
        assert got and got[0][0] == "error" and "lost" in got[0][1]
        assert old.pending == 0
        versions = _versions(running.client(), 8)  # served by the replacement, canary kept
        assert set(versions) == {1, 2}
        new = running.service.workers["listener"]
        assert new is not old and new.alive
        _, health = post(running.url.replace("/v1", "/health"), method="GET")
        assert health["heartbeats"]["listener.engine"]["ok"]
    finally:
        running.close()
    events = [json.loads(x) for x in (run_copy / "serving" / "events.jsonl").read_text()
              .splitlines()]
    assert [e["event"] for e in events].count("failover") == 1
