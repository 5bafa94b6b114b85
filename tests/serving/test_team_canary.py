"""Team canary over real HTTP: a whole version vector gets its share of episodes (every node
on the canary versions), per-agent traffic never reaches it, and it is promoted or rolled back
as one by the confidence-interval rule; the rule's statistics by hand."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.team import TeamCanary, TeamCanaryConfig
from flexmarl.serving.toy import save_llama
from tests.serving.conftest import post, start


def test_the_rule_by_hand():
    tc = TeamCanary({}, {}, TeamCanaryConfig(min_episodes=4, confidence=0.95, margin=0.1))
    for c, s in zip([1, 0, 1, 0], [1, 1, 0, 1], strict=True):
        tc.observe("canary", c)
        tc.observe("shadow", s)
    st = tc.statistics()
    se = math.sqrt((1 / 3) / 4 + 0.25 / 4)
    assert st["diff"] == pytest.approx(-0.25) and st["se"] == pytest.approx(se)
    assert st["ci"] == pytest.approx([-0.25 - 1.959964 * se, -0.25 + 1.959964 * se], abs=1e-5)
    assert tc.verdict() == (None, st)  # the interval straddles -margin: wait
    verdict, why = tc.verdict(force=True)
    assert verdict == "rollback" and "no evidence" in why["reason"]
    sure = TeamCanary({}, {}, TeamCanaryConfig(min_episodes=3, margin=0.0))
    for _ in range(3):
        sure.observe("canary", 1.0)
        sure.observe("shadow", 1.0)
    assert sure.verdict()[0] == "promote"
    with pytest.raises(ValueError, match="share: must be in"):
        TeamCanaryConfig(share=0).check()


def _weights(tmp: Path, name: str, vocab: int, seed: int) -> str:
    folder = tmp / f"{name}-{seed}"
    folder.mkdir()
    save_llama(folder, vocab, seed=seed)
    return str(folder)


def test_team_canary_promoted_and_rolled_back_as_one(toy_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    running = start(run, capture=Capture(tmp_path / "c.sqlite"),
                    deploy=DeployConfig(heldout=0, canary_min_feedback=10_000))
    url = running.url
    agents = running.service.run.agents
    try:
        status, body = post(f"{url}/admin/team-canary", {"agents": {"x": "/nowhere"}})
        assert status == 404 and "agents.x" in body["error"]["message"]
        status, body = post(f"{url}/admin/team-canary", {"agents": {"listener": "/p"},
                                                         "confidence": 2})
        assert status == 400 and body["error"]["param"] == "confidence"
        paths = {n: _weights(tmp_path, n, agents[n].vocab, 7) for n in ("speaker", "listener")}
        status, body = post(f"{url}/admin/team-canary", {
            "agents": paths, "share": 0.25, "min_episodes": 10, "margin": 0.5,
            "score": "feedback"})
        assert status == 200, body
        canary = body["event"]["versions"]
        assert canary == {"speaker": 2, "listener": 2}
        status, _ = post(f"{url}/admin/canary", {"agent": "listener", "path": paths["listener"]})
        assert status in (400, 409)  # no per-agent canary beside a team canary
        arms = []
        for i in range(40):
            status, ep = post(f"{url}/episodes", {"seed": i, "temperature": 1.0})
            assert status == 200, ep
            arm = ep["team_canary"]
            arms.append(arm)
            want = canary if arm == "canary" else {"speaker": 1, "listener": 1}
            assert {ep["nodes"][n]["agent"]: ep["nodes"][n]["version"]
                    for n in ep["nodes"]} == want
            out = running.client().completions.create(model="listener", prompt=[5, 9, 40],
                                                      max_tokens=1, seed=i)
            assert out.model_extra["flexmarl"]["version"] == 1  # per-agent traffic: shadow
            if i < 39:
                status, _ = post(f"{url}/feedback", {"id": ep["id"], "reward": float(i % 2)})
                assert status == 200
        assert arms.count("canary") == 10  # floor(40 * 0.25)
        _, state = post(f"{url}/admin/team-canary", method="GET")
        assert state["active"] and state["n_canary"] == 9 and state["n_shadow"] == 30
        status, _ = post(f"{url}/feedback", {"id": ep["id"], "reward": 1.0})
        _, state = post(f"{url}/admin/team-canary", method="GET")
        assert state == {"active": False}  # 10 and 30 scored: the rule decided
        _, models = post(f"{url}/models", method="GET")
        assert {m["id"]: m["version"] for m in models["data"]} == canary  # promoted as one
        for name in canary:  # written as each agent's SHADOW: a restart serves the vector
            assert (run / "serving" / name / "SHADOW").read_text() == "v2"
        events = [json.loads(x)["event"] for x in
                  (run / "serving" / "events.jsonl").read_text().splitlines()]
        assert "team_canary_start" in events and "team_promote" in events

        paths = {"listener": _weights(tmp_path, "listener", agents["listener"].vocab, 8)}
        status, body = post(f"{url}/admin/team-canary", {
            "agents": paths, "share": 0.5, "min_episodes": 5, "score": "feedback"})
        assert status == 200 and body["event"]["versions"] == {"listener": 3}
        for i in range(10):
            status, ep = post(f"{url}/episodes", {"seed": 100 + i, "temperature": 1.0})
            post(f"{url}/feedback", {"id": ep["id"],
                                     "reward": 0.0 if ep["team_canary"] == "canary" else 1.0})
        _, models = post(f"{url}/models", method="GET")
        assert {m["id"]: m["version"] for m in models["data"]} == canary  # rolled back
        status, ep = post(f"{url}/episodes", {"seed": 999})
        assert "team_canary" not in ep
        # scored by the task's own success: decided after 3 episodes per arm at the latest
        status, body = post(f"{url}/admin/team-canary", {
            "agents": paths, "share": 0.5, "min_episodes": 3, "max_episodes": 3,
            "score": "task"})
        assert status == 200, body
        for i in range(6):
            status, ep = post(f"{url}/episodes", {"seed": 200 + i, "temperature": 1.0})
            assert ep["team_canary"] in ("shadow", "canary") and "success" in ep
        _, state = post(f"{url}/admin/team-canary", method="GET")
        assert state == {"active": False}
    finally:
        running.close()
