"""Ranks 1..K-1 of a sharded training slot on Ray: actors, not rank 0's child processes.

A slot of K ranks has a placement group of its own, K bundles of `runtime.ray.train_bundle`
packed on one node (STRICT_PACK: the ranks meet through a TCPStore on loopback, and NCCL or
gloo between them stays on the node). Rank 0 is the slot's `PipeActor` in bundle 0; when it
forms the slot (`runtime.local.slot_ranks.form_slot`) it starts rank r as a `RankActor` in
bundle r of the group it runs in, which runs the local follower main, unchanged. Rank 0's
actor owns its rank actors, so Ray ends them with it: the slot still fails and is restarted as
a whole (rank 0 exits when a rank actor ends, `SlotLeader`'s watch).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flexmarl.runtime.local.workers import slot_follower_main


class RankActor:
    """One follower rank: `run` is its main, until rank 0's `stop`."""

    def run(self, args: tuple) -> None:
        slot_follower_main(args)


class ActorRank:
    """A rank actor as `SlotLeader` sees a follower: `poll`, `wait`, `kill` of a process."""

    def __init__(self, handle: Any, done: Any) -> None:
        self.handle, self.done = handle, done

    def poll(self) -> int | None:
        """None while the rank runs; its exit code (0: its main returned) once it ended."""
        ready, _ = ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.done)
        except ray.exceptions.RayError:
            return 1
        return 0

    def wait(self, timeout: float | None = None) -> int | None:
        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("flexmarl slot rank actor", timeout or 0.0)
        code = self.poll()
        self.kill()  # its main returned: the actor gives its bundle back
        return code

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.handle, no_restart=True)


@dataclass(frozen=True)
class RayRanks:
    """`WorkerSpec.rank_launcher` on Ray: rank r in bundle r of the placement group rank 0's
    actor runs in; `options`, one rank's resources (num_cpus, num_gpus, resources)."""

    options: dict[str, Any] = field(default_factory=dict)

    def start(self, rank: int, args: tuple) -> ActorRank:
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("a sharded slot's rank 0 on Ray runs outside a placement group")
        make_remote: Any = ray.remote
        actor = make_remote(RankActor).options(
            **self.options, max_restarts=0, name=f"flexmarl-slot-rank{rank}-of-{os.getpid()}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote()
        return ActorRank(actor, actor.run.remote(args))
