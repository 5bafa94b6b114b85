"""Classic MARL on Ray: the local MARL runtime's workers in Ray actors, nothing else changed.

The rollout workers and training slots are the same worker mains a local process runs, in
`PipeActor`s placed by `runtime.ray.placement.RayPools` (one placement group per pool) with
their pipes carried by `runtime.ray.transport`, exactly as the LLM runtime's workers: the
pools, the driver's schedule, checkpoints, resume and the local `Supervisor` are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flexmarl.api.runtime import RuntimeSink
from flexmarl.config.schema import RunConfig
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.runtime import MarlRuntime
from flexmarl.marl.workers import MarlWorkerSpec
from flexmarl.runtime.local.runtime import WorkerProxy
from flexmarl.runtime.ray.placement import RayPools


class MarlRayRuntime(MarlRuntime):
    """`MarlRuntime` on a Ray cluster (`runtime.address`, or one started for the run)."""

    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout],
                 sink: RuntimeSink | None = None) -> None:
        n_train = max(1, min(cfg.runtime.train_workers, len(layouts)))
        self.ray = RayPools(cfg.name, cfg.runtime,  # type: ignore[arg-type]
                            {"rollout": cfg.runtime.rollout_workers, "train": n_train})
        super().__init__(cfg, layouts, sink)

    def _worker(self, pool: str, index: int, main: Callable[..., None],
                spec: MarlWorkerSpec) -> Any:
        return WorkerProxy(pool, index, main, spec, self.sink, self.ray.launcher())

    async def start(self) -> None:
        try:
            await self.ray.place()
            await super().start()
        except BaseException:
            self.ray.release()
            raise

    async def stop(self) -> None:
        await super().stop()
        self.ray.release()

    def placement(self) -> dict[str, Any]:
        out = self.ray.annotate(super().placement(), self.rollout_workers,
                                self.train_workers)
        return out
