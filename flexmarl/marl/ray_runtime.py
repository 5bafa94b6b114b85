"""Classic MARL on Ray: the local MARL runtime's workers as Ray actors, nothing else changed.

The rollout workers (`marl.workers.RolloutHost`) and the training slots (a
`training.host.TrainHost` of `marl.learner`'s learners) are the same command hosts a local
worker process serves over its pipe; here each lives in a `runtime.ray.proxy.HostActor` in its own placement-group bundle
(`runtime.ray.rollout_bundle` / `train_bundle`, one group per pool, so the pools never contend).
The pools (`MarlRolloutPool`, `LocalTrainPool`'s slot binding and swaps), the driver's
schedule, checkpoints, resume and the local `Supervisor` (heartbeats, restarts, a slot
restored from the pool's journal, a rollout worker's iteration redone from its captured
environment state) are the local runtime's, unchanged, through `ActorProxy`.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from typing import Any

from flexmarl.marl.config import MarlRunConfig
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.runtime import MarlRuntime
from flexmarl.marl.workers import MarlWorkerSpec
from flexmarl.runtime.base import RuntimeSink
from flexmarl.runtime.ray.proxy import ActorProxy, ActorTarget
from flexmarl.runtime.ray.runtime import bundle_of
from flexmarl.runtime.ray.session import RayRuntimeError, RaySession


def _rollout_host(spec: MarlWorkerSpec) -> Any:
    from flexmarl.marl.workers import RolloutHost

    return RolloutHost(spec)


def _slot_host(spec: MarlWorkerSpec) -> Any:
    from flexmarl.marl.learner import slot_host

    return slot_host(spec)


class MarlRayRuntime(MarlRuntime):
    """`MarlRuntime` with `ActorProxy` workers on a Ray cluster (`runtime.address`, or one
    started for the run with `runtime.ray.num_cpus`)."""

    def __init__(self, cfg: MarlRunConfig, layouts: dict[str, PolicyLayout],
                 sink: RuntimeSink | None = None) -> None:
        rt = cfg.runtime
        self.bundles = {"rollout": bundle_of(rt.ray.rollout_bundle),
                        "train": bundle_of(rt.ray.train_bundle)}
        self.groups: dict[str, Any] = {}
        super().__init__(cfg, layouts, sink)
        custom: dict[str, float] = {}
        for pool, bundle in self.bundles.items():
            for name, amount in bundle.items():
                if name not in ("CPU", "GPU"):
                    custom[name] = custom.get(name, 0.0) + amount * self.sizes[pool]
        cpus = rt.ray.num_cpus
        if rt.address is None and cpus is None:  # a cluster of our own: room for every bundle
            need = sum(self.bundles[p].get("CPU", 0.0) * n for p, n in self.sizes.items())
            cpus = max(os.cpu_count() or 1, math.ceil(need))
        self.session = RaySession(rt.address, cpus, rt.ray.temp_dir, custom)

    def _worker(self, pool: str, index: int, main: Callable[..., None],
                spec: MarlWorkerSpec) -> ActorProxy:
        make_host = _rollout_host if pool == "rollout" else _slot_host
        return ActorProxy(pool, index, ActorTarget(make_host, self._options(pool)), spec,
                          self.sink)

    def _options(self, pool: str) -> Callable[[int], dict[str, Any]]:
        def options(index: int) -> dict[str, Any]:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = self.bundles[pool]
            return {
                "num_cpus": bundle.get("CPU", 0.0),
                "num_gpus": bundle.get("GPU", 0.0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.groups[pool], placement_group_bundle_index=index),
                "max_restarts": 0,  # the supervisor restarts lost workers, as locally
            }

        return options

    async def _place(self, pool: str) -> None:
        import ray
        from ray.util.placement_group import placement_group

        rt = self.cfg.runtime
        bundles = [dict(self.bundles[pool]) for _ in range(self.sizes[pool])]
        pg = placement_group(bundles, strategy=rt.ray.strategy,
                             name=f"flexmarl-{self.cfg.name}-{pool}-{os.getpid()}")
        self.groups[pool] = pg
        timeout = rt.ray.placement_timeout_s
        if not await asyncio.to_thread(pg.wait, timeout):
            raise RayRuntimeError(
                f"runtime.ray.{pool}_bundle: the {pool} pool's placement group "
                f"({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f} s; "
                f"the cluster has {ray.available_resources()} available")

    async def start(self) -> None:
        self.session.start()
        try:
            await self._place("rollout")
            await self._place("train")
        except BaseException:
            await self.stop()
            raise
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        import ray

        if ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            for pg in self.groups.values():
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self.groups.clear()
        self.session.stop()

    def placement(self) -> dict[str, Any]:
        out = super().placement()
        for pool, workers in (("rollout", self.rollout_workers), ("train", self.train_workers)):
            for entry, w in zip(out[pool], workers, strict=True):
                entry.update({"node_id": w.where.get("node_id"), "ip": w.where.get("ip"),
                              "actor_id": w.where.get("actor_id"),
                              "bundle": self.bundles[pool]})
        out["ray"] = self.session.info()
        return out
