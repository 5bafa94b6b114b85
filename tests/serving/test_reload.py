"""Hot reload under concurrent requests: no request fails, each is decoded wholly by one
version (its tokens are exactly what that version's model decodes alone with the same seed),
and the version is reported; plus the API key and the CLI."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from flexmarl.cli.main import main
from flexmarl.rollout.engine import generate
from flexmarl.serving.toy import save_llama, write_final
from flexmarl.types import GenerationRequest
from tests.serving.conftest import free_port, post, start

PROMPT = [5, 9, 40, 41, 42]


def _reference(model, seed: int, n: int) -> list[int]:
    (res,) = generate(model, [GenerationRequest("r", "listener", 0, PROMPT, n, noise_seed=seed)])
    return res.tokens


def test_hot_reload_under_concurrent_requests(toy_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    running = start(run)
    try:
        old_model = copy.deepcopy(running.service.run.agents["listener"].model)
        new_dir = tmp_path / "v2"
        new_dir.mkdir()
        vocab = running.service.run.agents["listener"].vocab
        save_llama(new_dir, vocab, seed=1234)  # clearly different weights, same shapes
        client = running.client()
        results, errors = [], []
        first_wave, reloaded = threading.Event(), threading.Event()

        def worker(i: int) -> None:
            # requests back to back, through the reload, until two more after it
            j, after = 0, 0
            while after < 2 and j < 200:
                seed = 1000 * i + j
                j += 1
                after += reloaded.is_set()
                try:
                    out = client.completions.create(
                        model="listener", prompt=PROMPT, max_tokens=8, seed=seed,
                        extra_body={"return_tokens_as_token_ids": True})
                    results.append((seed, out.choices[0].model_extra["token_ids"],
                                    out.model_extra["flexmarl"]["version"]))
                except Exception as exc:  # noqa: BLE001 - counted, and the test fails on it
                    errors.append(repr(exc))
                if j == 2:
                    first_wave.set()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        first_wave.wait(30)
        write_final(run, "listener", new_dir, policy_version=7)
        status, body = post(f"{running.url}/admin/reload", {})
        reloaded.set()
        assert status == 200, body
        assert body["agents"]["listener"]["reloaded"] is True
        assert body["agents"]["listener"]["version"] == 2
        assert body["agents"]["listener"]["policy_version"] == 7
        assert body["agents"]["speaker"]["reloaded"] is False  # nothing new for it
        for t in threads:
            t.join(120)
        assert errors == []
        assert len(results) >= 6 * 4
        versions = {v for _, _, v in results}
        assert versions == {1, 2}, versions
        new_model = running.service.run.agents["listener"].model
        for seed, tokens, version in results:
            model = old_model if version == 1 else new_model
            assert tokens == _reference(model, seed, 8), (seed, version)
        after = client.completions.create(model="listener", prompt=PROMPT, max_tokens=4, seed=1)
        assert after.system_fingerprint == "listener-v2"
        status, body = post(f"{running.url}/admin/reload", {})  # unchanged: no new version
        assert body["agents"]["listener"] == {**body["agents"]["listener"], "reloaded": False,
                                              "version": 2}
        _, versions_now = post(f"{running.url}/admin/versions", method="GET")
        assert versions_now["agents"]["listener"]["running"] == [2]
        status, body = post(f"{running.url}/admin/reload",
                            {"agent": "listener", "path": str(tmp_path / "missing")})
        assert status == 400 and "missing" in body["error"]["message"]
    finally:
        running.close()


def test_api_key_is_required_when_set(toy_run):
    running = start(toy_run, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").models.list()
        assert len(running.client(api_key="s3cret").models.list().data) == 2
        status, _ = post(running.url.replace("/v1", "/health"), method="GET")
        assert status == 200
    finally:
        running.close()


def test_cli_rejects_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["serve", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_cli_serves_a_run(toy_run):
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl", "serve", str(toy_run), "--port",
                             str(port), "--device", "cpu", "--max-tokens", "32"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=30)
        deadline = time.time() + 120
        while True:
            try:
                models = client.models.list().data
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"flexmarl serve did not come up: {proc.stdout.read()}")
                time.sleep(0.3)
        assert {m.id for m in models} == {"speaker", "listener"}
        with pytest.raises(openai.BadRequestError, match="--max-tokens"):
            client.completions.create(model="listener", prompt="hi", max_tokens=64)
        cfg = yaml.safe_load((toy_run / "config.yaml").read_text())
        assert set(cfg["agents"]) == {m.id for m in models}
    finally:
        proc.terminate()
        proc.wait(30)


def test_watch_reloads_new_weights_in_the_run_folder(toy_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    running = start(run, watch_s=0.1)
    try:
        new_dir = tmp_path / "v2"
        new_dir.mkdir()
        save_llama(new_dir, running.service.run.agents["listener"].vocab, seed=99)
        write_final(run, "listener", new_dir, policy_version=3)
        deadline = time.time() + 30
        while running.service.run.agents["listener"].version.number != 2:
            assert time.time() < deadline, "the watcher did not reload"
            time.sleep(0.05)
        out = running.client().completions.create(model="listener", prompt="Hi", max_tokens=2)
        assert out.model_extra["flexmarl"]["policy_version"] == 3
        assert out.model_extra["flexmarl"]["source"] == "final"
    finally:
        running.close()
