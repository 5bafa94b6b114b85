"""The online trainer as a Ray actor (`flexmarl serve-learn ... --ray [ADDRESS]`): the same
`OnlineTrainer` (trainer_process.py), fed by the same durable experience log (the server's
capture store and its claims journal) and publishing to the server over the same admin API,
hosted in its own Ray worker process instead of a process of its own.

The capture store is a SQLite file on the server's disk, so the actor is pinned to the node of
the process that starts it (a node-affinity strategy, not soft): on a cluster, run
`serve-learn --ray` on the server's node. The actor is threaded (two calls at once), so
`status` and `stop` answer while `run` trains. A trainer killed with its actor recovers as the
process does: the next one restores the snapshot and re-delivers the rows claimed after it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from flexmarl.serving.trainer_process import OnlineTrainer, TrainerConfig


class TrainerActor:
    """An `OnlineTrainer` in a Ray worker: `run` loops over its rounds until `stop`, a number
    of applied updates, or a deadline."""

    def __init__(self, run_dir: str, capture: str, agent: str, server: str,
                 cfg: TrainerConfig, snapshot_url: str | None = None,
                 api_key: str | None = None, threads: int | None = None) -> None:
        if threads:
            import torch  # the trainer imports it anyway; here only for its thread count

            torch.set_num_threads(threads)
        self.trainer = OnlineTrainer(run_dir, capture, agent, server, cfg, snapshot_url,
                                     api_key)
        self._stop = threading.Event()

    def run(self, max_applied: int | None = None, timeout_s: float | None = None
            ) -> dict[str, Any]:
        """Train until `stop()`, `max_applied` applied updates, or `timeout_s`; snapshots on
        the way out (as the process does on exit). Returns `status()`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.trainer.loop(lambda: self._stop.is_set() or (
            max_applied is not None and self.trainer.learner.applied >= max_applied) or (
            deadline is not None and time.monotonic() > deadline))
        return self.status()

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        lr = self.trainer.learner
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "agent": self.trainer.agent, "steps": lr.steps, "applied": lr.applied,
                "policy_version": lr.trainer.version,
                "pending": None if self.trainer.pending is None else self.trainer.pending[0]}


def start_trainer_actor(run_dir: str | Path, capture: str | Path, agent: str, server: str,
                        cfg: TrainerConfig, snapshot_url: str | None = None,
                        api_key: str | None = None, threads: int | None = None,
                        num_cpus: float = 1.0) -> Any:
    """Start the actor on this node of the connected Ray cluster (`ray.init` done); returns
    its handle. Paths are made absolute: the actor's working directory is Ray's."""
    here = ray.get_runtime_context().get_node_id()
    actor_cls = ray.remote(TrainerActor)
    return actor_cls.options(  # type: ignore[attr-defined]  # ray's options on a remote class
        num_cpus=num_cpus, max_concurrency=2, name=f"flexmarl-online-trainer-{agent}-{os.getpid()}",
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(str(Path(run_dir).resolve()), str(Path(capture).resolve()), agent, server, cfg,
             snapshot_url, api_key, threads)
