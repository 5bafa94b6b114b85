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
from typing import Any

from flexmarl.marl.config import MarlRunConfig
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.rollout import RolloutResult
from flexmarl.marl.workers import MarlWorkerSpec, marl_rollout_worker_main
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.runtime.base import (
    NullSink,
    RolloutPool,
    Runtime,
    SpanSink,
    Unsupported,
    WorkerError,
)
from flexmarl.runtime.local.runtime import LocalTrainPool, WorkerProxy


class MarlRolloutPool(RolloutPool):
    """Rollout workers stepping environments; `rollout(k)` is their one batch of work."""

    n_workers: int

    def __init__(self, workers: list[WorkerProxy]) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        self.latest: dict[str, int] = {}  # per policy: the version every worker holds

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        raise Unsupported("classic MARL rollout workers step environments with network "
                          "policies; they serve no token generation requests")

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        await asyncio.gather(*(w.call("load_weights", (agent, version, weights))
                               for w in self.workers))
        self.latest[agent] = version

    async def rollout(self, k: int) -> list[RolloutResult]:
        """Iteration k on every worker at once, in worker order."""
        return list(await asyncio.gather(*(w.call("rollout", k) for w in self.workers)))


class MarlRuntime(Runtime):
    """`runtime.rollout_workers` environment workers and `runtime.train_workers` training
    slots (fewer slots than policies: policies time-share them and are swapped)."""

    def __init__(self, cfg: MarlRunConfig, layouts: dict[str, PolicyLayout],
                 sink: SpanSink | None = None) -> None:
        from flexmarl.marl.learner import marl_train_worker_main

        rt = cfg.runtime
        sink = sink or NullSink()
        self._swap_tmp = None
        swap_dir = None
        if rt.swap_to == "disk":
            self._swap_tmp = tempfile.TemporaryDirectory(prefix="flexmarl-marl-swap-")
            swap_dir = self._swap_tmp.name
        config = cfg.model_dump(mode="json")

        def spec(i: int) -> MarlWorkerSpec:
            return MarlWorkerSpec(config, 0, 0, list(layouts), rt.torch_threads,
                                  deterministic=False, swap_dir=swap_dir, layouts=layouts,
                                  index=i)

        self.rollout_workers = [WorkerProxy("rollout", i, marl_rollout_worker_main, spec(i), sink)
                                for i in range(rt.rollout_workers)]
        n_train = max(1, min(rt.train_workers, len(layouts)))
        self.train_workers = [WorkerProxy("train", i, marl_train_worker_main, spec(i), sink)
                              for i in range(n_train)]
        self.rollout: MarlRolloutPool = MarlRolloutPool(self.rollout_workers)
        self.train: LocalTrainPool = LocalTrainPool(self.train_workers)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start() for w in self.rollout_workers + self.train_workers))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.rollout_workers + self.train_workers),
                             return_exceptions=True)
        if self._swap_tmp is not None:
            self._swap_tmp.cleanup()

    def placement(self) -> dict[str, Any]:
        return {
            "rollout": [{"worker": w.index, "pid": w.process.pid} for w in self.rollout_workers],
            "train": [{"worker": w.index, "pid": w.process.pid,
                       "policies": [a for a, i in self.train.binding.items() if i == w.index]}
                      for w in self.train_workers],
            "train_swaps": self.train.allocator.swaps,
            "train_swaps_in": dict(self.train.swaps_in),
        }


__all__ = ["MarlRolloutPool", "MarlRuntime", "MarlWorkerSpec", "WorkerError",
           "marl_rollout_worker_main"]
