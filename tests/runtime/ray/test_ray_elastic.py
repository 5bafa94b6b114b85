"""An elastic rollout pool on a real multi-node Ray cluster: the run starts with `min` replicas
on a full head; a node that joins mid-run gets a new replica (its own placement group, every
agent's latest weights loaded) which the next plans count and send requests to; no row is lost
or trained twice."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from flexmarl.orchestrator.run import train
from tests.faults.conftest import ROOT, assert_rows_exactly_once, config, events
from tests.runtime.ray.conftest import local_cluster


@pytest.fixture
def one_full_node():
    with local_cluster() as (c, _):
        yield c


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


@pytest.mark.slow  # a Ray cluster, a node started and removed mid-run: ~1 min here
def test_the_pool_shrinks_back_when_the_node_it_grew_onto_leaves(tmp_path, one_full_node):
    """Grown onto a joined node, the pool shrinks back to `min` when that node leaves: the
    lost replica is not restarted (its bundle is given back, no room for it elsewhere), the
    plans count one replica again, and no row is lost or trained twice."""
    c = one_full_node
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}",
                 "runtime.rollout_workers={min: 1, max: 2}", "train.iterations=40",
                 "runtime.ray.rollout_bundle.cpus=0.5", "runtime.ray.train_bundle.cpus=0.5",
                 "runtime.ray.placement_timeout_s=5")
    state: dict = {}

    def on_iteration(record) -> None:
        rt = state["runtime"]
        if record["iteration"] == 0:
            state["node"] = c.add_node(num_cpus=1)
        elif len(rt.rollout_workers) == 2 and "left_after" not in state:
            state["left_after"] = record["iteration"]  # the grown replica served an iteration
            c.remove_node(state["node"])

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration,
                   on_runtime=lambda rt: state.setdefault("runtime", rt))
    (grown,) = events(out, "pool_grown")
    assert grown["worker"] == 1 and "left_after" in state
    (shrunk,) = events(out, "pool_shrunk")
    assert shrunk["worker"] == 1 and shrunk["workers"] == 1
    assert not [e for e in events(out, "worker_recovered") if e["pool"] == "rollout"]
    late = [r for r in result.records if r["iteration"] > state["left_after"] + 1]
    assert late and all("rollout/replica/1/busy_frac" not in r for r in late)
    assert len(state["runtime"].rollout_workers) == 1
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)


@pytest.mark.slow  # a Ray cluster, a node started mid-run then drained: ~1 min here
def test_draining_the_node_it_grew_onto_shrinks_the_pool(tmp_path, one_full_node):
    """`flexmarl drain` of the node an elastic pool grew onto: the grown replica there is not
    moved but retired (the pool shrinks back to `min`), the command says so, and the node then
    leaves with no episode failed and no row lost or trained twice."""
    c = one_full_node
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}",
                 "runtime.rollout_workers={min: 1, max: 2}", "train.iterations=40",
                 "runtime.ray.rollout_bundle.cpus=0.5", "runtime.ray.train_bundle.cpus=0.5",
                 "runtime.ray.placement_timeout_s=5")
    state: dict = {}

    def drain_then_leave() -> None:
        state["cli"] = subprocess.run(
            [sys.executable, "-m", "flexmarl", "drain", c.address, state["node"].node_id,
             "--timeout", "120"], cwd=ROOT, capture_output=True, text=True, timeout=180,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        c.remove_node(state["node"])

    def on_iteration(record) -> None:
        if record["iteration"] == 0:
            state["node"] = c.add_node(num_cpus=1)
        elif len(state["runtime"].rollout_workers) == 2 and "thread" not in state:
            state["thread"] = threading.Thread(target=drain_then_leave, daemon=True)
            state["thread"].start()

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration,
                   on_runtime=lambda rt: state.setdefault("runtime", rt))
    state["thread"].join(timeout=200)
    cli = state["cli"]
    assert cli.returncode == 0 and "rollout[1] (pool shrunk)" in cli.stdout, (
        cli.stdout + cli.stderr)
    (drained,) = events(out, "node_drained")
    assert drained["moved"] == [{"worker": "rollout[1]", "to_node": None, "retired": True}]
    (shrunk,) = events(out, "pool_shrunk")
    assert shrunk["worker"] == 1 and shrunk["workers"] == 1
    assert not [e for e in events(out, "worker_recovered") if e["pool"] == "rollout"]
    assert len(state["runtime"].rollout_workers) == 1
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
