"""The local rollout pool end to end: replicas, the balancer's plan, rollout metrics."""

import json

import pytest
import yaml

from flexmarl.config.schema import config_from_dict
from flexmarl.orchestrator.run import train
from tests.rollout.test_openai_backend import ROOT


def _skewed(**rollout) -> dict:
    raw = yaml.safe_load((ROOT / "examples/skewed_rollout.yaml").read_text())
    raw["task"]["options"]["lengths"] = {"router": 2, "brief": 3, "detailed": 6, "verbose": 24}
    raw["train"].update(iterations=2, inputs_per_iteration=6, group_size=2)
    raw["runtime"]["rollout_workers"] = 3
    raw["rollout"].update(rollout)
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for balance in ("static", "hierarchical"):
        raw = _skewed(balance=balance)
        raw["runtime"]["deterministic"] = True
        out[balance] = train(config_from_dict(raw), tmp_path_factory.mktemp(balance))
    return out


def test_plan_follows_demand_and_is_logged(runs):
    res = runs["hierarchical"]
    first = res.records[0]
    plan = first["rollout/plan"]
    assert plan["iteration"] == 1 and plan["mode"] == "hierarchical"
    demand = plan["demand"]
    assert max(demand, key=demand.get) == "verbose"
    assert plan["share"]["verbose"] == max(plan["share"].values())
    assert len(plan["replicas"]["verbose"]) >= 2
    logged = [json.loads(line) for line in (res.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/plan"]["iteration"] for r in logged] == [1, 2]
    static_plan = runs["static"].records[0]["rollout/plan"]
    assert static_plan["replicas"] == {"router": [0], "brief": [1], "detailed": [2], "verbose": [0]}


def test_rollout_metrics_per_iteration(runs):
    for res in runs.values():
        for r in res.records:
            busy = [r[f"rollout/replica/{i}/busy_frac"] for i in range(3)]
            assert all(0.0 <= b <= 1.0 + 1e-6 for b in busy)
            assert r["rollout/imbalance"] >= 1.0
            for agent in ("router", "brief", "detailed", "verbose"):
                assert r[f"agent/{agent}/tokens_generated"] > 0
                assert r[f"agent/{agent}/tokens_per_s"] > 0
                assert 0.0 <= r[f"agent/{agent}/queue_wait_p50_s"] <= r[
                    f"agent/{agent}/queue_wait_p95_s"]
            assert r["node/verbose/latency_p50_s"] > 0
            assert r["rollout/episode_latency_p95_s"] >= r["rollout/episode_latency_p50_s"] > 0
            assert r["episodes/failed"] == 0
        # the skew is real: the verbose expert writes several times what the brief one does
        r = res.records[0]
        assert r["agent/verbose/tokens_generated"] > 4 * r["agent/brief/tokens_generated"]


def test_balancing_never_changes_what_is_sampled(runs):
    """Where a request runs is the balancer's business; what it samples is keyed by its
    sample_id and version, so both runs generate exactly the same tokens."""
    a, b = runs["static"].records, runs["hierarchical"].records
    for x, y in zip(a, b, strict=True):
        for agent in ("router", "brief", "detailed", "verbose"):
            assert x[f"agent/{agent}/tokens_generated"] == y[f"agent/{agent}/tokens_generated"]
            assert x[f"agent/{agent}/reward_mean"] == y[f"agent/{agent}/reward_mean"]
