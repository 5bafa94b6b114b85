"""Tenants (`flexmarl serve --tenants FILE`): the file's checks, 401 with nothing recorded, 429
per tenant, admin routes, and isolation of each tenant's experience, feedback and training."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from flexmarl.cli.main import main
from flexmarl.config.schema import ConfigError
from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.tenants import RateLimited, load_tenants
from tests.serving.conftest import post, start

TENANTS = """
tenants:
  ops:  {api_key: ops-key-0123, admin: true}
  acme: {api_key: acme-key-0123, requests_per_minute: 6, train: true}
  beta: {api_key_env: BETA_KEY}
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("text, says", [
    ("tenants: {a: {requests_per_minute: 5}}", "tenants.a: give exactly one of api_key"),
    ("tenants: {a: {api_key: k-0123456, api_key_env: X}}", "give exactly one"),
    ("tenants: {a: {api_key: k-0123456, requests_per_minute: 0}}",
     "tenants.a.requests_per_minute: Input should be greater than or equal to 1"),
    ("tenants: {a: {api_key: k-0123456, rpm: 3}}", "tenants.a.rpm: unknown key"),
    ("tenants: {a: {api_key: short}}", "tenants.a.api_key: String should have at least 8"),
    ("tenants: {}", "tenants: Dictionary should have at least 1 item"),
    ("users: {}", "tenants: Field required"),
    ("tenants: {a: {api_key: k-0123456, admin: maybe}}", "tenants.a.admin: Input should be"),
    ("tenants: {a: {api_key_env: NOT_SET_HERE}}",
     "tenants.a.api_key_env: environment variable NOT_SET_HERE is not set"),
    ("tenants: {a: {api_key: k-0123456}, b: {api_key: k-0123456}}",
     "tenants.b: same API key as tenant 'a'"),
    ("tenants: [a", "not YAML"),
])
def test_a_bad_tenants_file_names_file_and_field(tmp_path, text, says):
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_tenants(path, env={})
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value)
    assert "\n" not in str(err.value)


def test_cli_refuses_a_bad_file_and_tenants_with_api_key(toy_run, tmp_path, capsys):
    bad = _file(tmp_path, "tenants: {a: {api_key: k-0123456, admin: maybe}}")
    assert main(["serve", str(toy_run), "--tenants", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: tenants.a.admin:") and "\n" not in err
    good = _file(tmp_path, "tenants: {a: {api_key: k-0123456}}")
    assert main(["serve", str(toy_run), "--tenants", str(good), "--api-key", "k"]) == 2
    assert "--tenants and --api-key together" in capsys.readouterr().err
    assert main(["serve", str(toy_run), "--tenants", str(good), "--capture",
                 str(tmp_path / "c.sqlite"), "--learn", "listener"]) == 2
    assert "no tenant has train: true" in capsys.readouterr().err


def test_minute_and_day_limits_count_per_tenant(tmp_path):
    path = _file(tmp_path, "tenants: {a: {api_key: a-0123456, requests_per_minute: 2, "
                           "requests_per_day: 3}, b: {api_key: b-0123456}}")
    tenants = load_tenants(path, env={})
    a, b = tenants.by_name["a"], tenants.by_name["b"]
    day = 86400.0 * 20000
    tenants.admit(a, day + 10)
    tenants.admit(a, day + 20)
    with pytest.raises(RateLimited, match="2 requests per minute") as err:
        tenants.admit(a, day + 30)
    assert err.value.retry_after_s == pytest.approx(40.0)
    for i in range(100):
        tenants.admit(b, day + 30 + i * 0.01)  # no limits: never refused
    tenants.admit(a, day + 71)  # the first has left the minute
    with pytest.raises(RateLimited, match="daily quota of 3"):
        tenants.admit(a, day + 200)
    tenants.admit(a, day + 86400 + 1)  # a new UTC day


def test_tenants_over_http(toy_run, tmp_path, monkeypatch):
    monkeypatch.setenv("BETA_KEY", "beta-key-0123")
    db = tmp_path / "served.sqlite"
    running = start(toy_run, capture=Capture(db), tenants=load_tenants(_file(tmp_path, TENANTS)))
    url = running.url

    def ask(key: str, seed: int) -> tuple[int, dict]:
        return post(f"{url}/completions", {"model": "listener", "prompt": [5, 9, 40],
                                           "max_tokens": 2, "seed": seed, "temperature": 1.0},
                    headers=_auth(key))

    try:
        for headers in ({}, _auth("acme-key-0124"), {"authorization": "acme-key-0123"}):
            status, body = post(f"{url}/completions", {"model": "listener", "prompt": [5, 9],
                                                       "max_tokens": 2}, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = post(f"{url}/feedback", {"id": "x", "reward": 1.0})
        assert status == 401
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM interactions").fetchone()[0] == 0

        status, body = post(f"{url}/admin/versions", method="GET", headers=_auth("beta-key-0123"))
        assert status == 403 and "'beta'" in body["error"]["message"]
        status, body = post(f"{url}/admin/versions", method="GET", headers=_auth("ops-key-0123"))
        assert status == 200 and "listener" in body["agents"]

        acme_ids = []
        for i in range(6):
            status, body = ask("acme-key-0123", i)
            assert status == 200, body
            acme_ids.append(body["id"])
        status, body = ask("acme-key-0123", 99)
        assert status == 429 and "'acme'" in body["error"]["message"]
        beta_ids = []
        for i in range(8):  # acme at its limit: beta is served all the same
            status, body = ask("beta-key-0123", 100 + i)
            assert status == 200, body
            beta_ids.append(body["id"])

        con = sqlite3.connect(db)
        tenant_of = dict(con.execute("SELECT id, tenant FROM interactions").fetchall())
        assert tenant_of == {**dict.fromkeys(acme_ids, "acme"), **dict.fromkeys(beta_ids, "beta")}
        # one tenant cannot reward (or even see) another's response
        status, _ = post(f"{url}/feedback", {"id": acme_ids[0], "reward": 1.0},
                         headers=_auth("beta-key-0123"))
        assert status == 404
        for rid in beta_ids:
            status, _ = post(f"{url}/feedback", {"id": rid, "reward": 1.0},
                             headers=_auth("beta-key-0123"))
            assert status == 200
        assert con.execute("SELECT COUNT(*) FROM feedback").fetchone()[0] == len(beta_ids)
    finally:
        running.close()


def test_one_tenants_traffic_never_trains_on_anothers(toy_run, tmp_path, monkeypatch):
    """An online learner behind tenants: only rows of `train: true` tenants are claimed,
    however much rewarded traffic the others send."""
    monkeypatch.setenv("BETA_KEY", "beta-key-0123")
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    db = tmp_path / "served.sqlite"
    text = TENANTS.replace("requests_per_minute: 6, ", "")
    running = start(run, capture=Capture(db), tenants=load_tenants(_file(tmp_path, text)),
                    deploy=DeployConfig(learn=["listener"], batch=4, heldout=0,
                                        canary_min_feedback=10_000, canary_every=10_000,
                                        tick_s=0.05))
    try:
        by = {"acme": [], "beta": []}
        for i in range(12):
            for name in ("beta", "acme") if i % 3 else ("acme", "beta", "beta"):
                status, ep = post(f"{running.url}/episodes", {"seed": i * 10 + len(by[name]),
                                                              "temperature": 1.0},
                                  headers=_auth(f"{name}-key-0123"))
                assert status == 200, ep
                by[name].append(ep["id"])
                status, _ = post(f"{running.url}/feedback", {"id": ep["id"], "reward": 1.0},
                                 headers=_auth(f"{name}-key-0123"))
                assert status == 200
        con = sqlite3.connect(db)
        deadline = time.time() + 60
        while time.time() < deadline and con.execute(
                "SELECT COUNT(*) FROM consumed").fetchone()[0] < 8:
            time.sleep(0.1)
        claimed = con.execute("SELECT i.episode, i.tenant FROM consumed c JOIN interactions i "
                              "ON i.id = c.response_id").fetchall()
        assert len(claimed) >= 8
        assert {t for _, t in claimed} == {"acme"}
        assert not {e for e, _ in claimed} & set(by["beta"])
        left = con.execute("SELECT COUNT(*) FROM interactions i JOIN feedback f ON "
                           "f.response_id = i.id WHERE i.tenant = 'beta' AND i.agent = "
                           "'listener'").fetchone()[0]
        assert left >= 12  # beta's rewarded listener rows were there to take, and stayed
    finally:
        running.close()
