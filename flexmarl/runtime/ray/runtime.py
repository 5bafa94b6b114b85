"""The Ray runtime: the local runtime's workers, pools and supervisor, hosted in Ray actors.

Everything that decides what is computed and how failures are recovered is the local
runtime's (`runtime.local`): the rollout replicas (`rollout_worker_main`, one
`ReplicaScheduler`), the training slots (`train_worker_main`, one `TrainHost`), the balancer,
the `SlotPool`, the `Supervisor` (heartbeats, progress timeouts, restarts, the recovery
journal), weight publication (pipes or collective) and the driver's experience store. What
differs is where a worker runs, `runtime.ray.placement.RayPools` (the cluster, one placement
group per pool, a bundle per worker), and how its pipe travels, `runtime.ray.transport` (a
`PipeActor` per worker). Shared-base LoRA agents and `runtime.publication` therefore work on
Ray exactly as locally.

An elastic rollout pool (`runtime.rollout_workers: {min, max}`) starts with `min` replicas; as
each iteration's rollout ends the runtime asks the cluster for room for one more rollout bundle
(a node that joined) and, when there is, starts a replica there in a placement group of its
own, loads every agent's latest weights into it and adds it to the pool, whose next plan (the
balancer's and the planner's) counts it; up to `max`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Any

from flexmarl.api.runtime import RuntimeSink, load_latest
from flexmarl.config.schema import RunConfig
from flexmarl.policy.device import Placement
from flexmarl.runtime.local.runtime import (
    EnvRuntime,
    EnvWorkers,
    Launcher,
    LocalRuntime,
    WorkerProxy,
)
from flexmarl.runtime.ray.drain import draining_nodes, gcs_client, report_drained
from flexmarl.runtime.ray.placement import RayPools
from flexmarl.runtime.ray.ranks import RayRanks
from flexmarl.runtime.ray.session import RayRuntimeError


class RayRuntime(LocalRuntime):
    """`LocalRuntime` with its workers in Ray actors (`runtime.address`, or a cluster started
    for the run with `runtime.ray.num_cpus`)."""

    def __init__(
        self, cfg: RunConfig, vocab_size: int, max_seq_len: int, sink: RuntimeSink | None = None
    ) -> None:
        trainable = [a for a in cfg.agents if cfg.agents[a].trainable]
        slot_sizes = cfg.runtime.train_slot_sizes(len(trainable))
        self.ray = RayPools(cfg.name, cfg.runtime,
                            {"rollout": cfg.runtime.rollout_workers, "train": len(slot_sizes)},
                            slot_sizes)
        super().__init__(cfg, vocab_size, max_seq_len, sink)
        self._growth: asyncio.Task | None = None
        self._draining: asyncio.Task | None = None
        self._drained: set[str] = set()  # nodes whose work this run moved off
        self._gcs: Any = None
        self._stopping = False

    def _launcher(self) -> Launcher:
        return self.ray.launcher()

    def _slot_rank_launcher(self) -> Any:
        """A slot of K ranks: ranks 1..K-1 are actors in its placement group (`ranks.py`)."""
        return RayRanks(self.ray.rank_options()) if self.ray.sharded else None

    def _placements(self, n_rollout: int, slot_sizes: list[int]
                    ) -> tuple[list[Placement], list[list[Placement]]]:
        """A slot of K ranks is a placement group of K `train_bundle`s on one node: rank 0
        is the slot's actor, ranks 1..K-1 actors it starts in the other bundles."""
        train = self.ray.placement("train")
        return ([self.ray.placement("rollout")] * n_rollout,
                [[train] * k for k in slot_sizes])

    def _rendezvous_host(self) -> str:
        """On a cluster of other machines, this machine's address; on loopback, loopback."""
        address = self.cfg.runtime.address
        if address is None or address.startswith(("127.", "localhost")):
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    async def start(self) -> None:
        await self.ray.start(super().start)
        self._report()
        try:
            self._gcs = gcs_client(self.ray.session.gcs_address or "")
        except RayRuntimeError as exc:  # a Ray without the private drain API: runs, undrained
            print(f"ray: draining nodes are not watched: {exc}", file=sys.stderr, flush=True)
        self.rollout.on_iteration_end = self._between_iterations
        if self.supervisor is not None:
            self.supervisor.retire = self._retire

    def _between_iterations(self, iteration: int) -> None:
        """As an iteration's rollout ends: move work off nodes Ray drains (`flexmarl
        drain`), and grow an elastic pool by one replica if the cluster has room; each in
        the background, one at a time."""
        if self._stopping:
            return
        if self._gcs is not None and (self._draining is None or self._draining.done()):
            leaving = draining_nodes(self._gcs) - self._drained
            if leaving:
                self._draining = asyncio.ensure_future(self._drain(sorted(leaving)))
        top = self.cfg.runtime.rollout_workers_max or 0
        if len(self.rollout_workers) < top and (self._growth is None or self._growth.done()):
            self._growth = asyncio.ensure_future(self._grow(iteration))

    def _shrinkable(self, w: WorkerProxy) -> bool:
        """A replica an elastic pool grew (its index is at or above the minimum, so the pool
        stays at least `min`) that is still in the pool."""
        growing = self._growth is not None and not self._growth.done()  # (indices move)
        return (w.pool == "rollout" and not self._stopping and not growing
                and w.index >= self.cfg.runtime.rollout_workers
                and w.index < len(self.rollout_workers) and self.rollout_workers[w.index] is w)

    def _retire(self, w: WorkerProxy) -> bool:
        """The supervisor's hook for a lost worker: a replica the elastic pool grew is not
        restarted; the pool shrinks by one (toward `min`; its bundle is given back) and the
        balancer and planner plan over the replicas left. As each iteration ends the pool
        grows again where the cluster has room (its node, if it is still there)."""
        if not self._shrinkable(w):
            return False
        index = w.index
        self.rollout.remove_replica(index)
        self.placements["rollout"].pop(index)
        self.ray.remove("rollout", index)
        self.sink.fault("pool_shrunk", pool="rollout", worker=index,
                        workers=len(self.rollout_workers), reason=w.lost_reason)
        print(f"ray: rollout pool shrunk to {len(self.rollout_workers)} replicas: "
              f"rollout[{index}] lost ({w.lost_reason})", file=sys.stderr, flush=True)
        return True

    def _workers_on(self, node_id: str) -> list[WorkerProxy]:
        out = []
        for w in self.rollout_workers + self.train_workers:
            w.process.pid  # noqa: B018 - asks the actor where it runs, once
            if w.alive and (getattr(w.process, "where", None) or {}).get("node_id") == node_id:
                out.append(w)
        return out

    async def _drain(self, nodes: list[str]) -> None:
        """Each worker on a draining node: a bundle elsewhere, then restarted there by the
        supervisor (restored as after a crash); reported to `flexmarl drain`."""
        timeout = self.cfg.runtime.ray.placement_timeout_s
        self.ray.avoid.update(nodes)
        for node in nodes:
            self._drained.add(node)
            moved: list[dict[str, Any]] = []
            failed: list[str] = []
            for w in self._workers_on(node):
                name = f"{w.pool}[{w.index}]"
                retire = self.supervisor is not None and self._shrinkable(w)
                if self.supervisor is None:
                    failed.append(f"{name}: runtime.max_worker_restarts=0, nothing restarts it")
                    continue
                if not retire and not await self.ray.own_group(w.pool, w.index, timeout):
                    failed.append(f"{name}: no room elsewhere within {timeout:.0f} s")
                    continue
                w.kill(f"drained: node {node[:12]} is leaving (flexmarl drain)")
                while w.alive:  # until its death is seen: the pool shrinks (`_retire`), or
                    await asyncio.sleep(0.05)  # its restart is under way
                if retire:
                    moved.append({"worker": name, "to_node": None, "retired": True})
                    continue
                await self.supervisor.wait_worker(w.pool, w.index)
                pool = self.rollout_workers if w.pool == "rollout" else self.train_workers
                pid = pool[w.index].process.pid  # (asks the actor where it runs)
                to = self.ray.describe(w.pool, [pool[w.index]])[0]
                moved.append({"worker": name, "to_node": to["node_id"], "pid": pid})
            self.sink.fault("node_drained", node_id=node, moved=moved, failed=failed)
            names = ", ".join(m["worker"] for m in moved) or "nothing"
            print(f"ray: node {node[:12]} drained: moved {names}"
                  + (f"; could not move {'; '.join(failed)}" if failed else ""),
                  file=sys.stderr, flush=True)
            report_drained(self._gcs, node, f"{self.cfg.name}-{os.getpid()}", moved, failed)

    async def _grow(self, iteration: int) -> None:
        index = len(self.rollout_workers)
        if not await self.ray.grow("rollout", index, self.cfg.runtime.ray.placement_timeout_s):
            return
        like = self.rollout_workers[0]
        replica = WorkerProxy("rollout", index, like.target, like.spec, self.sink,
                              like.launcher)
        replica.memory_hint = like.memory_hint
        self.placements["rollout"].append(self.ray.placement("rollout"))  # publication's
        try:
            await replica.start()
            await load_latest(self.rollout.latest,
                              lambda a, v, w: self.rollout.load_into(replica, a, v, w))
        except Exception as exc:  # noqa: BLE001 - the pool goes on without it; said in events
            await replica.stop(timeout=1)
            self.placements["rollout"].pop()
            self.ray.shrink("rollout", index)
            self.sink.fault("pool_grow_failed", pool="rollout", worker=index,
                            reason=f"{type(exc).__name__}: {exc}")
            return
        if self._stopping:
            await replica.stop(timeout=1)
            return
        if self.supervisor is not None:
            self.supervisor.adopt(replica)
        self.rollout.add_replica(replica)
        pid = replica.process.pid  # (asks the actor where it runs)
        where = self.ray.describe("rollout", [replica])[0]
        self.sink.fault("pool_grown", pool="rollout", worker=index, after_iteration=iteration,
                        node_id=where["node_id"], pid=pid,
                        workers=len(self.rollout_workers))
        print(f"ray: rollout pool grown to {len(self.rollout_workers)} replicas: "
              f"rollout[{index}] on node {str(where['node_id'])[:12]} ({where['ip']}) "
              f"after iteration {iteration}", file=sys.stderr, flush=True)

    async def stop(self) -> None:
        self._stopping = True
        busy = [t for t in (self._growth, self._draining) if t is not None and not t.done()]
        if busy:
            await asyncio.wait(busy, timeout=60)
        await super().stop()
        self.ray.release()

    def placement(self) -> dict[str, Any]:
        out = self.ray.annotate(super().placement(), self.rollout_workers,
                                self.train_workers)
        out["endpoints"] = {a: b.url for a, b in self.rollout.remote.items()}
        return out

    def _report(self) -> None:
        """Which actor runs where: stderr (the run log), metrics.jsonl and the run's run.log."""
        placement = self.placement()
        ray_info = placement["ray"]
        lines = [f"ray: cluster {ray_info['address']} "
                 f"({'started for this run' if ray_info['started_cluster'] else 'existing'})"]
        for pool in ("rollout", "train"):
            for w in placement[pool]:
                agents = f" agents={','.join(w['agents'])}" if w.get("agents") else ""
                lines.append(f"ray: {pool}[{w['worker']}] actor {str(w['actor_id'])[:12]} on "
                             f"node {str(w['node_id'])[:12]} ({w['ip']}) pid {w['pid']} "
                             f"bundle {w['bundle']}{agents}")
        for agent, url in placement["endpoints"].items():
            lines.append(f"ray: agent {agent} served by the endpoint {url} (called by the driver)")
        print("\n".join(lines), file=sys.stderr, flush=True)
        self.sink.log({"event": "placement", "runtime": "ray", **placement})
        if self.sink.out_dir is not None:
            with (Path(self.sink.out_dir) / "run.log").open("a") as fh:
                fh.write("\n".join(lines) + "\n")


class RayEnvRuntime(EnvRuntime):
    """`EnvRuntime` (an environment run's workers) in Ray actors, as `RayRuntime` is
    `LocalRuntime`'s: one placement group per pool, the pipes carried by `PipeActor`s; the
    pools, slot binding and swaps, checkpoints, resume and the local `Supervisor` unchanged."""

    def __init__(self, cfg: RunConfig, workers: EnvWorkers,
                 sink: RuntimeSink | None = None) -> None:
        n_train = max(1, min(cfg.runtime.train_workers, len(workers.policies)))
        self.ray = RayPools(cfg.name, cfg.runtime,
                            {"rollout": cfg.runtime.rollout_workers, "train": n_train})
        super().__init__(cfg, workers, sink)

    def _launcher(self) -> Launcher:
        return self.ray.launcher()

    async def start(self) -> None:
        await self.ray.start(super().start)

    async def stop(self) -> None:
        await super().stop()
        self.ray.release()

    def placement(self) -> dict[str, Any]:
        return self.ray.annotate(super().placement(), self.rollout_workers, self.train_workers)
