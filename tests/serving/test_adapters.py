"""LoRA agents served unmerged (base + adapters through the engine's stacked adapters), learning
online with only the adapter published, and per-tenant adapters: each training tenant learns
its own, served to it alone, never trained by another tenant's traffic. Real servers on
loopback, real peft adapters on the toy run's listener."""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel

from flexmarl.policy.adapters import adapter_tensors
from flexmarl.rollout.engine import generate
from flexmarl.serving.adapters import is_adapter_file, read_adapter_file, view
from flexmarl.serving.agents import explicit_source, load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.compress import pack
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.tenants import load_tenants
from flexmarl.types import GenerationRequest
from tests.serving.conftest import post, start

PROMPT = [5, 9, 40, 41, 42]


@pytest.fixture
def lora_run(toy_run, tmp_path) -> Path:
    """The toy run with a LoRA listener (r 4 on q_proj and v_proj)."""
    dest = tmp_path / "run"
    shutil.copytree(toy_run, dest)
    cfg = yaml.safe_load((dest / "config.yaml").read_text())
    cfg["agents"]["listener"]["lora"] = {"r": 4, "alpha": 8.0,
                                         "target_modules": ["q_proj", "v_proj"]}
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _ask(url: str, seed: int, key: str | None = None) -> dict:
    status, body = post(f"{url}/completions", {"model": "listener", "prompt": PROMPT,
                                               "max_tokens": 2, "seed": seed,
                                               "temperature": 1.0, "logprobs": 1},
                        headers=_auth(key) if key else None)
    assert status == 200, body
    return body


def _reward(url: str, rid: str, reward: float, key: str | None = None) -> None:
    status, body = post(f"{url}/feedback", {"id": rid, "reward": reward},
                        headers=_auth(key) if key else None)
    assert status == 200, body


def _expected(model, seed: int) -> list[float]:
    """Log-probs of the served request `seed` decoded by `model` (plain peft forward)."""
    req = GenerationRequest("x", "listener", 0, list(PROMPT), 2, None, [],
                            temperature=1.0, noise_seed=seed)
    with torch.no_grad():
        return generate(model, [req])[0].logprobs


def _served(body: dict) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "serving" / "events.jsonl").read_text()
            .splitlines()]


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_lora_agent_is_served_unmerged_with_a_shared_base(lora_run):
    run = load_run(lora_run, "cpu")
    spec = run.agents["listener"]
    assert isinstance(spec.model, PeftModel) and spec.adapter == "agent_listener"
    assert run.agents["speaker"].adapter is None  # plain weights stay plain
    # a new version copies the adapter only: every base tensor is the served one
    nxt = spec.next_model(explicit_source(_adapter_file(lora_run, spec)))
    base = dict(spec.model.named_parameters())
    for name, p in nxt.named_parameters():
        shared = p.data_ptr() == base[name].data_ptr()
        assert shared != (".lora_" in name), name
    with pytest.raises(Exception, match="not an adapter"):
        spec.next_model(explicit_source(_full_file(lora_run, spec)))


def _adapter_file(root: Path, spec) -> Path:
    path = root / "adapter.fmw"
    path.write_bytes(pack({k: v + 0.01 for k, v in adapter_tensors(spec.model,
                                                                   spec.adapter).items()}))
    return path


def _full_file(root: Path, spec) -> Path:
    path = root / "full.fmw"
    path.write_bytes(pack(spec.model.get_base_model().state_dict()))
    return path


def test_online_adapter_learning_publishes_the_adapter_alone(lora_run, tmp_path):
    cfg = DeployConfig(learn=["listener"], batch=8, heldout=8, margin=-100.0, kl_max=100.0,
                       lr=0.05, canary_every=10_000, canary_min_feedback=10_000, tick_s=0.05)
    running = start(lora_run, capture=Capture(tmp_path / "c.sqlite"), deploy=cfg)
    url = running.url
    try:
        dep = running.service.deployment.agents["listener"]
        before = adapter_tensors(dep.spec.model, "agent_listener")
        for i in range(8):  # one batch: one update, then the learner waits
            body = _ask(url, i)
            _reward(url, body["id"], float(i % 2))
        _wait(lambda: dep.learner.applied >= 1)
        status, body = post(f"{url}/admin/canary", {"agent": "listener"})
        assert status == 200, body
        status, body = post(f"{url}/admin/canary/decide", {"agent": "listener"})
        assert status == 200 and body["event"]["event"] == "promote", body
        version = body["event"]["version"]
        trained = dep.learner.published()
        assert set(trained) == set(before) and all(".lora_" in k for k in trained)
        assert any(not torch.equal(trained[k], before[k]) for k in trained)
        # what was published and written is the adapter alone
        folder = lora_run / "serving" / "listener" / f"v{version}"
        assert sorted(p.name for p in folder.iterdir()) == ["adapter.safetensors",
                                                            "flexmarl.json"]
        written = read_adapter_file(folder / "adapter.safetensors")
        assert all(torch.allclose(written[k], trained[k].to(written[k].dtype)) for k in trained)
        # the served policy is the trained one: same tokens, same log-probs
        policy = dep.learner.snapshot_model(dep.spec.model)
        for seed in (101, 102, 103):
            body = _ask(url, seed)
            assert body["flexmarl"]["version"] == version
            assert _served(body) == pytest.approx(_expected(policy, seed), abs=1e-4)
        # a trainer elsewhere (serve-learn) publishes a packed adapter file the same way
        path = tmp_path / "from-trainer.fmw"
        path.write_bytes(pack(trained))
        assert is_adapter_file(path)
        status, body = post(f"{url}/admin/canary", {"agent": "listener", "path": str(path),
                                                    "share": 1.0})
        assert status == 200, body
        assert _ask(url, 7)["flexmarl"]["version"] == body["event"]["version"]
    finally:
        running.close()
    # a restart serves the promoted adapter
    again = load_run(lora_run, "cpu").agents["listener"]
    assert again.version.number == version
    assert all(torch.allclose(v, trained[k].to(v.dtype))
               for k, v in adapter_tensors(again.model, "agent_listener").items())


TENANTS = """
tenants:
  ops:  {api_key: ops-key-0123, admin: true}
  acme: {api_key: acme-key-0123, train: true}
  beta: {api_key: beta-key-0123, train: true}
  guest: {api_key: guest-key-0123}
"""


def test_each_training_tenant_learns_and_is_served_its_own_adapter(lora_run, tmp_path):
    (tmp_path / "t.yaml").write_text(TENANTS)
    db = tmp_path / "c.sqlite"
    cfg = DeployConfig(learn=["listener"], batch=4, heldout=0, candidate_ratio=0.0,
                       kl_max=100.0, lr=0.05, canary_every=1, tick_s=0.05)
    running = start(lora_run, capture=Capture(db), deploy=cfg,
                    tenants=load_tenants(tmp_path / "t.yaml"))
    url = running.url
    try:
        dep = running.service.deployment.agents["listener"]
        spec = dep.spec
        assert set(dep.tenant_learners) == {"acme", "beta"} and dep.learner is None
        # the tenants' trainers hold one base between them (their adapters are their own)
        acme_t, beta_t = (dict(dep.tenant_learners[t].learner.trainer.model.named_parameters())
                          for t in ("acme", "beta"))
        for name, p in acme_t.items():
            assert (p.data_ptr() == beta_t[name].data_ptr()) != (".lora_" in name), name
        acme_adapter = spec.tenant_adapters["acme"]
        acme_before = adapter_tensors(spec.model, acme_adapter)
        acme_trainer_before = adapter_tensors(dep.tenant_learners["acme"].learner.trainer.model)
        # only beta sends rewarded traffic: beta learns, publishes; acme does not move
        beta_ids = []
        for i in range(8):
            body = _ask(url, i, "beta-key-0123")
            _reward(url, body["id"], float(i % 2), "beta-key-0123")
            beta_ids.append(body["id"])
        _wait(lambda: any(e["event"] == "tenant_publish" for e in _events(lora_run)))
        beta_adapter = spec.tenant_adapters["beta"]
        beta_version = spec.tenant_versions["beta"].number
        assert beta_version > spec.version.number
        assert any(not torch.equal(v, acme_before[k]) for k, v in
                   adapter_tensors(spec.model, beta_adapter).items())
        for k, v in adapter_tensors(spec.model, acme_adapter).items():
            assert torch.equal(v, acme_before[k])
        for k, v in adapter_tensors(dep.tenant_learners["acme"].learner.trainer.model).items():
            assert torch.equal(v, acme_trainer_before[k])
        assert (lora_run / "serving" / "listener" / "tenants" / "beta" /
                "adapter.safetensors").is_file()
        # each tenant is served by its own adapter; a tenant that does not train by the shadow
        for key, adapter, version in (("beta-key-0123", beta_adapter, beta_version),
                                      ("acme-key-0123", acme_adapter, spec.version.number),
                                      ("guest-key-0123", spec.adapter, spec.version.number)):
            body = _ask(url, 500, key)
            assert body["flexmarl"]["version"] == version, key
            assert _served(body) == pytest.approx(_expected(view(spec.model, adapter), 500),
                                                  abs=1e-4), key
        assert _served(_ask(url, 500, "beta-key-0123")) != pytest.approx(
            _served(_ask(url, 500, "acme-key-0123")), abs=1e-4)
        # acme's rewarded traffic now trains acme's adapter, from acme's rows only
        for i in range(8):
            body = _ask(url, 100 + i, "acme-key-0123")
            _reward(url, body["id"], float(i % 2), "acme-key-0123")
        _wait(lambda: dep.tenant_learners["acme"].learner.applied >= 1)
        con = sqlite3.connect(db)
        journal = con.execute("SELECT c.agent, i.tenant FROM consumed c JOIN interactions i "
                              "ON i.id = c.response_id").fetchall()
        assert {t for a, t in journal if a == "listener/tenant-acme"} == {"acme"}
        assert {t for a, t in journal if a == "listener/tenant-beta"} == {"beta"}
        assert {a for a, _ in journal} == {"listener/tenant-acme", "listener/tenant-beta"}
    finally:
        running.close()
    beta_version = spec.tenant_versions["beta"].number  # beta may have published again
    # a restart serves each tenant its last published adapter
    from flexmarl.serving.service import Service

    service = Service(load_run(lora_run, "cpu"), tenants=load_tenants(tmp_path / "t.yaml"))
    try:
        again = service.run.agents["listener"]
        assert again.tenant_versions["beta"].number == beta_version
        published = read_adapter_file(lora_run / "serving" / "listener" / "tenants" / "beta" /
                                      "adapter.safetensors")
        for k, v in adapter_tensors(again.model, again.tenant_adapters["beta"]).items():
            assert torch.allclose(v, published[k].to(v.dtype))
    finally:
        service.close()
