"""A node lost mid-run on a real multi-node Ray cluster (`ray.cluster_utils.Cluster` on this
machine): the workers it hosted are restarted on the surviving nodes by the local supervisor,
their placement-group bundles rescheduled by Ray; the store lives in the driver, so no row is
lost, none is trained twice, and the deterministic run ends equal to the local fault-free one.

The short test (in `make test`): two small nodes, one goes silent (every process of it
SIGSTOPped, as a frozen or cut-off host) and is declared lost within
`heartbeat_interval_s x heartbeat_misses`, then dies. The slow one: three nodes, one removed."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from flexmarl.orchestrator.run import train
from tests.faults.conftest import (
    assert_final_equal,
    assert_rows_exactly_once,
    config,
    events,
    reference,  # noqa: F401 - the session fixture: the local fault-free run
)
from tests.runtime.ray.conftest import local_cluster


def _node_pids(node) -> set[int]:
    """The raylet of a `Cluster` node and every process under it (its workers, our actors)."""
    from ray._private import ray_constants

    root = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    mine, grew = {root}, True
    while grew:
        children = {p for p, pp in parents.items() if pp in mine and p not in mine}
        mine |= children
        grew = bool(children)
    return mine


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture
def two_nodes():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray declares a node dead after ~7 s here (default ~15-30 s), so the rescheduling of its
    # bundles is quick; still later than the heartbeat check (3 s) that this test times
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
              "health_check_failure_threshold": 6}
    with local_cluster((1,), _system_config=health) as (c, nodes):
        yield c, nodes[0]


def test_a_silent_node_is_detected_in_time_and_survived(tmp_path, two_nodes):
    """(Equality with the fault-free run is the slow 3-node test's: this one stays short.)"""
    c, node = two_nodes
    interval, misses = 1.0, 3
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}",
                 "runtime.ray.rollout_bundle.cpus=0.25", "runtime.ray.train_bundle.cpus=0.25",
                 "runtime.ray.strategy=SPREAD", f"runtime.heartbeat_interval_s={interval}",
                 f"runtime.heartbeat_misses={misses}")
    state: dict = {}

    def freeze_then_kill() -> None:
        pids = _node_pids(node)
        _signal(pids, signal.SIGSTOP)  # silent: no beat, no answer, no Ray health check
        state["silent_at"] = time.time()
        deadline = time.time() + interval * misses + 15
        sup = state["runtime"].supervisor
        while time.time() < deadline and len(sup.failures) < len(state["lost"]):
            time.sleep(0.1)
        _signal(pids, signal.SIGKILL)  # then the host dies
        c.remove_node(node, allow_graceful=False)

    def on_runtime(runtime) -> None:
        state["runtime"] = runtime

    def on_iteration(record) -> None:
        if record["iteration"] == 0:
            placed = state["runtime"].placement()
            state["lost"] = {w["pid"] for pool in ("rollout", "train") for w in placed[pool]
                             if w["node_id"] == node.node_id}
            assert state["lost"], "SPREAD put no worker on the second node"
            state["thread"] = threading.Thread(target=freeze_then_kill, daemon=True)
            state["thread"].start()

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration, on_runtime=on_runtime)
    state["thread"].join(timeout=30)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert {f["pid"] for f in failed} == state["lost"] and len(recovered) == len(failed)
    for f in failed:  # declared lost by the heartbeat check, within the promised time
        assert f"missed {misses} heartbeats" in f["reason"], f
        # the watch looks every quarter interval; 1 s for this 2-core machine's load
        assert f["time"] - state["silent_at"] <= interval * misses + interval / 4 + 1.0, f
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)


@pytest.fixture
def cluster():
    with local_cluster((2, 2)) as (c, nodes):
        yield c, nodes


@pytest.mark.slow  # a 3-node cluster, a node lost and its workers restarted: ~2 min here
def test_a_lost_node_is_survived_exactly(tmp_path, cluster, reference):  # noqa: F811
    c, nodes = cluster
    cfg = config("runtime.kind=ray", f"runtime.address={c.address}",
                 "runtime.ray.rollout_bundle.cpus=0.5", "runtime.ray.train_bundle.cpus=0.5",
                 "runtime.ray.strategy=SPREAD")
    state: dict = {}

    def on_runtime(runtime) -> None:
        state["runtime"] = runtime

    def on_iteration(record) -> None:
        if record["iteration"] == 0:  # the node of rollout worker 0 goes, mid-run
            node_id = state["runtime"].placement()["rollout"][0]["node_id"]
            (victim,) = [n for n in nodes if n.node_id == node_id]
            state["lost"] = {w["pid"] for pool in ("rollout", "train")
                             for w in state["runtime"].placement()[pool]
                             if w["node_id"] == node_id}
            threading.Thread(target=c.remove_node, args=(victim,), daemon=True).start()

    out = tmp_path / "run"
    result = train(cfg, out, on_iteration=on_iteration, on_runtime=on_runtime)
    assert not ray.is_initialized()
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert {f["pid"] for f in failed} == state["lost"] and len(recovered) == len(failed)
    assert all("actor died" in f["reason"] for f in failed)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    assert_final_equal(out, reference)
