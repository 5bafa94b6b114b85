"""Classic MARL on the local runtime's machinery: worker processes (`WorkerProxy`), the
training pool (`LocalTrainPool`: slot allocator, swaps, per-agent queues) and the state
interface, with network policies in place of LLMs.

- rollout workers (`marl_rollout_worker_main`): each steps its `env.num_envs` environments
  with the published version of every policy (`EnvRollout`); `MarlRolloutPool.rollout(k)`
  runs iteration k on all of them at once;
- training slots (`learner.marl_train_worker_main`): one `PolicyLearner` per policy bound to a
  slot by `LocalTrainPool`, exactly as LLM trainers are;
- weights go from a slot to every rollout worker by version (`publish`), in the state
  interface's wire form.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from flexmarl.api.runtime import (
    NullSink,
    RolloutPool,
    Runtime,
    RuntimeSink,
    Unsupported,
    WorkerError,
    WorkerLost,
)
from flexmarl.config.schema import RunConfig
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.rollout import RolloutResult
from flexmarl.marl.workers import MarlWorkerSpec, marl_rollout_worker_main
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.runtime.local.runtime import LocalTrainPool, Supervisor, WorkerProxy


class MarlRolloutPool(RolloutPool):
    """Rollout workers stepping environments; `rollout(k)` is their one batch of work.

    Each worker owns its environments, so a lost worker's iteration cannot go to another:
    with a supervisor (`wait_worker`), the worker is restarted with every policy's latest
    weights (the supervisor's `load_latest`), gets back the environment state it had at the
    start of the iteration (`env_state`, returned by its previous rollout) and rolls the
    iteration out again: the same rows, bit for bit."""

    n_workers: int

    def __init__(self, workers: list[WorkerProxy]) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        # per policy: the last (version, weights) published, what a restarted worker loads
        self.latest: dict[str, tuple[int, Any]] = {}
        # per worker: its environment state at the start of the next iteration (None: not
        # captured, `MarlWorkerSpec.capture_state` off)
        self.env_state: list[bytes | None] = [None] * len(workers)
        self._proxies = list(workers)  # the processes env_state belongs to
        # set by the runtime's supervisor: returns once rollout worker i runs again
        self.wait_worker: Callable[[int], Awaitable[None]] | None = None
        self.on_lost: Callable[[], Awaitable[None]] | None = None  # (the LLM pool's hook)
        self.redone = 0  # iterations rolled out again on a restarted worker

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        raise Unsupported("classic MARL rollout workers step environments with network "
                          "policies; they serve no token generation requests")

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        """To every live worker; a lost one loads `latest` when it is restarted."""
        self.latest[agent] = (version, weights)
        results = await asyncio.gather(
            *(w.call("load_weights", (agent, version, weights))
              for w in self.workers if w.alive), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not (isinstance(r, WorkerLost)
                                                     and self.wait_worker is not None):
                raise r

    async def capture(self) -> None:
        """Every worker's environment state now (the run's start)."""
        self.env_state = list(await asyncio.gather(*(w.call("get_state", None)
                                                     for w in self.workers)))
        self._proxies = list(self.workers)

    async def restore(self, states: list[bytes]) -> None:
        """Resume: every worker's environments as a checkpoint holds them."""
        if len(states) != len(self.workers):
            raise ValueError(f"the checkpoint holds the environments of {len(states)} rollout "
                             f"workers, runtime.rollout_workers is {len(self.workers)}")
        await asyncio.gather(*(w.call("set_state", s)
                               for w, s in zip(self.workers, states, strict=True)))
        self.env_state = list(states)
        self._proxies = list(self.workers)

    async def rollout(self, k: int) -> list[RolloutResult]:
        """Iteration k on every worker at once, in worker order."""
        return list(await asyncio.gather(*(self._rollout_on(i, k)
                                           for i in range(len(self.workers)))))

    async def _rollout_on(self, i: int, k: int) -> RolloutResult:
        while True:
            worker = self.workers[i]
            try:
                if worker is not self._proxies[i]:  # restarted: back to the iteration's start
                    state = self.env_state[i]
                    if state is None:
                        raise WorkerError(f"rollout worker {i} was restarted, but its "
                                          "environment state was not captured")
                    await worker.call("set_state", state)
                    self._proxies[i] = worker
                    self.redone += 1
                result: RolloutResult = await worker.call("rollout", k)
            except WorkerLost:
                if self.wait_worker is None:
                    raise
                await self.wait_worker(i)
                continue
            if result.state is not None:
                self.env_state[i] = result.state
                result.state = None  # held here, not by the driver's records
            return result


class MarlRuntime(Runtime):
    """`runtime.rollout_workers` environment workers and `runtime.train_workers` training
    slots (fewer slots than policies: policies time-share them and are swapped), watched by
    the local runtime's `Supervisor` unless `runtime.max_worker_restarts` is 0: a lost
    training slot is restarted and restored from the pool's journal (`restore_slot`), a lost
    rollout worker is restarted and redoes its iteration from the captured environment
    state."""

    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout],
                 sink: RuntimeSink | None = None) -> None:
        from flexmarl.marl.learner import marl_train_worker_main

        rt = cfg.runtime
        self.cfg = cfg
        self.sink: RuntimeSink = sink or NullSink()
        self.trainable = list(layouts)
        self._swap_tmp = None
        swap_dir = None
        if rt.swap_to == "disk":
            self._swap_tmp = tempfile.TemporaryDirectory(prefix="flexmarl-marl-swap-")
            swap_dir = self._swap_tmp.name
        config = cfg.model_dump(mode="json")
        supervised = rt.max_worker_restarts > 0
        capture = supervised or cfg.train.checkpoint_every is not None

        def spec(i: int) -> MarlWorkerSpec:
            return MarlWorkerSpec(config, 0, 0, list(layouts), rt.torch_threads,
                                  deterministic=False, heartbeat_s=rt.heartbeat_interval_s,
                                  swap_dir=swap_dir, layouts=layouts, index=i,
                                  capture_state=capture)

        n_train = max(1, min(rt.train_workers, len(layouts)))
        self.sizes = {"rollout": rt.rollout_workers, "train": n_train}
        self.rollout_workers: list[Any] = [
            self._worker("rollout", i, marl_rollout_worker_main, spec(i))
            for i in range(rt.rollout_workers)]
        self.train_workers: list[Any] = [
            self._worker("train", i, marl_train_worker_main, spec(i)) for i in range(n_train)]
        self.rollout: MarlRolloutPool = MarlRolloutPool(self.rollout_workers)
        self.train: LocalTrainPool = LocalTrainPool(self.train_workers)
        self.capture = capture
        self.supervisor = Supervisor(self) if supervised else None

    def _worker(self, pool: str, index: int, main: Callable[..., None],
                spec: MarlWorkerSpec) -> Any:
        """Worker `index` of `pool`: here a local process running `main`; the Ray runtime
        (`marl.ray_runtime`) hosts the same command host in an actor instead."""
        return WorkerProxy(pool, index, main, spec, self.sink)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start() for w in self.rollout_workers + self.train_workers))
            if self.capture:
                await self.rollout.capture()
            if self.supervisor is not None:
                await self.supervisor.start()  # keeps each policy's restart point
                supervisor = self.supervisor

                async def wait_rollout(i: int) -> None:
                    await supervisor.wait_worker("rollout", i)

                self.rollout.wait_worker = wait_rollout
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        await asyncio.gather(*(w.stop() for w in self.rollout_workers + self.train_workers),
                             return_exceptions=True)
        if self._swap_tmp is not None:
            self._swap_tmp.cleanup()

    def fault_counts(self) -> dict[str, Any] | None:
        if self.supervisor is None:
            return None
        return {"failures": self.supervisor.failures, "recoveries": self.supervisor.recoveries,
                "iterations_redone": self.rollout.redone}

    def placement(self) -> dict[str, Any]:
        return {
            "runtime": self.cfg.runtime.kind,
            "rollout": [{"worker": w.index, "pid": w.process.pid} for w in self.rollout_workers],
            "train": [{"worker": w.index, "pid": w.process.pid,
                       "policies": [a for a, i in self.train.binding.items() if i == w.index]}
                      for w in self.train_workers],
            "train_swaps": self.train.allocator.swaps,
            "train_swaps_in": dict(self.train.swaps_in),
        }


__all__ = ["MarlRolloutPool", "MarlRuntime", "MarlWorkerSpec", "WorkerError",
           "marl_rollout_worker_main"]
