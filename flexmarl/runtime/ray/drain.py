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

Why Ray's private `GcsClient` (`ray._raylet.GcsClient`): Ray 2.60 has no public API for any of
the three things this needs. Draining a node is only the hidden `ray drain-node` CLI, which Ray
documents as "not covered by Ray's public API stability guarantees" and which itself calls
`GcsClient.drain_node`; the set of draining nodes is only `GcsClient.get_draining_nodes` (Ray's
own users, Ray Train's preemption watcher and Serve, reach it through
`ray._private.state`); `ray.nodes()` and `ray.util.state.list_nodes()` report a draining node as
ALIVE. The cluster's key-value store is only `ray.experimental.internal_kv`, the same client.
So every use of it is here, behind `gcs_client`, which checks that the installed Ray still has
the methods and otherwise names the Ray version that was tested (`TESTED_RAY`);
`tests/runtime/ray/test_ray_drain.py` checks the same on every `make test`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray
from ray.core.generated import autoscaler_pb2

from flexmarl.runtime.ray.session import RayRuntimeError

NAMESPACE = b"flexmarl"
TESTED_RAY = "2.60"  # the Ray whose private GcsClient methods this module was written against
GCS_METHODS = ("drain_node", "get_draining_nodes", "internal_kv_put", "internal_kv_get",
               "internal_kv_keys")


def missing_gcs_methods() -> list[str]:
    """What drain uses of Ray's private GCS client that the installed Ray lacks."""
    raylet = getattr(ray, "_raylet", None)
    if getattr(raylet, "GcsClient", None) is None:
        return ["ray._raylet.GcsClient"]
    # `GcsClient` forwards every method to its `InnerGcsClient` (Cython): look there
    inner = getattr(raylet, "InnerGcsClient", None)
    return [f"ray._raylet.GcsClient.{m}" for m in GCS_METHODS if not hasattr(inner, m)]


def gcs_client(address: str) -> Any:
    """Ray's private GCS client (see the module docstring for why), or a clear error when the
    installed Ray no longer has what drain uses."""
    missing = missing_gcs_methods()
    if missing:
        raise RayRuntimeError(
            f"flexmarl drain: ray {ray.__version__} lacks {', '.join(missing)}, which draining "
            f"uses (Ray has no public drain API; written against ray {TESTED_RAY})")
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
