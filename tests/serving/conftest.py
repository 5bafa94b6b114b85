"""A real `flexmarl serve` application on loopback (uvicorn in a thread), over the toy run:
a token-level speaker and a listener with a real byte-level BPE tokenizer and chat template."""

from __future__ import annotations

import socket
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_serve(client, proc, timeout: float = 120.0) -> None:
    """Block until the `flexmarl serve` subprocess `proc` answers `client`; fail the test with its
    output if it exits or does not come up within `timeout` seconds."""
    import openai

    deadline = time.time() + timeout
    while True:
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"flexmarl serve did not come up: {proc.stdout.read()}")
            time.sleep(0.3)


class Running:
    def __init__(self, service, app) -> None:
        import uvicorn

        self.service = service
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def client(self, **kw):
        from openai import OpenAI

        kw.setdefault("api_key", "unused")
        return OpenAI(base_url=self.url, max_retries=0, timeout=60, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.close()


def start(run_dir, watch_s: float | None = None, **service_kw) -> Running:
    from flexmarl.serving.agents import load_run
    from flexmarl.serving.app import create_app
    from flexmarl.serving.service import Service

    service = Service(load_run(run_dir, "cpu"), **service_kw)
    return Running(service, create_app(service, watch_s))


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    from flexmarl.serving.toy import make_toy_run

    return make_toy_run(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def server(toy_run):
    running = start(toy_run)
    yield running
    running.close()


def post(url: str, body=None, data: bytes | None = None, headers: dict | None = None,
         method: str = "POST") -> tuple[int, dict]:
    """(status, JSON body) of one plain HTTP request (urllib: no client library involved)."""
    import json
    import urllib.error
    import urllib.request

    payload = data if data is not None else (json.dumps(body).encode() if body is not None
                                             else None)
    req = urllib.request.Request(url, data=payload, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
