"""Captured interactions and /v1/feedback; a SIGKILL of the server under load loses no
acknowledged interaction and stores none twice."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

from flexmarl.serving.capture import Capture
from tests.serving.conftest import free_port, post, start, wait_for_serve


def test_capture_and_feedback(toy_run, tmp_path):
    db = tmp_path / "served.sqlite"
    running = start(toy_run, capture=Capture(db))
    try:
        client = running.client()
        chat = client.chat.completions.create(model="listener", max_tokens=5, seed=1,
                                              messages=[{"role": "user", "content": "Hi"}])
        ids = client.completions.create(model="speaker", prompt=[1, 3, 2, 8], max_tokens=1,
                                        seed=1, stream=True)
        streamed_id = [c.id for c in ids][0]
        rows = sqlite3.connect(db).execute(
            "SELECT id, agent, version, endpoint, response, text FROM interactions").fetchall()
        by_id = {r[0]: r for r in rows}
        assert set(by_id) == {chat.id, streamed_id}
        assert by_id[chat.id][1:4] == ("listener", 1, "chat.completions")
        assert by_id[chat.id][5] == chat.choices[0].message.content
        assert len(json.loads(by_id[streamed_id][4])) == 1
        status, body = post(f"{running.url}/feedback", {"id": chat.id, "reward": 1.0})
        assert status == 200 and body["reward"] == 1.0
        status, body = post(f"{running.url}/feedback", {"id": chat.id, "reward": 0.0})
        assert status == 409 and "already" in body["error"]["message"]
        status, body = post(f"{running.url}/feedback", {"id": "cmpl-nope", "reward": 1})
        assert status == 404
        status, body = post(f"{running.url}/feedback", {"id": chat.id, "reward": "good"})
        assert status == 400 and body["error"]["param"] == "reward"
    finally:
        running.close()


def test_feedback_without_capture_is_a_clear_400(server):
    status, body = post(f"{server.url}/feedback", {"id": "x", "reward": 1})
    assert status == 400 and "--capture" in body["error"]["message"]


def test_sigkill_under_load_loses_no_acknowledged_interaction(toy_run, tmp_path):
    db = tmp_path / "served.sqlite"
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl", "serve", str(toy_run), "--port",
                             str(port), "--device", "cpu", "--capture", str(db)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    acked: list[str] = []
    stop = threading.Event()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=30)
        wait_for_serve(client, proc)
        deadline = time.time() + 120

        def load(i: int) -> None:
            while not stop.is_set():
                try:
                    out = client.completions.create(model="listener", prompt="One two",
                                                    max_tokens=6, seed=i)
                    acked.append(out.id)
                except openai.APIError:
                    return  # the server is gone

        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        while len(acked) < 20 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert len(acked) >= 20
    stored = [r[0] for r in sqlite3.connect(db).execute("SELECT id FROM interactions")]
    assert len(stored) == len(set(stored))
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} acknowledged interactions lost"


def test_episode_nodes_are_captured_and_feedback_on_the_episode_rewards_each(toy_run,
                                                                              tmp_path):
    db = tmp_path / "served.sqlite"
    running = start(toy_run, capture=Capture(db))
    try:
        status, ep = post(f"{running.url}/episodes", {"seed": 5, "temperature": 1.0})
        assert status == 200, ep
        node_ids = {n["id"] for n in ep["nodes"].values()}
        assert node_ids == {f"{ep['id']}/speak", f"{ep['id']}/listen"}
        status, body = post(f"{running.url}/feedback", {"id": ep["id"], "reward": 0.5})
        assert status == 200
        status, body = post(f"{running.url}/feedback", {"id": ep["id"], "reward": 0.5})
        assert status == 409
    finally:
        running.close()
    con = sqlite3.connect(db)
    rows = con.execute("SELECT i.id, i.episode, i.temperature, i.allowed, f.reward FROM "
                       "interactions i JOIN feedback f ON f.response_id = i.id").fetchall()
    assert {r[0] for r in rows} == node_ids
    assert all(r[1] == ep["id"] and r[2] == 1.0 and r[4] == 0.5 for r in rows)
    listen = next(r for r in rows if r[0].endswith("/listen"))
    assert json.loads(listen[3]) == ep["input"]["candidates"]  # the node's token mask
