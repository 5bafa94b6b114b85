"""The `openai` backend against real HTTP servers on loopback: `flexmarl serve-model` serving a
tiny model, a port nobody listens on, a server that never answers, one that answers garbage."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from flexmarl.config.schema import BackendConfig, ModelConfig, config_from_dict
from flexmarl.orchestrator.run import prepare, train
from flexmarl.policy.model import build_model
from flexmarl.rollout.backends.openai import EndpointError, OpenAIBackend
from flexmarl.rollout.engine import generate
from flexmarl.types import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _game_config(**listener) -> dict:
    raw = yaml.safe_load((ROOT / "examples/referential_game.yaml").read_text())
    raw["train"].update(iterations=2, inputs_per_iteration=8, group_size=4, micro_batch_size=32)
    raw["agents"]["listener"].update(listener)
    return raw


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A listener-shaped tiny model saved to disk and served by `flexmarl serve-model`."""
    cfg = config_from_dict(_game_config())
    task = prepare(cfg)
    model = build_model("listener", cfg.agents["listener"].model, task.vocab_size,
                        task.max_seq_len, cfg.seed)
    folder = tmp_path_factory.mktemp("served") / "listener"
    model.save_pretrained(folder)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmarl", "serve-model", str(folder), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                assert json.loads(r.read())["status"] == "ok"
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                proc.kill()
                pytest.fail(f"serve-model did not come up: {out}")
            time.sleep(0.2)
    yield url, model
    proc.terminate()
    proc.wait(timeout=10)


def _request(i: int, **kw) -> GenerationRequest:
    base = dict(sample_id=f"0-{i}_0_0", agent="listener", version=0, prompt=[1, 6 + i, 2, 3],
                max_new_tokens=5, allowed_tokens=list(range(6, 14)), stop_tokens=[], seed=0)
    return GenerationRequest(**{**base, **kw})


def _backend(url: str, **kw) -> OpenAIBackend:
    return OpenAIBackend("listener", BackendConfig(kind="openai", url=url, **kw))


def test_endpoint_samples_what_a_local_replica_samples(served):
    url, model = served
    backend = _backend(url)
    reqs = [_request(i) for i in range(6)]

    async def go():
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    remote = asyncio.run(go())  # concurrent requests share the server's continuous batch
    for req, res in zip(reqs, remote, strict=True):
        local = generate(model, [req])[0]
        assert res.tokens == local.tokens
        assert max(abs(a - b) for a, b in zip(res.logprobs, local.logprobs, strict=True)) < 1e-5
        assert set(res.tokens) <= set(req.allowed_tokens)


def test_bad_request_is_refused_with_the_field(served):
    url, _ = served
    with pytest.raises(EndpointError, match=r"HTTP 400.*allowed_token_ids"):
        asyncio.run(_backend(url).generate(_request(0, allowed_tokens=[10_000])))


def test_endpoint_down_is_retried_then_a_clear_error():
    url = f"http://127.0.0.1:{_free_port()}"
    backend = _backend(url, max_retries=2, backoff_s=0.01)
    with pytest.raises(EndpointError, match=r"unavailable after 3 attempts: cannot connect"):
        asyncio.run(backend.generate(_request(0)))
    assert backend.attempts == 3


def test_timeout_is_a_clear_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel does), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        backend = _backend(url, timeout_s=0.3, max_retries=1, backoff_s=0.01)
        t0 = time.time()
        with pytest.raises(EndpointError, match="no answer within timeout_s=0.3"):
            asyncio.run(backend.generate(_request(0)))
        assert time.time() - t0 < 5
    finally:
        listener.close()


class _Garbage(BaseHTTPRequestHandler):
    body = b""

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


@pytest.mark.parametrize("body,field", [
    (b"<html>oops</html>", "body is not JSON"),
    (b'{"choices": []}', "choices is missing or empty"),
    (b'{"choices": [{"text": "hi"}]}', "choices\\[0\\].logprobs is missing"),
    (b'{"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]}',
     "tokens\\[0\\] is 'hi'"),
])
def test_malformed_response_names_the_field(body, field):
    handler = type("H", (_Garbage,), {"body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(EndpointError, match=field):
            asyncio.run(_backend(url, max_retries=0).generate(_request(0)))
    finally:
        server.shutdown()


def test_frozen_agent_served_over_http_in_a_run(served, tmp_path):
    url, _ = served
    cfg = config_from_dict(_game_config(trainable=False,
                                        backend={"kind": "openai", "url": url}))
    result = train(cfg, tmp_path / "run")
    assert len(result.records) == 2
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert result.records[-1]["agent/listener/tokens_generated"] == 8 * 4
    assert result.store_stats["listener"]["failed"] == 0
    assert set(result.checkpoints) == {"speaker"}


def test_endpoint_down_fails_rows_and_loses_none(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    raw = _game_config(trainable=False, backend={"kind": "openai", "url": url, "max_retries": 1,
                                                 "backoff_s": 0.01})
    raw.setdefault("train", {})["max_failed_fraction"] = 1.0  # the failure budget off
    cfg = config_from_dict(raw)
    result = train(cfg, tmp_path / "run")
    episodes = 2 * 8 * 4
    assert sum(r["episodes/failed"] for r in result.records) == episodes
    assert "unavailable after 2 attempts" in result.records[0]["errors"][0]
    # every row the episodes created is accounted for, as failed: none vanished
    assert result.store_stats["listener"]["failed"] == episodes
    assert result.store_stats["speaker"]["failed"] == episodes
    assert sum(result.store_stats["speaker"].values()) == episodes


def test_openai_backend_config_errors_name_the_agent():
    raw = _game_config(backend={"kind": "openai"})
    with pytest.raises(ValueError, match=r"agents.listener.backend.url: required"):
        config_from_dict(raw)
    raw = _game_config(backend={"kind": "openai", "url": "http://x"})
    with pytest.raises(ValueError, match=r"frozen agents only; set agents.listener.trainable"):
        config_from_dict(raw)
    assert ModelConfig()  # the default backend stays hf
