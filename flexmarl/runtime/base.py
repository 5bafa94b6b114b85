"""The small interfaces the orchestrator is written against (local, Ray and sim implement them).

Acme-style: the orchestrator only knows a rollout pool (generate, publish weights) and a
training pool (accumulate, step, save); where those run is the runtime's business.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import numpy as np

from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.training.trainer import Sample

Weights = dict[str, np.ndarray]


class WorkerError(RuntimeError):
    """A worker reported a failure (the remote traceback is in the message)."""


class WorkerLost(WorkerError):
    """A worker process or actor is gone (killed, crashed, silent past its heartbeats): what it
    held in flight can be re-dispatched once it is restarted or to another replica."""


class SpanSink(Protocol):
    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None: ...


class RolloutPool(Protocol):
    n_workers: int

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult: ...

    async def publish(self, agent: str, version: int, weights: Weights) -> None: ...


class TrainPool(Protocol):
    n_workers: int

    async def accumulate(self, agent: str, samples: list[Sample]) -> dict[str, float]: ...

    async def step(self, agent: str) -> tuple[dict[str, float], Weights]: ...

    async def weights(self, agent: str) -> Weights: ...

    async def save(self, agent: str, directory: str) -> str: ...


class Runtime(Protocol):
    rollout: RolloutPool
    train: TrainPool

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def placement(self) -> dict[str, Any]: ...


async def load_latest(latest: Mapping[str, tuple[int, Any]],
                      load: Callable[[str, int, Any], Awaitable[None]]) -> None:
    """Load every agent's latest (version, weights) into a restarted replica, again for any
    agent that published a newer version meanwhile, until it holds the newest of all."""
    loaded: dict[str, int] = {}
    while True:
        todo = {a: vw for a, vw in latest.items() if loaded.get(a) != vw[0]}
        if not todo:
            return
        for agent, (version, weights) in todo.items():
            await load(agent, version, weights)
            loaded[agent] = version
