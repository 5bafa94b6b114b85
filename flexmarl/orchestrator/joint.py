"""The joint orchestrator: episodes along the graph, micro-batch pipeline, version gates.

Written once against `RolloutPool` / `TrainPool` (api/runtime.py) and the running asyncio
loop's clock, so it runs unchanged on the local, Ray and simulated runtimes and on the
in-memory fakes of `flexmarl.testing`. It composes parts that each do one thing:
- `episodes.EpisodeRunner`: each iteration's episodes along the graph, credit, advantages;
- `training.MicroBatchTrainer`: micro-batches to the trainers, steps, the audit trail;
- `versions.Versions`: version vectors, gates, weight publication;
- `schedules`: one schedule per pipeline mode (sync, async, one_step_off: the overlap of
  rollout and training);
- `checkpointing.CheckpointCoordinator`: checkpoints at boundaries, resume, stop requests;
- `metrics.IterationMetrics` / `metrics.FailureBudget`: iteration records, the failure budget.

Pipelines (docs/design.md section 5):
- `sync`: roll out iteration k completely, then train every agent on it, then publish;
- `async`: agent a's trainer consumes a's ready micro-batches of iteration k as they appear
  (accumulating gradients), steps when k's rows are all in, publishes version k+1; a's nodes of
  iteration k+1 start as soon as their inputs and a's version k+1 exist;
- `one_step_off`: one-step off-policy async (verl's / AReaL's, applied per agent): iteration k
  is generated with every trainable agent at version max(0, k-1), so iteration k+1's rollout
  (version k) overlaps step k. The driver is async's: k+1's rollout starts once k's is done,
  trainers consume k's micro-batches as they appear; step k publishes version k+1 to the
  replicas only once iteration k+1's rollout is done (a replica serves one version per agent),
  which is when iteration k+2 needs it. The trainers accept rows one version older than
  themselves (`pipeline.max_staleness` = 1); the loss's ratio against the recorded behaviour
  log-probs is the off-policy correction. Checkpoints are not supported in this mode.
All obey the consistency contract: agent a's step k trains on exactly the rows of iteration k,
each once, generated with a's entry of iteration k's version vector (k on-policy, max(0, k-1)
one step off), in episodes whose version vector is iteration k's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from flexmarl.api.runtime import RolloutPool, TrainPool
from flexmarl.config.schema import RunConfig
from flexmarl.graph.task import Task
from flexmarl.orchestrator.checkpointing import (
    CheckpointCoordinator,
    RunInterrupted,
    SaveCheckpoint,
)
from flexmarl.orchestrator.episodes import (
    EpisodeFailure,
    EpisodeRunner,
    IterationState,
    assign_credit,
)
from flexmarl.orchestrator.metrics import FailureBudget, FailureBudgetExceeded, IterationMetrics
from flexmarl.orchestrator.networks import NetworkActors, NetworkRollout, network_agents
from flexmarl.orchestrator.schedules import schedule_for
from flexmarl.orchestrator.training import MicroBatchTrainer, TrainingDiverged
from flexmarl.orchestrator.versions import Versions
from flexmarl.planning.demand import MeasuredDemand
from flexmarl.planning.planner import Planner, Policy, Resources
from flexmarl.store.experience import ExperienceStore
from flexmarl.telemetry.recorder import Telemetry

__all__ = [
    "EpisodeFailure", "FailureBudgetExceeded", "IterationState", "JointOrchestrator",
    "RunInterrupted", "SaveCheckpoint", "TrainingDiverged", "assign_credit",
]


class JointOrchestrator:
    """One training run's pipeline: wires the parts above to the runtime's pools and store,
    publishes the initial versions, runs the schedule of `pipeline.mode`, and records each
    finished iteration."""

    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        rollout: RolloutPool,
        train: TrainPool,
        telemetry: Telemetry,
        on_iteration: Callable[[dict[str, Any]], None] | None = None,
        save_checkpoint: SaveCheckpoint | None = None,
        resume: Any = None,
    ) -> None:
        """`save_checkpoint` writes a generation every `train.checkpoint_every` iterations and
        on `request_stop`; `resume` (a checkpoint.Checkpoint) continues a run where it left."""
        self.cfg = cfg
        self.task = task
        # hybrid graphs: network agents act in the episodes, LLM agents on the replicas
        self.networks = NetworkActors(cfg) if network_agents(cfg) else None
        if self.networks is not None:
            rollout = NetworkRollout(rollout, self.networks)
        self.rollout = rollout
        self.train = train
        self.telemetry = telemetry
        self.on_iteration = on_iteration
        self.agents = list(cfg.agents)
        self.trainable = [a for a in self.agents if cfg.agents[a].trainable]
        # the driver's store, on every runtime: workers get rows through the pools' calls
        self.store = ExperienceStore(self.agents)
        # one_step_off: how many versions the rollout lags training
        self.staleness = cfg.pipeline.max_staleness
        self.version_book = Versions(self.agents, self.trainable, self.staleness, rollout)
        self.versions = self.version_book.current
        self.records: list[dict[str, Any]] = []
        self.episodes = EpisodeRunner(cfg, task, self.store, rollout, telemetry,
                                      self.version_book, self.trainable,
                                      on_group_ready=lambda: self.trainer.wake(),
                                      networks=self.networks)
        self.trainer = MicroBatchTrainer(cfg, self.episodes, self.store, train, telemetry,
                                         self.version_book, self.agents, self.trainable,
                                         step_allowed=asyncio.Event())
        self.consumed = self.trainer.consumed
        self.audit = self.trainer.audit
        self.metrics = IterationMetrics(telemetry, rollout, train, self.agents, self.trainable,
                                        self.versions, self.consumed)
        # more per-iteration metrics (GPU utilisation and memory): each called once per record
        self.metric_sources = self.metrics.sources
        self.budget = FailureBudget(cfg, telemetry)
        self.checkpoints = CheckpointCoordinator(
            cfg, telemetry, self.trainer, self.records, self.agents, save_checkpoint, resume)
        # Between iterations the planner (planning/planner.py) plans from what was measured
        # (node latencies, training seconds): the training order along the critical path and,
        # with more replicas than agents, the replicas per agent; the pools follow it. The
        # simulator's runtime hosts the same planner with its cost-model demand (sim/runtime).
        self.planner: Planner | None = None
        if cfg.runtime.kind != "sim":
            graph = self.episodes.graph
            self.plan_nodes = [(n, graph.nodes[n].agent, list(graph.nodes[n].inputs))
                               for n in self.episodes.order]
            self.served = [a for a in self.agents if cfg.agents[a].backend.kind != "openai"
                           and cfg.agents[a].network is None]
            self.planner = Planner(cfg.pipeline.mode, Policy(balance=cfg.rollout.balance))
            self._train_seen: dict[str, dict[str, float]] = {}
            self.episodes.plan_next = self._plan_next
        self.schedule = schedule_for(
            cfg.pipeline.mode, self.episodes, self.trainer, self.version_book, train,
            self.trainable, self._finish_iteration, self._maybe_finish,
            colocated=rollout if cfg.runtime.colocate else None,
            record=lambda k, stats: self.episodes.iterations[k].pool_stats.update(stats),
            one_at_a_time=cfg.pipeline.train_agents == "one_at_a_time")
        self._last_done = 0.0
        self._start = 0.0

    def vector(self, iteration: int) -> dict[str, int]:
        return self.version_book.vector(iteration)

    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: checkpoint at the next iteration boundary, then stop. A second
        request stops at once, without a checkpoint."""
        self.checkpoints.request_stop()

    # --- the run ------------------------------------------------------------------------------
    async def run(self) -> list[dict[str, Any]]:
        self._start = self._last_done = self.telemetry.now()
        if self.records:  # resumed: time keeps counting from where the run stopped
            self._start -= float(self.records[-1].get("time_s", 0.0))
        await self.checkpoints.restore_trainers(self.trainable, self.checkpoints.resume)
        # Version 0 (or the resumed version) comes from the trainers, so rollout and training
        # start from the same weights.
        for agent in self.trainable:
            await self.rollout.publish(agent, self.versions[agent],
                                       await self.train.weights(agent))
        await self.checkpoints.run_until_stop(
            self.schedule.drive(self.episodes.start_iteration, self.cfg.train.iterations),
            lambda: len(self.records))
        return self.records

    def _plan_next(self, it: IterationState) -> dict[str, Any] | None:
        """Iteration k's rollout is done: plan k+1 from its node latencies and the training
        seconds measured since the last plan, within the workers the runtime was given; both
        pools follow the plan (placement and order only, never what is computed)."""
        assert self.planner is not None
        share = it.plan.get("share") if isinstance(it.plan, dict) else None
        train_s, calls, swap_s = self._training_measured()
        demand = MeasuredDemand(self.cfg.name, self.plan_nodes, self.served, self.trainable,
                                it.node_latency, share, train_s, calls, swap_s)
        n_replicas = self.rollout.n_workers  # (Ray: the actors started)
        n_slots = self.train.training_slots() or max(1, len(self.trainable))
        sizes = getattr(self.train, "slot_sizes", None)
        plan = self.planner.plan(demand, Resources(n_replicas + n_slots, n_replicas, n_slots,
                                                   tuple(sizes) if sizes else None),
                                 it.index + 1)
        self.rollout.follow_plan(plan)
        self.train.follow_plan(plan)
        return plan.to_dict()

    def _training_measured(self) -> tuple[dict[str, float], dict[str, float],
                                          dict[str, float]]:
        """Per agent, since the last plan: seconds its training calls took on a slot and
        the calls; and its mean seconds per swap so far (the pool's `slot_counters`)."""
        now = {a: dict(v) for a, v in (self.train.slot_counters() or {}).items()}
        train_s: dict[str, float] = {}
        calls: dict[str, float] = {}
        swap_s: dict[str, float] = {}
        for agent, c in now.items():
            before = self._train_seen.get(agent, {})
            train_s[agent] = c.get("train_s", 0.0) - before.get("train_s", 0.0)
            calls[agent] = c.get("calls", 0.0) - before.get("calls", 0.0)
            if c.get("swaps"):
                swap_s[agent] = c.get("swap_s", 0.0) / c["swaps"]
        self._train_seen = now
        return train_s, calls, swap_s

    def _maybe_finish(self, k: int) -> None:
        it = self.episodes.iterations[k]
        if it.rollout_done.is_set() and all(a in it.train_done for a in self.trainable):
            if not any(r["iteration"] == k for r in self.records):
                self._finish_iteration(k)

    def _finish_iteration(self, k: int) -> None:
        """Iteration k is rolled out and trained: its record, the failure budget, and the
        checkpoint of its boundary when one is due."""
        it = self.episodes.iterations[k]
        now = self.telemetry.now()
        t0 = self._last_done
        self._last_done = now
        record = self.metrics.record(it, t0, now, self._start)
        self.records.append(record)
        self.telemetry.log(record)
        self.telemetry.samples(it.samples)
        if self.on_iteration is not None:
            self.on_iteration(record)
        self.budget.check(it, self.episodes.first_error)
        if self.checkpoints.due(k):
            self.checkpoints.capture(k, self.trainable)
        for agent in self.agents:  # a frozen agent's rows: no step will take them
            if agent not in self.trainable:
                self.store.discard(agent, k)

