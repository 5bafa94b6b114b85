"""An elastic rollout pool on a real multi-node Ray cluster: the run starts with `min` replicas
on a full head; a node that joins mid-run gets a new replica (its own placement group, every
agent's latest weights loaded) which the next plans count and send requests to; no row is lost
or trained twice."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster

from flexmarl.orchestrator.run import train
from tests.faults.conftest import assert_rows_exactly_once, config, events


@pytest.fixture
def one_full_node():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.mark.slow  # a Ray cluster, a node started mid-run: ~1.5 min here
def test_a_node_that_joins_gets_a_new_replica_with_work(tmp_path, one_full_node):
    c = one_full_node
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}",
                 "runtime.rollout_workers={min: 1, max: 2}", "train.iterations=40",
                 "runtime.ray.rollout_bundle.cpus=0.5", "runtime.ray.train_bundle.cpus=0.5")
    state: dict = {}

    def on_iteration(record) -> None:
        if record["iteration"] == 0:  # the head is full (1 replica + 1 slot); a node joins
            state["node"] = c.add_node(num_cpus=1)  # (the run waits meanwhile)

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration)
    (grown,) = events(out, "pool_grown")
    assert grown["worker"] == 1 and grown["node_id"] == state["node"].node_id
    assert not events(out, "pool_grow_failed")
    after = [r for r in result.records if r["iteration"] > grown["after_iteration"] + 1]
    assert after, "the run ended before the grown replica could serve"
    assert any(r.get("rollout/replica/1/busy_frac", 0.0) > 0 for r in after)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
