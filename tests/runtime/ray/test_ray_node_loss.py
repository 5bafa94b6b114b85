"""A node lost mid-run on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and
two worker nodes on this machine, one removed): the workers it hosted are restarted on the
surviving node by the local supervisor, their placement-group bundles rescheduled by Ray; the
store lives in the driver, so no row is lost, none is trained twice, and the deterministic run
ends equal to the local fault-free one."""

from __future__ import annotations

import os
import threading

import pytest
import ray
from ray.cluster_utils import Cluster

from flexmarl.orchestrator.run import train
from tests.faults.conftest import (
    assert_final_equal,
    assert_rows_exactly_once,
    config,
    events,
    reference,  # noqa: F401 - the session fixture: the local fault-free run
)


@pytest.fixture
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=2) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


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
