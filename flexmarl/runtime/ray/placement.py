"""Where a runtime's workers go on a Ray cluster: the session (connect to `runtime.address`, or
start a private cluster sized for the run), one placement group per pool with one bundle per
worker (`runtime.ray.rollout_bundle` / `train_bundle`: CPUs, GPUs and custom resources, e.g. a
node role), so the pools never contend, and the launcher that starts worker i of a pool in
bundle i, also when the supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flexmarl.config.schema import RayBundle, RuntimeConfig
from flexmarl.policy.device import Placement
from flexmarl.runtime.ray.session import RayRuntimeError, RaySession
from flexmarl.runtime.ray.transport import RayLauncher

POOLS = ("rollout", "train")


def bundle_of(b: RayBundle) -> dict[str, float]:
    out = {"CPU": b.cpus, "GPU": b.gpus, **b.resources}
    return {k: v for k, v in out.items() if v > 0}


class RayPools:
    """The cluster session and the two pools' placement groups of one run."""

    def __init__(self, run_name: str, rt: RuntimeConfig, sizes: dict[str, int],
                 slot_sizes: list[int] | None = None) -> None:
        """`slot_sizes`: the ranks of each training slot; slot i's bundle is `slot_sizes[i]`
        x `train_bundle`, so its K ranks are placed together on one node."""
        self.run_name, self.rt, self.sizes = run_name, rt, sizes
        self.bundles = {"rollout": bundle_of(rt.ray.rollout_bundle),
                        "train": bundle_of(rt.ray.train_bundle)}
        self.scale = {"rollout": [1] * sizes["rollout"],
                      "train": list(slot_sizes or [1] * sizes["train"])}
        self.groups: dict[str, Any] = {}
        custom: dict[str, float] = {}
        for pool, bundle in self.bundles.items():
            for name, amount in bundle.items():
                if name not in ("CPU", "GPU"):
                    custom[name] = custom.get(name, 0.0) + amount * sum(self.scale[pool])
        cpus = rt.ray.num_cpus
        if rt.address is None and cpus is None:  # a cluster of our own: room for every bundle
            need = sum(self.bundles[p].get("CPU", 0.0) * sum(self.scale[p]) for p in POOLS)
            cpus = max(os.cpu_count() or 1, math.ceil(need))
        self.session = RaySession(rt.address, cpus, rt.ray.temp_dir, custom)

    def placement(self, pool: str) -> Placement:
        """A worker whose bundle asks for GPUs computes on them (Ray sets the actor's
        CUDA_VISIBLE_DEVICES), unless runtime.devices is cpu."""
        gpus = self.bundles[pool].get("GPU", 0.0)
        return Placement("cuda") if gpus > 0 and self.rt.devices != "cpu" else Placement()

    async def place(self) -> None:
        """Connect, then reserve both pools; a pool the cluster cannot hold fails within
        `runtime.ray.placement_timeout_s`, naming its bundle setting."""
        self.session.start()
        for pool in POOLS:
            bundles = [self.bundle(pool, i) for i in range(self.sizes[pool])]
            pg = placement_group(bundles, strategy=self.rt.ray.strategy,
                                 name=f"flexmarl-{self.run_name}-{pool}-{os.getpid()}")
            self.groups[pool] = pg
            timeout = self.rt.ray.placement_timeout_s
            if not await asyncio.to_thread(pg.wait, timeout):
                raise RayRuntimeError(
                    f"runtime.ray.{pool}_bundle: the {pool} pool's placement group "
                    f"({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f} s; "
                    f"the cluster has {ray.available_resources()} available")

    def bundle(self, pool: str, index: int) -> dict[str, float]:
        """Worker `index`'s bundle: the pool's, times its slot's ranks (training)."""
        return {k: v * self.scale[pool][index] for k, v in self.bundles[pool].items()}

    def options(self, pool: str, index: int) -> dict[str, Any]:
        """Worker `index` of `pool`: its bundle; the supervisor restarts it, not Ray."""
        bundle = self.bundle(pool, index)
        return {
            "num_cpus": bundle.get("CPU", 0.0),
            "num_gpus": bundle.get("GPU", 0.0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[pool], placement_group_bundle_index=index),
            "max_restarts": 0,
        }

    def launcher(self) -> RayLauncher:
        return RayLauncher(self.options)

    def describe(self, pool: str, workers: list[Any]) -> list[dict[str, Any]]:
        """Per worker: node, address, actor and bundle (merged into the runtime's placement)."""
        out = []
        for w in workers:
            where = getattr(w.process, "where", {}) or {}
            out.append({"node_id": where.get("node_id"), "ip": where.get("ip"),
                        "actor_id": where.get("actor_id"), "bundle": w.index,
                        "resources": self.bundle(pool, w.index),
                        "placement_group": self.groups[pool].id.hex()
                        if pool in self.groups else None})
        return out

    def release(self) -> None:
        """The placement groups, then the session (a cluster started for the run stops)."""
        if ray.is_initialized():
            for pg in self.groups.values():
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self.groups.clear()
        self.session.stop()
