"""Drain a Ray node before it leaves: `flexmarl drain ADDRESS NODE_ID`.

The command asks Ray to drain the node (Ray's own drain: it schedules nothing new there), then
waits for the runs on the cluster to move their work off it. Each run's driver looks for
draining nodes as an iteration's rollout ends; every worker of its own on one gets a bundle of
its own elsewhere (a one-bundle placement group, which Ray keeps off draining nodes) and is
restarted there by the supervisor, restored as after a crash (a replica reloads the latest
weights, its requests go to the live replicas; a training slot is restored from its journal),
so no episode fails and no row is lost. The driver then reports what it moved under
`drained/NODE/RUN` in the cluster's key-value store (namespace `flexmarl`), which the command
prints.
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray
from ray.core.generated import autoscaler_pb2

from flexmarl.runtime.ray.session import RayRuntimeError

NAMESPACE = b"flexmarl"


def gcs_client(address: str) -> Any:
    return ray._raylet.GcsClient(address=address)  # type: ignore[attr-defined]


def draining_nodes(gcs: Any) -> set[str]:
    """Hex ids of the nodes Ray is draining."""
    return {node_id.hex() if isinstance(node_id, bytes) else str(node_id)
            for node_id in gcs.get_draining_nodes()}


def report_drained(gcs: Any, node_id: str, run: str, moved: list[dict[str, Any]],
                   failed: list[str]) -> None:
    key = f"drained/{node_id}/{run}".encode()
    value = json.dumps({"run": run, "moved": moved, "failed": failed}).encode()
    gcs.internal_kv_put(key, value, True, NAMESPACE)


def drain(address: str, node_id: str, timeout_s: float = 300.0, poll_s: float = 1.0
          ) -> list[dict[str, Any]]:
    """Ask Ray to drain `node_id`, then wait up to `timeout_s` for at least one run's report
    (and `poll_s` more for the others'); the reports, one per run that had work there."""
    gcs = gcs_client(address)
    try:
        accepted, why = gcs.drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
                "DRAIN_NODE_REASON_PREEMPTION"),
            "flexmarl drain: the node is about to leave", 0)
    except Exception as exc:  # noqa: BLE001 - Ray's error names the bad id; ours the argument
        raise RayRuntimeError(f"flexmarl drain {address} {node_id}: Ray refused: {exc}") from None
    if not accepted:
        raise RayRuntimeError(f"flexmarl drain {address} {node_id}: Ray refused: {why}")
    prefix = f"drained/{node_id}/".encode()
    deadline = time.time() + timeout_s
    while True:
        keys = gcs.internal_kv_keys(prefix, NAMESPACE)
        if keys:
            time.sleep(poll_s)  # other runs on the node report about as fast
            keys = gcs.internal_kv_keys(prefix, NAMESPACE)
            return [json.loads(gcs.internal_kv_get(k, NAMESPACE)) for k in sorted(keys)]
        if time.time() > deadline:
            return []
        time.sleep(poll_s)
