"""`flexmarl drain ADDRESS NODE` on a real two-node Ray cluster: the run moves every worker it
has on the node elsewhere (restored as after a crash) and says so to the command; then the node
leaves, and no episode failed, no row was lost or trained twice."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from flexmarl.orchestrator.run import train
from flexmarl.runtime.ray.drain import missing_gcs_methods
from tests.faults.conftest import ROOT, assert_rows_exactly_once, config, events
from tests.runtime.ray.conftest import local_cluster


@pytest.fixture
def two_nodes():
    with local_cluster((1,)) as (c, nodes):
        yield c, nodes[0]


def test_the_private_ray_api_drain_uses_is_there():
    """Ray has no public drain API (runtime/ray/drain.py says why): a Ray upgrade that drops
    the private methods fails here, not in a user's drain."""
    assert missing_gcs_methods() == []


@pytest.mark.slow  # a two-node cluster, a run, a drain: ~1 min here
def test_drain_moves_the_work_off_a_node_before_it_leaves(tmp_path, two_nodes):
    c, node = two_nodes
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}", "train.iterations=30",
                 "runtime.ray.rollout_bundle.cpus=0.25", "runtime.ray.train_bundle.cpus=0.25",
                 "runtime.ray.strategy=SPREAD")
    state: dict = {}

    def drain_then_leave() -> None:
        state["cli"] = subprocess.run(
            [sys.executable, "-m", "flexmarl", "drain", c.address, node.node_id,
             "--timeout", "120"], cwd=ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        c.remove_node(node)

    def on_runtime(runtime) -> None:
        state["runtime"] = runtime

    def on_iteration(record) -> None:
        if record["iteration"] == 0:
            placed = state["runtime"].placement()
            state["on_node"] = {f"{pool}[{w['worker']}]" for pool in ("rollout", "train")
                                for w in placed[pool] if w["node_id"] == node.node_id}
            assert state["on_node"], "SPREAD put no worker on the second node"
            state["thread"] = threading.Thread(target=drain_then_leave, daemon=True)
            state["thread"].start()

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration, on_runtime=on_runtime)
    state["thread"].join(timeout=200)
    cli = state["cli"]
    assert cli.returncode == 0, cli.stdout + cli.stderr
    (drained,) = events(out, "node_drained")
    assert drained["node_id"] == node.node_id and not drained["failed"]
    assert {m["worker"] for m in drained["moved"]} == state["on_node"]
    assert all(m["to_node"] != node.node_id for m in drained["moved"])
    for name in state["on_node"]:
        assert f"{name} -> node" in cli.stdout, cli.stdout
    assert all("drained" in f["reason"] for f in events(out, "worker_failed"))
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
