"""An environment run as a rollout source of the orchestrator's schedules
(`orchestrator/schedules.py`): `EnvSource` is the rollout and the trainer the schedule of
`pipeline.mode` drives, over the runtime's environment pools (`env_runtime`) and a sampler
(`samplers.py`); `marl/run.py` hosts it. Iteration k (docs/marl.md):
1. once every policy is at version k, every rollout worker steps its environments; each
   worker's results go to the sampler as it ends, in worker order (what a step is handed
   never depends on timing). A worker lost for good is a failed rollout, counted against the
   failure budget; the steps train on the other workers' rows;
2. per policy: the sampler's micro-batches of k are queued on the training pool (after the
   last worker with `SyncSchedule`, as each worker ends with `AsyncSchedule`), `step` trains
   on exactly those rows, its audit is checked, and version k+1 goes to every rollout worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.api.runtime import WorkerLost
from flexmarl.config.schema import RunConfig
from flexmarl.marl.learner import marl_train_worker_main
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.rollout import RolloutResult
from flexmarl.marl.samplers import IterationSampler
from flexmarl.marl.workers import MarlWorkerSpec, marl_rollout_worker_main
from flexmarl.orchestrator.metrics import FailureBudget
from flexmarl.runtime.local.runtime import EnvRuntime, EnvWorkers
from flexmarl.runtime.ray.runtime import RayEnvRuntime
from flexmarl.telemetry.recorder import Telemetry


@dataclass
class EnvIteration:
    """What iteration k gathered until its record."""

    episodes: list[dict[str, Any]] = field(default_factory=list)
    payload_bytes: list[int] = field(default_factory=lambda: [0, 0])  # raw, stored
    rollout_s: float = 0.0
    failed: list[str] = field(default_factory=list)  # rollout workers lost, and why
    metrics: dict[str, float] = field(default_factory=dict)  # the policies' steps
    trained: set[str] = field(default_factory=set)


class EnvSource:
    """The schedule's rollout and trainer of an environment run (module docstring)."""

    def __init__(self, cfg: RunConfig, agents: list[str], layouts: dict[str, PolicyLayout],
                 sampler: IterationSampler, budget: FailureBudget) -> None:
        self.cfg, self.agents, self.layouts = cfg, agents, layouts
        self.sampler, self.budget = sampler, budget
        self.steps_per_iteration = (cfg.environment.num_envs * cfg.runtime.rollout_workers
                                    * cfg.train.rollout_steps)
        self.runtime: Any = None  # EnvRuntime / RayEnvRuntime, once started
        self.telemetry: Telemetry | None = None
        self.step_allowed = asyncio.Event()  # cleared while a checkpoint reads the learners
        self.step_allowed.set()
        self.audit: dict[str, list[tuple[str, int, int, int]]] = defaultdict(list)
        self.published: dict[str, tuple[int, Any]] = {}  # per policy: its latest weights
        self.episodes: list[dict[str, Any]] = []  # every recorded iteration's
        self.iterations: dict[int, EnvIteration] = defaultdict(EnvIteration)
        self.recorded = -1  # the last iteration recorded: its bookkeeping is gone
        # the schedule's signals, per iteration k: ("version", k) every policy is at version
        # k; ("started", k) / ("rolled", k) its rollout began / ended; ("put", k, i) rollout
        # worker i's results are in the sampler (or it failed)
        self.signals: dict[tuple[Any, ...], asyncio.Event] = defaultdict(asyncio.Event)

    async def publish(self, policy: str, version: int, weights: Any) -> None:
        await self.runtime.rollout.publish(policy, version, weights)
        self.published[policy] = (version, weights)
        if all(v == version for v, _ in self.published.values()) and len(
                self.published) == len(self.layouts):  # rollout `version` may start
            self.signals["version", version].set()

    async def rollout_iteration(self, k: int) -> None:
        await self.signals["version", k].wait()
        it, pool = self.iterations[k], self.runtime.rollout
        t0 = time.perf_counter()
        running = [asyncio.ensure_future(pool.rollout_on(i, k)) for i in range(pool.n_workers)]
        self.signals["started", k].set()
        try:
            for i, result in enumerate(running):
                try:
                    self.put_rows(k, [await result])
                except WorkerLost as lost:  # gone for good: the supervisor could not help
                    it.failed.append(str(lost))  # names the worker and why
                    assert self.telemetry is not None
                    self.telemetry.fault("rollout_failed", iteration=k, worker=i,
                                         error=str(lost))
                self.signals["put", k, i].set()
        finally:
            for result in running:
                result.cancel()
        it.rollout_s = time.perf_counter() - t0
        if it.failed:
            first = it.failed[0]
            self.budget.count(k, len(it.failed), pool.n_workers, first, "rollout workers")
            if len(it.failed) == pool.n_workers:  # the budget is off: still nothing to train
                raise WorkerLost(f"iteration {k}: every rollout worker failed, no rows to "
                                 f"train on; first error: {first}")
        self.signals["rolled", k].set()

    def started_event(self, k: int) -> asyncio.Event:
        return self.signals["started", k]

    async def iterations_ready(self, k: int) -> None:
        if k > self.recorded:
            await self.signals["rolled", k].wait()

    def put_rows(self, k: int, results: list[RolloutResult]) -> None:
        """Iteration k's results of rollout workers, held by the sampler for step k."""
        self.sampler.put(k, results)
        it = self.iterations[k]
        for res in results:
            it.episodes += res.episodes
            it.payload_bytes[0] += res.payload_bytes[0]
            it.payload_bytes[1] += res.payload_bytes[1]

    async def train_iteration(self, policy: str, k: int) -> None:
        """Step k of `policy` in its training slot on what the sampler hands it, checked
        against the step's audit, then version k+1 to the rollout workers."""
        train = self.runtime.train
        await self.step_allowed.wait()  # a checkpoint reads the learners' states
        # each rollout worker's micro-batches as its results are in (all at once after a
        # sync rollout), then the step: queued in order, so the pool's runner holds one slot
        # lease from the last worker's micro-batches to the step
        acc = []
        for i in range(self.runtime.rollout.n_workers):
            await self.signals["put", k, i].wait()
            acc += [asyncio.ensure_future(train.accumulate(policy, samples))
                    for samples in self.sampler.batches(policy, k)]
        stepped = asyncio.ensure_future(train.step(policy))
        await asyncio.gather(*acc)
        metrics, wire = await stepped
        audit = [tuple(e) for e in json.loads(wire[0])["meta"].get("trained_on", [])]
        self.sampler.check(policy, k, audit)
        self.audit[policy] += audit
        self.sampler.release(policy, k)
        it = self.iterations[k]
        it.metrics.update(self.sampler.step_metrics(policy, metrics))
        it.trained.add(policy)
        await self.publish(policy, k + 1, wire)

    def complete(self, k: int) -> bool:
        """Iteration k is rolled out and every policy stepped on it, not yet recorded."""
        return (k > self.recorded and self.signals["rolled", k].is_set()
                and len(self.iterations[k].trained) == len(self.layouts))

    def record(self, k: int, wall_s: float) -> dict[str, Any]:
        """Iteration k's own figures (env steps, returns, the store's bytes, the steps'
        metrics), for the orchestrator's common record; its episodes join the run's, and
        its bookkeeping goes."""
        it = self.iterations.pop(k)
        for signal in [signal for signal in self.signals if signal[1] <= k]:
            del self.signals[signal]
        self.recorded = k
        n, eps = self.steps_per_iteration, it.episodes
        self.episodes.extend({"iteration": k, "env_steps": (k + 1) * n, **e} for e in eps)
        raw, stored = it.payload_bytes
        rec: dict[str, Any] = {
            "env_steps": (k + 1) * n, "rollout_s": it.rollout_s,
            "train_s": max(wall_s - it.rollout_s, 0.0),
            "rollout/env_steps_per_s": n / max(it.rollout_s, 1e-9),
            "env_steps_per_s": n / max(wall_s, 1e-9), "episodes/total": len(eps),
            "rollout/workers_failed": len(it.failed),
            "store/obs_bytes_raw": raw, "store/obs_bytes_stored": stored,
            "store/obs_bytes_saved_frac": 1 - stored / max(raw, 1),
        }
        if it.failed:
            rec["errors"] = it.failed
        rec.update(it.metrics)
        rec.update(self.sampler.record())
        if eps:
            per_agent = {a: float(np.mean([e["returns"][a] for e in eps])) for a in self.agents}
            for a, v in per_agent.items():
                rec[f"agent/{a}/return_mean"] = v
                # the common name (doctor, report, reward curves): an agent's reward per
                # episode, which for an environment agent is its episode return
                rec[f"agent/{a}/reward_mean"] = v
            rec["return_mean"] = float(np.mean(list(per_agent.values())))
            for key in eps[0]:
                if key not in ("returns", "length"):
                    rec[f"task/{key}"] = float(np.mean([e[key] for e in eps]))
        return rec


def env_runtime(cfg: RunConfig, layouts: dict[str, PolicyLayout],
                sink: Telemetry) -> EnvRuntime:
    """The runtime's pools of this run's workers: environment workers and training slots of
    network learners (`EnvRuntime`, or `RayEnvRuntime` on Ray). Each rollout returns the
    environment state it leaves when a supervisor may redo it or checkpoints may store it."""
    rt = cfg.runtime
    config = cfg.model_dump(mode="json")
    capture = rt.max_worker_restarts > 0 or cfg.train.checkpoint_every is not None

    def spec(i: int, swap_dir: str | None) -> MarlWorkerSpec:
        return MarlWorkerSpec(config, 0, 0, list(layouts), rt.torch_threads,
                              deterministic=False, heartbeat_s=rt.heartbeat_interval_s,
                              swap_dir=swap_dir, layouts=layouts, index=i,
                              capture_state=capture)

    workers = EnvWorkers(marl_rollout_worker_main, marl_train_worker_main, spec, list(layouts),
                         capture)
    return (RayEnvRuntime if rt.kind == "ray" else EnvRuntime)(cfg, workers, sink)
