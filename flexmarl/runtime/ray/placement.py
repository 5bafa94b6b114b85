"""Where a runtime's workers go on a Ray cluster: the session (connect to `runtime.address`, or
start a private cluster sized for the run), one placement group per pool with one bundle per
worker (`runtime.ray.rollout_bundle` / `train_bundle`: CPUs, GPUs and custom resources, e.g. a
node role), so the pools never contend (`runtime.colocate`: one group, replica i and training
slot i sharing bundle i), and the launcher that starts worker i of a pool in bundle i, also
when the supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flexmarl.config.schema import RuntimeConfig
from flexmarl.policy.device import Placement
from flexmarl.runtime.ray.session import RayRuntimeError, RaySession
from flexmarl.runtime.ray.transport import RayLauncher

POOLS = ("rollout", "train")


def actor_resources(bundle: dict[str, float]) -> dict[str, Any]:
    """An actor's `options` asking for exactly `bundle`."""
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}}


class RayPools:
    """The cluster session and the two pools' placement groups of one run."""

    def __init__(self, run_name: str, rt: RuntimeConfig, sizes: dict[str, int],
                 slot_sizes: list[int] | None = None) -> None:
        """`slot_sizes`: the ranks of each training slot; slot i's bundle is `slot_sizes[i]`
        x `train_bundle`, so its K ranks are placed together on one node."""
        self.run_name, self.rt, self.sizes = run_name, rt, sizes
        self.bundles = rt.ray.worker_asks(rt.colocate)  # each worker's ask of its bundle
        # runtime.colocate: replica i and training slot i in bundle i of one group
        self.shared = {k: 2 * v for k, v in self.bundles["train"].items()} if rt.colocate else None
        self.scale = {"rollout": [1] * sizes["rollout"],
                      "train": list(slot_sizes or [1] * sizes["train"])}
        self.groups: dict[str, Any] = {}
        # workers in a placement group of their own: an elastic pool's beyond its first
        # `sizes[pool]` and moved ones (one bundle each), and every slot of a sharded pool
        # (K bundles, one per rank, STRICT_PACK: `ranks.py`)
        self.grown: dict[tuple[str, int], Any] = {}
        self.sharded = max(self.scale["train"], default=1) > 1
        self.avoid: set[str] = set()  # nodes being drained: no new bundle goes there
        reserved = [b for pool in POOLS for b in self.reserved(pool)]
        custom = {k: sum(b.get(k, 0.0) for b in reserved)
                  for k in {k for b in reserved for k in b} - {"CPU", "GPU"}}
        cpus = rt.ray.num_cpus
        if rt.address is None and cpus is None:  # a cluster of our own: room for every bundle
            cpus = max(os.cpu_count() or 1, math.ceil(sum(b.get("CPU", 0.0) for b in reserved)))
        self.session = RaySession(rt.address, cpus, rt.ray.temp_dir, custom)

    def reserved(self, pool: str) -> list[dict[str, float]]:
        """The bundles of `pool`'s placement group (a sharded slot's are its own group's);
        colocated: the rollout pool's group is both pools' (none of the train pool's own)."""
        if self.shared is not None:
            return [self.shared] * max(self.sizes.values()) if pool == "rollout" else []
        return [self.bundle(pool, i) for i in range(self.sizes[pool])]

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
            if pool == "train" and self.sharded:
                for i in range(self.sizes[pool]):
                    if not await self.own_group(pool, i, self.rt.ray.placement_timeout_s,
                                                 avoid=False):
                        raise RayRuntimeError(
                            f"runtime.ray.train_bundle: training slot {i}'s placement group "
                            f"({self.scale[pool][i]} x {self.bundles[pool]} on one node) was "
                            f"not placed within {self.rt.ray.placement_timeout_s:.0f} s; the "
                            f"cluster has {ray.available_resources()} available")
                continue
            bundles = self.reserved(pool)
            if not bundles:  # colocated: the slots are in the rollout pool's group
                self.groups[pool] = self.groups["rollout"]
                continue
            pg = placement_group(bundles, strategy=self.rt.ray.strategy,
                                 name=f"flexmarl-{self.run_name}-{pool}-{os.getpid()}")
            self.groups[pool] = pg
            timeout = self.rt.ray.placement_timeout_s
            if not await asyncio.to_thread(pg.wait, timeout):
                setting = "rollout_bundle / train_bundle" if self.shared else f"{pool}_bundle"
                raise RayRuntimeError(
                    f"runtime.ray.{setting}: the {pool} pool's placement group "
                    f"({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f} s; "
                    f"the cluster has {ray.available_resources()} available")

    async def start(self, runtime_start: Callable[[], Awaitable[None]]) -> None:
        """Reserve both pools, then run `runtime_start` on them; if either fails, the
        placement groups and the session are given back."""
        try:
            await self.place()
            await runtime_start()
        except BaseException:
            self.release()
            raise

    async def grow(self, pool: str, index: int, timeout: float) -> bool:
        """Reserve one more bundle for worker `index` of `pool` (its own placement group), if
        the cluster has free resources for it now; False, with nothing held, when it has not
        or the group is not placed within `timeout`."""
        free = await asyncio.to_thread(ray.available_resources)
        if any(free.get(k, 0.0) < v for k, v in self.bundle(pool, index).items()):
            return False
        return await self.own_group(pool, index, timeout)

    def _rank_bundles(self, pool: str, index: int) -> list[dict[str, float]]:
        """Worker `index`'s own group: one bundle per rank of a sharded slot, else one."""
        if pool == "train" and self.sharded:
            return [self.bundles[pool]] * self.scale[pool][index]
        return [self.bundle(pool, index)]

    async def own_group(self, pool: str, index: int, timeout: float,
                         avoid: bool = True) -> bool:
        """Worker `index` of `pool` in a placement group of its own (its ranks' bundles
        packed on one node), off the nodes in `avoid` (Ray's node-id label): its next
        (re)start goes there. False, with nothing held, when none is placed in `timeout`."""
        bundles = self._rank_bundles(pool, index)
        selector = ([{NODE_ID_LABEL_KEY: f"!in({','.join(sorted(self.avoid))})"}]
                    * len(bundles) if self.avoid and avoid else None)
        pg = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selector,
                             name=f"flexmarl-{self.run_name}-{pool}{index}-{os.getpid()}")
        if not await asyncio.to_thread(pg.wait, timeout):
            remove_placement_group(pg)
            return False
        self.shrink(pool, index)
        self.grown[(pool, index)] = pg
        return True

    def shrink(self, pool: str, index: int) -> None:
        """Give back the bundle `grow` reserved for worker `index` of `pool`."""
        pg = self.grown.pop((pool, index), None)
        if pg is not None:
            remove_placement_group(pg)

    def remove(self, pool: str, index: int) -> None:
        """Worker `index` of an elastic pool left it: its bundle is given back and the
        workers above it, now one index lower, keep theirs."""
        self.shrink(pool, index)
        for i in sorted(i for p, i in self.grown if p == pool and i > index):
            self.grown[(pool, i - 1)] = self.grown.pop((pool, i))

    def _group(self, pool: str, index: int) -> tuple[Any, int]:
        grown = self.grown.get((pool, index))
        return (grown, 0) if grown is not None else (self.groups[pool], index)

    def bundle(self, pool: str, index: int) -> dict[str, float]:
        """Worker `index`'s bundle: the pool's, times its slot's ranks (training; a replica
        an elastic pool added has one)."""
        scale = self.scale[pool]
        return {k: v * (scale[index] if index < len(scale) else 1)
                for k, v in self.bundles[pool].items()}

    def rank_options(self) -> dict[str, Any]:
        """One rank of a sharded slot: a `train_bundle` (its placement: `ranks.RayRanks`)."""
        return actor_resources(self.bundles["train"])

    def options(self, pool: str, index: int) -> dict[str, Any]:
        """Worker `index` of `pool`: its bundle (rank 0's, bundle 0, for a sharded slot);
        the supervisor restarts it, not Ray."""
        group, at = self._group(pool, index)
        return {**actor_resources(self._rank_bundles(pool, index)[0]), "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=at)}

    def launcher(self) -> RayLauncher:
        return RayLauncher(self.options)

    def annotate(self, placement: dict[str, Any], rollout_workers: Any,
                 train_workers: Any) -> dict[str, Any]:
        """A runtime's `placement()` with each worker's node and bundle, and the session."""
        for pool, workers in (("rollout", rollout_workers), ("train", train_workers)):
            for entry, where in zip(placement[pool], self.describe(pool, workers), strict=True):
                entry.update(where)
        placement["ray"] = self.session.info()
        return placement

    def describe(self, pool: str, workers: list[Any]) -> list[dict[str, Any]]:
        """Per worker: node, address, actor and bundle (merged into the runtime's placement)."""
        out = []
        for w in workers:
            where = getattr(w.process, "where", {}) or {}
            out.append({"node_id": where.get("node_id"), "ip": where.get("ip"),
                        "actor_id": where.get("actor_id"), "bundle": w.index,
                        "resources": self.bundle(pool, w.index),
                        "placement_group": self._group(pool, w.index)[0].id.hex()
                        if pool in self.groups or (pool, w.index) in self.grown else None})
        return out

    def release(self) -> None:
        """The placement groups, then the session (a cluster started for the run stops)."""
        if ray.is_initialized():
            for pg in [*self.groups.values(), *self.grown.values()]:
                with contextlib.suppress(Exception):  # already gone (colocated: the same pg)
                    remove_placement_group(pg)
        self.groups.clear()
        self.grown.clear()
        self.session.stop()
