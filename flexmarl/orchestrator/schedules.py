"""One schedule per pipeline mode (docs/pipelines.md): the order in which iterations' rollouts
and agents' training run. The consistency contract does not depend on the schedule: the
version gates (`versions.py`) and the store enforce it; a schedule only decides overlap.

- `SyncSchedule` (`sync`): roll out iteration k completely, then train every agent on it,
  then publish;
- `AsyncSchedule` (`async`): iteration k+1's rollout starts once k's is complete; each agent's
  trainer consumes its micro-batches of k as they appear, steps, publishes, and goes on to k+1;
- `OneStepOffSchedule` (`one_step_off`, `Versions.staleness` = 1): async's, except that the
  version step k made is held and published once iteration k+1 (generated with version k) is
  rolled out, while step k+1 trains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from flexmarl.api.runtime import RolloutPool, TrainPool
from flexmarl.orchestrator.versions import Versions


class IterationRollout(Protocol):
    """What `SyncSchedule` needs of a rollout: `EpisodeRunner`, or the classic MARL driver."""

    async def rollout_iteration(self, k: int) -> Any: ...


class PipelinedRollout(IterationRollout, Protocol):
    """What `AsyncSchedule` needs besides: when iteration k's rollout has started (its rows
    may appear) and when it is complete."""

    def started_event(self, k: int) -> asyncio.Event: ...

    async def iterations_ready(self, k: int) -> None: ...


class IterationTrainer(Protocol):
    """What `SyncSchedule` needs of training: `MicroBatchTrainer`, or the classic MARL
    driver (which steps a network policy in its training slot)."""

    async def train_iteration(self, agent: str, k: int) -> Any: ...


class Schedule(Protocol):
    async def drive(self, first: int, iterations: int) -> None:
        """Run iterations [first, iterations); `finish(k)` is called once k is rolled out and
        every trainable agent stepped on it."""
        ...


@dataclass
class SyncSchedule(Schedule):
    """`colocated` (`runtime.colocate`): the rollout pool whose replicas share the trainers'
    devices: they sleep once iteration k is rolled out (weights and KV cache released while
    training runs; the new versions load into their host copies) and wake before iteration
    k+1's rollout; `record(k, stats)` gets what each sleep and wake took. `one_at_a_time`
    (`pipeline.train_agents`): agents train one after another even with a slot each."""

    episodes: IterationRollout
    trainer: IterationTrainer
    train: TrainPool
    trainable: list[str]
    finish: Callable[[int], None]
    colocated: RolloutPool | None = None
    record: Callable[[int, dict[str, float]], None] | None = None
    one_at_a_time: bool = False

    async def _switch(self, command: str, figures: dict[str, float]) -> None:
        assert self.colocated is not None
        stats = await (self.colocated.sleep() if command == "sleep" else self.colocated.wake())
        figures.update({f"pool/rollout/{command}_s": stats["seconds"],
                        f"pool/rollout/{command}_kv_bytes": stats["kv_bytes"],
                        f"pool/rollout/{command}_weight_bytes": stats["weight_bytes"]})
        # anything else the pool counted (a time-shared pool: its turns' switches)
        figures.update({f"pool/rollout/{key}": value for key, value in stats.items()
                        if key not in ("seconds", "kv_bytes", "weight_bytes")})

    async def drive(self, first: int, iterations: int) -> None:
        # Time-shared training slots (fewer than agents): train agent after agent, so each
        # state is swapped in once per iteration instead of on every micro-batch.
        slots = self.train.training_slots()
        one_by_one = self.one_at_a_time or (slots is not None and slots < len(self.trainable))
        for k in range(first, iterations):
            figures: dict[str, float] = {}
            if self.colocated is not None and k > first:
                await self._switch("wake", figures)  # asleep since iteration k-1's training
            await self.episodes.rollout_iteration(k)
            if self.colocated is not None:
                await self._switch("sleep", figures)
                if self.record is not None:
                    self.record(k, figures)
            if one_by_one:
                for a in self.trainable:
                    await self.trainer.train_iteration(a, k)
            else:
                await asyncio.gather(*(self.trainer.train_iteration(a, k)
                                       for a in self.trainable))
            self.finish(k)


@dataclass
class AsyncSchedule(Schedule):
    """`maybe_finish(k)` records iteration k if it is complete and not yet recorded.
    `versions`: one_step_off's held versions (None: an environment run, whose rollout of k+1
    waits for every policy's version k+1 itself)."""

    episodes: PipelinedRollout
    trainer: IterationTrainer
    versions: Versions | None
    trainable: list[str]
    maybe_finish: Callable[[int], None]

    async def drive(self, first: int, iterations: int) -> None:
        await asyncio.gather(self._rollouts(first, iterations),
                             self._trainers(first, iterations))

    async def _rollouts(self, first: int, iterations: int) -> None:
        pending: list[asyncio.Task] = []
        for k in range(first, iterations):
            task = asyncio.ensure_future(self.episodes.rollout_iteration(k))
            pending.append(task)
            # Iteration k+1 only needs k's rollout to be complete: every agent's version k+1
            # depends on all of k's rows, so starting earlier could not run anything sooner.
            # (one_step_off: k+1 needs version k only, but one iteration in flight beyond the
            # one in training is the mode's bound on staleness and on the store.)
            ready = asyncio.ensure_future(self.episodes.iterations_ready(k))
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled():
                failed = task.exception()
                if failed is not None:
                    ready.cancel()  # the rollout failed (e.g. bad task input): fail the run
                    raise failed
            await ready
        await asyncio.gather(*pending)

    async def _trainers(self, first: int, iterations: int) -> None:
        async def trainer(agent: str) -> None:
            for k in range(first, iterations):
                await self.episodes.started_event(k).wait()
                await self.train_iteration(agent, k)
                self.maybe_finish(k)

        await asyncio.gather(*(trainer(a) for a in self.trainable))
        for k in range(first, iterations):
            # nothing trained (every agent frozen): an iteration is done with its rollout
            await self.episodes.iterations_ready(k)
            self.maybe_finish(k)

    async def train_iteration(self, agent: str, k: int) -> None:
        await self.trainer.train_iteration(agent, k)


class OneStepOffSchedule(AsyncSchedule):
    async def train_iteration(self, agent: str, k: int) -> None:
        assert self.versions is not None
        held = self.versions.held.pop(agent, None)
        if held is None:
            await self.trainer.train_iteration(agent, k)
        else:  # version k goes out after k's rollout, while step k trains
            await asyncio.gather(self.trainer.train_iteration(agent, k),
                                 self.publish_held(agent, *held))

    async def publish_held(self, agent: str, version: int, weights: Any) -> None:
        """Publish the version the last step made once the iteration generated with its
        predecessor (iteration `version`) is rolled out."""
        await self.episodes.iterations_ready(version)
        assert self.versions is not None
        await self.versions.publish(agent, version, weights)


def schedule_for(mode: str, episodes: PipelinedRollout, trainer: IterationTrainer,
                 versions: Versions | None, train: TrainPool, trainable: list[str],
                 finish: Callable[[int], None],
                 maybe_finish: Callable[[int], None], *,
                 colocated: RolloutPool | None = None,
                 record: Callable[[int, dict[str, float]], None] | None = None,
                 one_at_a_time: bool = False) -> Schedule:
    """The schedule of `pipeline.mode` (`colocated`, `one_at_a_time`: sync only, see
    `SyncSchedule`; the config refuses them with the other modes)."""
    if mode == "sync":
        return SyncSchedule(episodes, trainer, train, trainable, finish, colocated, record,
                            one_at_a_time)
    if mode == "one_step_off":
        return OneStepOffSchedule(episodes, trainer, versions, trainable, maybe_finish)
    return AsyncSchedule(episodes, trainer, versions, trainable, maybe_finish)
