"""Drift over real HTTP: a reward drop after a new version rolls the agent back to the peak's
version and raises an alert; a drop with the peak's versions still serving (the environment
changed) raises the alert and rolls nothing back."""

from __future__ import annotations

from pathlib import Path

from flexmarl.serving.capture import Capture
from flexmarl.serving.drift import DriftConfig
from flexmarl.serving.toy import save_llama
from tests.serving.conftest import post, start


def _episodes(url: str, n: int, reward: float, seed: int) -> list[dict]:
    out = []
    for i in range(n):
        status, ep = post(f"{url}/episodes", {"seed": seed + i, "temperature": 1.0})
        assert status == 200, ep
        status, body = post(f"{url}/feedback", {"id": ep["id"], "reward": reward})
        assert status == 200, body
        out.append(ep)
    return out


def test_drift_after_a_new_version_rolls_it_back(toy_run, tmp_path: Path):
    running = start(toy_run, capture=Capture(tmp_path / "c.sqlite"),
                    drift=DriftConfig(window=12, drop=0.25))
    url = running.url
    try:
        listener = running.service.run.agents["listener"]
        good_model = listener.model
        _episodes(url, 12, 1.0, 0)  # a full window at reward 1: the peak, listener v1
        weights = tmp_path / "new"
        weights.mkdir()
        save_llama(weights, listener.vocab, seed=5)
        status, body = post(f"{url}/admin/reload", {"agent": "listener", "path": str(weights)})
        assert status == 200 and body["agents"]["listener"]["version"] == 2
        eps = _episodes(url, 3, 0.0, 100)  # 9/12 = 0.75: a drop of 0.25, not beyond it
        assert all(e["nodes"]["listen"]["version"] == 2 for e in eps)
        _, health = post(f"{url.removesuffix('/v1')}/health", method="GET")
        assert health["drift_alerts"] == 0
        _episodes(url, 1, 0.0, 200)  # 8/12: a drop of 1/3 -> drift
        _, health = post(f"{url.removesuffix('/v1')}/health", method="GET")
        assert health["drift_alerts"] >= 1
        _, drift = post(f"{url}/admin/drift", method="GET")
        alert = drift["recent_alerts"][0]
        assert alert["peak"] == 1.0 and alert["drop"] > 0.25
        assert alert["rolled_back"]["listener"] == {"from": 2, "to": 3}
        assert "speaker" not in alert["rolled_back"]
        _, models = post(f"{url}/models", method="GET")
        card = {m["id"]: m for m in models["data"]}["listener"]
        assert card["version"] == 3 and card["source"] == "drift-rollback-v1"
        assert listener.model is good_model  # v1's weights serve again
        ep = _episodes(url, 1, 1.0, 300)[0]
        assert ep["nodes"]["listen"]["version"] == 3
    finally:
        running.close()


def test_drift_with_the_peaks_versions_alerts_and_rolls_nothing_back(toy_run, tmp_path):
    running = start(toy_run, capture=Capture(tmp_path / "c.sqlite"),
                    drift=DriftConfig(window=10, drop=0.35))
    try:
        _episodes(running.url, 10, 1.0, 0)
        _episodes(running.url, 3, 0.0, 50)  # 7/10: a drop of 0.3, within bound
        _, drift = post(f"{running.url}/admin/drift", method="GET")
        assert drift["alerts"] == 0
        _episodes(running.url, 1, 0.0, 60)  # the environment changed: 6/10
        _, drift = post(f"{running.url}/admin/drift", method="GET")
        assert drift["alerts"] >= 1
        alert = drift["recent_alerts"][0]
        assert alert["rolled_back"] == {} and "environment" in alert["action"]
        _, models = post(f"{running.url}/models", method="GET")
        assert {m["id"]: m["version"] for m in models["data"]} == {"speaker": 1, "listener": 1}
        # the team key and the agents' keys each saw the drop
        assert {a["key"] for a in drift["recent_alerts"]} >= {"team", "agent/listener"}
    finally:
        running.close()
