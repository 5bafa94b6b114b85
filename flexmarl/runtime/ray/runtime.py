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
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

from flexmarl.api.runtime import RuntimeSink
from flexmarl.config.schema import RunConfig
from flexmarl.policy.device import Placement
from flexmarl.runtime.local.runtime import Launcher, LocalRuntime
from flexmarl.runtime.ray.placement import RayPools


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

    def _launcher(self) -> Launcher:
        return self.ray.launcher()

    def _placements(self, n_rollout: int, slot_sizes: list[int]
                    ) -> tuple[list[Placement], list[list[Placement]]]:
        """A slot of K ranks is one bundle of K x `train_bundle` (one node): rank 0 is the
        actor, its followers processes it starts there (on GPUs, each on one of the bundle's)."""
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
        try:
            await self.ray.place()
        except BaseException:
            self.ray.release()
            raise
        try:
            await super().start()
        except BaseException:
            self.ray.release()
            raise
        self._report()

    async def stop(self) -> None:
        await super().stop()
        self.ray.release()

    def placement(self) -> dict[str, Any]:
        out = super().placement()
        for pool, workers in (("rollout", self.rollout_workers), ("train", self.train_workers)):
            for entry, where in zip(out[pool], self.ray.describe(pool, workers), strict=True):
                entry.update(where)
        out["ray"] = self.ray.session.info()
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
