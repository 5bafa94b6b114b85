"""Chaos run: one config trained fault-free and then with K random faults, same seed, in one
invocation. Faults (`fault`): `process`, a SIGKILL of a real worker process (rollout replica or
training worker; local or Ray); `actor`, `ray.kill` of a worker's `PipeActor` (Ray); `node`, a
whole Ray node removed (`ray.cluster_utils.Cluster`, built here: a head that hosts no worker and
`nodes` worker nodes; a fresh node joins after each removal, so the cluster keeps its size).

Prints faults injected, failures detected, recoveries, median and max recovery time (fault ->
replacement serving, with every agent's weights or trainer state restored), rows lost and rows
trained on twice (counted by sample_id from the audit trail), and final success rate against the
fault-free run (on Ray, the fault-free run uses the same cluster). A run that injected no fault
raises `ChaosError` instead of printing a clean table.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import RunResult, train


def row_accounting(result: RunResult, cfg: Any) -> tuple[int, int]:
    """(rows lost, rows trained on twice): every node of every episode of every iteration
    should be trained on exactly once."""
    lost = dup = 0
    per_iteration = cfg.train.inputs_per_iteration * cfg.train.group_size
    for trail in result.audit.values():
        ids = [sid for sid, _, _ in trail]
        unique = set(ids)
        dup += len(ids) - len(unique)
        lost += per_iteration * cfg.train.iterations - len(unique)  # one node per agent
    return lost, dup


def _final_success(result: RunResult, last: int = 5) -> float:
    tail = result.records[-last:]
    return sum(r["task/success_rate"] for r in tail) / max(len(tail), 1)


FAULTS = ("process", "actor", "node")


class Killer(threading.Thread):
    """Injects a fault into a random live worker at each of the given times (seconds from
    start): SIGKILL of its process, `ray.kill` of its actor, or removal of its Ray node
    (`cluster`; a fresh node is added after each removal). Each fault records every worker it
    took down, with the fault's time."""

    def __init__(self, runtime: Any, times: list[float], seed: int, fault: str = "process",
                 cluster: Any = None, node_cpus: float = 2.0) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.runtime, self.times, self.rng = runtime, times, random.Random(seed)
        self.fault, self.cluster, self.node_cpus = fault, cluster, node_cpus
        self.done = threading.Event()  # the run returned, or its last iteration ended
        self.kills: list[dict[str, Any]] = []  # one per worker taken down
        self.faults = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._inject_all()
        except BaseException as exc:  # noqa: BLE001 - reported by bench_chaos, not swallowed
            self.error = exc

    def _live(self) -> list[Any]:
        workers = self.runtime.rollout_workers + self.runtime.train_workers
        live = [w for w in workers if w.alive and w.process.is_alive()]
        if self.fault == "node":  # only workers whose node can go (not the head)
            removable = {n.node_id for n in self.cluster.worker_nodes}
            live = [w for w in live if _node_of(w) in removable]
        return live

    def _inject_all(self) -> None:
        t0 = time.time()
        for at in self.times:
            if self.done.wait(max(0.0, t0 + at - time.time())):
                return
            while True:  # every worker may be restarting: wait for one to take down
                live = self._live()
                if live:
                    break
                if self.done.wait(0.2):
                    return
            self._inject(self.rng.choice(live))

    def _inject(self, w: Any) -> None:
        now = time.time()
        entry = {"pool": w.pool, "worker": w.index, "pid": w.process.pid, "time": now,
                 "fault": self.faults}
        if self.fault == "process":
            os.kill(w.process.pid, signal.SIGKILL)
            self.kills.append(entry)
        elif self.fault == "actor":
            import ray  # optional (the ray extra): only Ray faults need it

            ray.kill(w.process.handle, no_restart=True)
            self.kills.append(entry)
        else:
            node_id = _node_of(w)
            (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
            for other in self.runtime.rollout_workers + self.runtime.train_workers:
                if other.alive and _node_of(other) == node_id:
                    self.kills.append({**entry, "pool": other.pool, "worker": other.index,
                                       "pid": other.process.pid})
            self.cluster.remove_node(node)
            self.cluster.add_node(num_cpus=self.node_cpus)  # the cluster keeps its size
        self.faults += 1


def _node_of(w: Any) -> str | None:
    w.process.pid  # noqa: B018 - fills `where` (the actor's node) on first use
    return (getattr(w.process, "where", None) or {}).get("node_id")


@contextmanager
def ray_cluster(nodes: int, node_cpus: float) -> Iterator[Any]:
    """A multi-node Ray cluster on this machine: a head with no CPU for workers (the driver
    connects there; it is never removed) and `nodes` worker nodes."""
    import ray  # optional (the ray extra): only Ray faults need it
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # no exit hooks: they install signal handlers, and the killer thread adds nodes
    cluster = Cluster(initialize_head=True, shutdown_at_exit=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=node_cpus)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def bench_chaos(
    config: str, overrides: list[str] | None = None, kills: int = 4, seed: int = 0,
    out: str | None = None, fault: str = "process", nodes: int = 2, node_cpus: float = 2.0,
) -> dict[str, Any]:
    """`fault` is one of `FAULTS`; `node` builds a cluster of `nodes` worker nodes of
    `node_cpus` CPUs each and runs both runs on it."""
    overrides = list(overrides or [])
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="flexmarl-chaos-"))
    if fault not in FAULTS:
        raise ChaosError(f"chaos: fault {fault!r} is not one of {', '.join(FAULTS)}")
    if kills < 1:  # refused up front: a clean table without a fault would prove nothing
        raise ChaosError(f"chaos: no fault was injected ({kills} faults asked for); the run "
                         "would prove nothing")
    if fault == "node":
        with ray_cluster(nodes, node_cpus) as cluster:
            return _bench(config, [*overrides, f"runtime.address={cluster.address}"], kills,
                          seed, base, fault, cluster, node_cpus)
    return _bench(config, overrides, kills, seed, base, fault, None, node_cpus)


def _bench(config: str, overrides: list[str], kills: int, seed: int, base: Path, fault: str,
           cluster: Any, node_cpus: float) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    if fault != "process" and cfg.runtime.kind != "ray":
        raise ChaosError(f"chaos: fault {fault!r} needs runtime.kind=ray "
                         f"(it is {cfg.runtime.kind!r}); add --set runtime.kind=ray")
    where = f" on {len(cluster.worker_nodes)} Ray nodes" if cluster is not None else ""
    print(f"chaos: {config} {' '.join(overrides)}; {cfg.train.iterations} iterations, "
          f"{cfg.runtime.rollout_workers} rollout + {cfg.runtime.train_workers} train workers"
          f"{where}, {kills} random {fault} faults -> {base}", flush=True)
    clean = train(cfg, base / "fault_free")
    span = float(clean.records[-1]["time_s"])
    # Faults spread over the fault-free run's training time, jittered, after a short warm-up.
    rng = random.Random(seed)
    times = sorted(span * (i + 0.5 + rng.uniform(-0.3, 0.3)) / kills for i in range(kills))
    holder: dict[str, Killer] = {}

    def on_runtime(runtime: Any) -> None:
        holder["killer"] = Killer(runtime, times, seed, fault, cluster, node_cpus)
        holder["killer"].start()

    def on_iteration(record: dict[str, Any]) -> None:
        if record["iteration"] >= cfg.train.iterations - 1:  # a fault now would test nothing
            holder["killer"].done.set()

    chaos = train(cfg, base / "chaos", on_runtime=on_runtime, on_iteration=on_iteration)
    killer = holder["killer"]
    killer.done.set()
    killer.join(timeout=120)
    if killer.error is not None:  # a killer that crashed injected nothing more: say so
        raise ChaosError(f"chaos: the fault injector failed after {killer.faults} faults: "
                         f"{type(killer.error).__name__}: {killer.error}") from killer.error
    recoveries = (chaos.faults or {}).get("recoveries", [])
    failures = (chaos.faults or {}).get("failures", [])
    rec_times = fault_recovery_times(killer.kills, chaos_telemetry(base / "chaos"))
    lost_c, dup_c = row_accounting(chaos, cfg)
    lost_f, dup_f = row_accounting(clean, cfg)
    report = {
        "fault": fault,
        "faults_injected": killer.faults,
        "workers_taken_down": len(killer.kills),
        "failures_detected": len(failures),
        "recoveries": len(recoveries),
        "faults_recovered": len(rec_times),
        "recovery_median_s": statistics.median(rec_times) if rec_times else float("nan"),
        "recovery_max_s": max(rec_times) if rec_times else float("nan"),
        "rows_lost": lost_c, "rows_duplicated": dup_c,
        "fault_free_rows_lost": lost_f, "fault_free_rows_duplicated": dup_f,
        "episodes_failed": sum(r["episodes/failed"] for r in chaos.records),
        "success_fault_free": _final_success(clean), "success_chaos": _final_success(chaos),
        "wall_fault_free_s": clean.wall_s, "wall_chaos_s": chaos.wall_s,
        "kills": [f"{k['pool']}#{k['worker']}" for k in killer.kills],
    }
    print_report(report)
    if not killer.faults:  # a clean table without a fault would claim a survival never tested
        raise ChaosError(f"chaos: no fault was injected ({kills} {fault} faults asked for, none "
                         "made: no live worker was found at the fault times); the run proves "
                         "nothing")
    return report


def fault_recovery_times(kills: list[dict[str, Any]], telemetry: list[dict[str, Any]]
                         ) -> list[float]:
    """Per fault whose every worker came back: fault -> its last worker recovered (a node
    takes several). Kills and `worker_recovered` events are matched per (pool, worker) in
    order."""
    pending: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for k in kills:
        pending.setdefault((k["pool"], k["worker"]), []).append(k)
    back: dict[int, list[float]] = {}
    for e in telemetry:
        if e.get("event") == "worker_recovered":
            queue = pending.get((e["pool"], e["worker"]))
            if queue:
                k = queue.pop(0)
                back.setdefault(k["fault"], []).append(e["time"] - k["time"])
    taken = collections.Counter(k["fault"] for k in kills)
    return [max(times) for fault, times in sorted(back.items()) if len(times) == taken[fault]]


class ChaosError(RuntimeError):
    """A chaos run that injected no fault."""


def chaos_telemetry(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def print_report(r: dict[str, Any]) -> None:
    rows = [
        (f"faults injected ({r['fault']})", f"{r['faults_injected']}  "
                                             f"(workers down: {', '.join(r['kills'])})"),
        ("failures detected", r["failures_detected"]),
        ("recoveries (workers)", r["recoveries"]),
        ("faults recovered", f"{r['faults_recovered']} of {r['faults_injected']}"),
        ("recovery time median / max", f"{r['recovery_median_s']:.2f} s / "
                                       f"{r['recovery_max_s']:.2f} s  (target < 30 s)"),
        ("rows lost", f"{r['rows_lost']}  (fault-free run: {r['fault_free_rows_lost']})"),
        ("rows trained on twice", f"{r['rows_duplicated']}  "
                                  f"(fault-free run: {r['fault_free_rows_duplicated']})"),
        ("episodes failed", r["episodes_failed"]),
        ("final success (last 5 it.)", f"chaos {r['success_chaos']:.3f} vs fault-free "
                                       f"{r['success_fault_free']:.3f}"),
        ("wall time", f"chaos {r['wall_chaos_s']:.1f} s vs fault-free "
                      f"{r['wall_fault_free_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
