"""The micro-batch training driver: an agent's ready rows of iteration k go to its trainer in
canonical micro-batches as their groups complete, then the step, then the new version.

The training half of the joint orchestrator. It owns the audit trail the consistency
contract is checked against (`consumed`, `audit`) and the skipped-step budget.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import InitVar, dataclass
from typing import Any

from flexmarl.api.runtime import TrainPool
from flexmarl.config.schema import RunConfig
from flexmarl.errors import UserError
from flexmarl.orchestrator.episodes import EpisodeRunner, IterationState
from flexmarl.orchestrator.networks import network_samples
from flexmarl.orchestrator.versions import Versions
from flexmarl.store.experience import ExperienceStore, Row, Status
from flexmarl.telemetry.recorder import Telemetry


class TrainingDiverged(UserError, RuntimeError):
    """More optimizer steps were skipped for NaN/inf than `train.max_skipped_steps` allows."""


class EpisodesFailed(RuntimeError):
    """An agent's iteration has no rows to train on: its episodes all failed."""


@dataclass(eq=False)
class MicroBatchTrainer:
    """Feeds each trainable agent's rows to the training pool, one iteration at a time.

    `step_allowed` is cleared while a checkpoint reads the trainer states: no step then."""

    cfg: RunConfig
    episodes: EpisodeRunner
    store: ExperienceStore
    train: TrainPool
    telemetry: Telemetry
    versions: Versions
    agents: InitVar[list[str]]
    trainable: list[str]
    step_allowed: asyncio.Event

    def __post_init__(self, agents: list[str]) -> None:
        self._changed: dict[str, asyncio.Event] = {}
        self.consumed: dict[str, dict[int, list[str]]] = {a: defaultdict(list) for a in agents}
        # (sample_id, policy_version, optimizer step) of every row trained on: the audit trail
        # that "each row exactly once, by the step of its own version" is checked against.
        self.audit: dict[str, list[tuple[str, int, int]]] = {a: [] for a in agents}
        # (agent, step) -> [first micro-batch queued at, rows, tokens]: trainer throughput
        self._train_work: dict[tuple[str, int], list[float]] = {}
        self.skipped_steps = 0

    def wake(self) -> None:
        """A group completed: trainers waiting for rows look again. They wait for whole
        groups, not for every store change: a wake-up per row would cost each trainer a scan
        per generated row."""
        for agent in self.trainable:
            self._changed_event(agent).set()

    def _changed_event(self, agent: str) -> asyncio.Event:
        if agent not in self._changed:
            self._changed[agent] = asyncio.Event()
        return self._changed[agent]

    async def train_iteration(self, agent: str, k: int) -> None:
        """Consume agent's rows of version k in canonical micro-batches, then step.

        A micro-batch is m complete groups (~micro_batch_size rows). In deterministic mode (and
        in sync mode, where all groups are complete anyway) micro-batch j is groups
        [j*m, (j+1)*m), so the split and the summation order of gradients never depend on
        timing and sync and async runs agree bitwise; otherwise the first m groups to complete
        go first, so training starts as early as possible.
        """
        it = self.episodes.iterations[k]
        vector = self.versions.vector(k)
        taken: set[int] = set()
        # Micro-batches are queued with the pool as they become ready, without waiting for the
        # previous one: the pool runs an agent's calls in order, and an agent that holds a
        # training slot drains what it has queued before yielding it (sticky slots).
        # The step is queued right behind the last micro-batch, so the slot does not go to
        # another agent in between.
        queued: list[asyncio.Future] = []
        try:
            await self._queue_micro_batches(agent, k, it, taken, queued)
            if self.cfg.agents[agent].network is not None and not self.consumed[agent][k]:
                # a network learner has nothing to step on: say why instead
                raise EpisodesFailed(f"agent {agent!r}: no rows in iteration {k} (every episode "
                                     f"failed; the first: {self.episodes.first_error})")
            await self.step_allowed.wait()  # a checkpoint is reading trainer states: no step
            step = asyncio.ensure_future(self.train.step(agent))
            queued.append(step)
            await asyncio.gather(*queued)
        finally:
            for fut in queued:
                if not fut.done():
                    fut.cancel()
        metrics, weights = step.result()
        # trainer throughput of the step: from its first micro-batch queued to the step done
        # (slot waits and swaps included), over its rows and tokens
        t_first, n_rows, n_tokens = self._train_work.pop((agent, k), [self.telemetry.now(), 0, 0])
        busy_s = self.telemetry.now() - t_first
        metrics = {**metrics, "train_s": busy_s,
                   "train_samples_per_s": n_rows / busy_s if busy_s > 0 else 0.0,
                   "train_tokens_per_s": n_tokens / busy_s if busy_s > 0 else 0.0}
        await self._stepped(agent, k, it, vector, metrics, weights)

    async def _queue_micro_batches(self, agent: str, k: int, it: IterationState,
                                   taken: set[int], queued: list[asyncio.Future]) -> None:
        n_inputs = self.cfg.train.inputs_per_iteration
        graph = self.episodes.graph
        nodes = [n for n in self.episodes.order if graph.nodes[n].agent == agent]
        per_group = max(1, self.cfg.train.group_size * len(nodes))
        groups_per_mb = max(1, self.cfg.train.micro_batch_size // per_group)
        changed = self._changed_event(agent)
        vector = self.versions.vector(k)
        table = self.store.table(agent)
        canonical = self.cfg.runtime.deterministic or self.cfg.pipeline.mode == "sync"
        if self.episodes.normalize(agent) in ("agent", "batch"):
            # advantages need the whole iteration's rewards: wait for them (less overlap)
            while not it.wide_ready:
                changed.clear()
                await changed.wait()
        while len(taken) < n_inputs:
            if canonical:  # fixed chunks in input order: the split never depends on timing
                start = min(set(range(n_inputs)) - taken)
                chunk = list(range(start, min(n_inputs, start + groups_per_mb)))
                while True:
                    changed.clear()
                    if all(i in it.groups_done for i in chunk):
                        break
                    await changed.wait()
            else:  # whichever groups completed first, as soon as a micro-batch is full
                while True:
                    changed.clear()
                    done = sorted(it.groups_done - taken)
                    if len(done) >= groups_per_mb or len(done) == n_inputs - len(taken):
                        chunk = done[:groups_per_mb]
                        break
                    await changed.wait()
            taken.update(chunk)
            ids = [
                sid
                for i in chunk
                for gid in it.slot_groups(i)
                for episode in it.groups[gid]
                for node, sid in sorted(episode.items())
                if node in nodes and table.get(sid).status is Status.READY
            ]
            if not ids:
                continue
            # the iteration's policy version of this agent, and the step, separately (they
            # differ in one_step_off: step k trains rows of version max(0, k-1))
            rows = self.store.take_ready(agent, vector[agent], len(ids), step=k,
                                         expected_vector=vector, sample_ids=ids)
            self.consumed[agent][k].extend(r.sample_id for r in rows)
            self.audit[agent].extend((r.sample_id, r.policy_version, k) for r in rows)
            work = self._train_work.setdefault((agent, k), [self.telemetry.now(), 0, 0])
            work[1] += len(rows)
            work[2] += sum(len(r.data.get("prompt", ())) + len(r.data.get("response", ()))
                           for r in rows if isinstance(r.data, dict))
            for fut in queued:  # a failed micro-batch fails the iteration now
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            batch = (network_samples(self.store, rows)
                     if self.cfg.agents[agent].network is not None
                     else self.store.micro_batch(agent, rows))
            queued.append(asyncio.ensure_future(self._accumulate(agent, rows, batch)))

    async def _accumulate(self, agent: str, rows: list[Row], batch: Any) -> None:
        await self.train.accumulate(agent, batch)
        self.store.release(rows)

    async def _stepped(self, agent: str, k: int, it: IterationState, vector: dict[str, int],
                       metrics: dict[str, float], weights: Any) -> None:
        reason = metrics.pop("skip_reason", None)
        if reason is not None:
            self.skipped_steps += 1
            self.telemetry.fault("step_skipped", agent=agent, iteration=k, reason=reason,
                                 skipped_total=self.skipped_steps)
            if self.skipped_steps > self.cfg.train.max_skipped_steps:
                raise TrainingDiverged(
                    f"agent {agent!r}, iteration {k}: optimizer step skipped ({reason}); "
                    f"{self.skipped_steps} skipped steps exceed train.max_skipped_steps="
                    f"{self.cfg.train.max_skipped_steps}"
                )
        elif metrics.get("skipped"):
            self.telemetry.event("step_skipped", agent=agent, iteration=k)
        it.trained[agent] = metrics
        if self.versions.staleness and k + 1 < self.cfg.train.iterations:
            # one_step_off: iteration k+1 is being generated with version k; the schedule
            # publishes k+1 once that rollout is done (`OneStepOffSchedule.publish_held`)
            self.versions.held[agent] = (k + 1, weights)
        else:
            await self.versions.publish(agent, k + 1, weights)
        self.store.evict(agent, vector[agent])
        it.train_done[agent] = self.telemetry.now()
