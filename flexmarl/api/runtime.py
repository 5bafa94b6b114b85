"""The declared interfaces the orchestrator is written against (local, Ray, sim and the
in-memory fakes of `flexmarl.testing` implement them explicitly).

Acme-style: the orchestrator only knows a rollout pool (generate, publish weights, re-plan
between iterations), a training pool (accumulate, step, states, save) and a runtime that
hosts both; where those run is the runtime's business. Everything the orchestrator and the
run driver use is declared here; a runtime with nothing to do for a hook inherits the no-op
default by subclassing the protocol, so no caller probes runtimes with `getattr`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from flexmarl.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from flexmarl.planning.planner import Plan

Weights = dict[str, np.ndarray]


class WorkerError(RuntimeError):
    """A worker reported a failure (the remote traceback is in the message)."""


class WorkerLost(WorkerError):
    """A worker process or actor is gone (killed, crashed, silent past its heartbeats): what it
    held in flight can be re-dispatched once it is restarted or to another replica."""


class SpanSink(Protocol):
    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None: ...


class RuntimeSink(SpanSink, Protocol):
    """What a runtime reports to (`telemetry.Telemetry` implements it): its workers' spans,
    fault events (a worker failed or recovered: metrics.jsonl and the trace), records such as
    its placement, and the run's folder for its log lines (None: the run writes no files)."""

    @property
    def out_dir(self) -> Path | None: ...

    def fault(self, name: str, **fields: Any) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...


class NullSink(RuntimeSink):
    """A runtime started without telemetry: everything it reports is dropped."""

    out_dir: Path | None = None

    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        pass

    def fault(self, name: str, **fields: Any) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass


class Unsupported(NotImplementedError):
    """A runtime does not provide an optional capability (e.g. trainer states in the
    simulator): the default of the optional members below."""


class RolloutPool(Protocol):
    """Generation for every agent."""

    if TYPE_CHECKING:  # read-only here: a plain attribute (declare `n_workers: int`) or a
        # property (Ray: the actors started); no class attribute, so subclasses may assign it
        @property
        def n_workers(self) -> int:
            """The number of replicas (busy fractions)."""
            ...

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult: ...

    async def publish(self, agent: str, version: int, weights: Any) -> None: ...

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any] | None:
        """Iteration k's rollout is complete (`stats`: the store's generation statistics of
        it): re-plan replicas before iteration k+1 submits anything. Returns the plan to
        record, or None when the pool does not re-plan."""
        return None

    def follow_plan(self, plan: Plan) -> None:
        """The planner's plan for the next iteration (`planning/planner.py`), after
        `end_iteration`: serve agents from the replicas it allots when it allots them
        (`plan.replica_indices()`). Default: the pool keeps its own plan."""
        return None

    async def sleep(self) -> dict[str, float]:
        """`runtime.colocate`: every replica releases its device for the trainers (KV cache
        freed, weights to host memory) until `wake`; returns `seconds`, `kv_bytes`,
        `weight_bytes`. Default: a pool that cannot release anything refuses."""
        raise Unsupported(f"{type(self).__name__}: replicas that sleep (runtime.colocate)")

    async def wake(self) -> dict[str, float]:
        """`runtime.colocate`: every replica takes its device back before a rollout."""
        raise Unsupported(f"{type(self).__name__}: replicas that sleep (runtime.colocate)")


class TrainPool(Protocol):
    """One trainer per trainable agent."""

    if TYPE_CHECKING:  # as `RolloutPool.n_workers`
        @property
        def n_workers(self) -> int:
            """The number of training workers (busy fractions)."""
            ...

    async def accumulate(self, agent: str, samples: Any) -> dict[str, float]:
        """Forward/backward on one micro-batch (`ExperienceStore.micro_batch`'s value),
        gradients accumulated until `step`."""
        ...

    async def step(self, agent: str) -> tuple[dict[str, float], Any]:
        """The optimizer step; returns its metrics and the new weights to publish."""
        ...

    async def weights(self, agent: str) -> Any: ...

    async def save(self, agent: str, directory: str) -> str: ...

    def training_slots(self) -> int | None:
        """How many training slots the agents time-share, or None when every agent has its
        own trainer (the sync pipeline then trains agents one after another so each state
        is swapped in once per iteration)."""
        return None

    def slot_counters(self) -> Mapping[str, Mapping[str, float]] | None:
        """Per agent, cumulative training-slot counters (`slot_wait_s`, ...) for the metrics,
        or None when the pool has no slots to wait for."""
        return None

    def follow_plan(self, plan: Plan) -> None:
        """The planner's plan for the next iteration: within an iteration, hand slots to
        agents in `plan.train_order` (most critical first). Default: nothing to order."""
        return None

    async def get_state(self, agent: str) -> tuple[dict, dict]:
        """The trainer's full state (weights, optimizer, meta with its `version`), for a
        checkpoint."""
        raise Unsupported(f"{type(self).__name__} does not checkpoint trainer states")

    async def set_state(self, agent: str, state: tuple[dict, dict]) -> None:
        """Restore a state `get_state` returned (resume)."""
        raise Unsupported(f"{type(self).__name__} does not restore trainer states")


class Runtime(Protocol):
    """Hosts the two pools; the run driver (`orchestrator/run.py`) starts and stops it."""

    rollout: RolloutPool
    train: TrainPool

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def placement(self) -> dict[str, Any]: ...

    def pool_devices(self) -> dict[str, list[int]]:
        """The GPU indices each pool computes on (empty on the CPU): GPU metrics."""
        return {}

    def fault_counts(self) -> dict[str, Any] | None:
        """Worker failures and recoveries so far (`{"failures": [...], "recoveries": [...]}`),
        or None when the runtime does not supervise its workers."""
        return None


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
