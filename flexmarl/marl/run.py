"""The classic MARL driver: a thin schedule over the runtime's environment pools
(`runtime.local.runtime.EnvRuntime`, `runtime.ray.runtime.RayEnvRuntime`) and a sampler
(`samplers.py`): MAPPO / IPPO's rows in the experience store, or VDN / QMIX's transitions for
the replay learner's table; the one thing on- and off-policy runs differ in besides their
rollout and learner.

Iteration k, with the orchestrator's schedule of `pipeline.mode` (docs/design.md section 5),
this driver being its rollout and its trainer:
1. rollout: once every policy is at version k, every rollout worker process steps its
   `num_envs` environments for `rollout_steps` steps with version k of every policy (one
   forward pass per policy covers its environments and agents) and sends back one row
   payload per (agent, environment);
2. each worker's rows go into the agent's table of the `ExperienceStore` as it ends, in
   worker order: sample_id `{k}-{env}_{agent index}_0`, policy_version k, the version
   vector, the arrays by reference; ready once the chain's rewards are in;
3. per policy (MAPPO / IPPO; VDN / QMIX: `ReplayTransitions`): its agents' ready rows of
   version k are taken for step k (the store checks the iteration, the version and the
   vector and hands each row out once) and queued on the training pool (`accumulate`, one
   micro-batch per agent and rollout worker: after the last worker with `SyncSchedule`, as
   each worker ends with `AsyncSchedule`); `step` runs `epochs` x `minibatches` PPO steps on
   exactly those rows, in one order, in the policy's training slot and returns the new
   weights with the audit of the rows each epoch used; the driver checks the audit,
   releases and evicts the rows and publishes version k+1 to every rollout worker.

No overlap of iteration k+1's rollout with step k: MAPPO/IPPO are on-policy with one version
per iteration, and every policy acts in every environment step, so rollout k+1 needs every
policy's step k; running it on version k would make it one step off-policy (the LLM path's
`one_step_off`, refused here). What runs concurrently: the rollout workers with each other,
the policies' steps when they have a slot each, and (async) the early workers' row transfer
with the later workers' stepping. Checkpoints and stop requests are the orchestrator's
`BoundaryCheckpoints`, as in an LLM run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl.config.schema import RunConfig
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.marl.evaluate import GreedyEvaluator
from flexmarl.marl.learner import marl_train_worker_main
from flexmarl.marl.offpolicy import q_layouts
from flexmarl.marl.policies import (
    MarlSample,
    PolicyError,
    PolicyLayout,
    group_spec,
    layouts,
)
from flexmarl.marl.rollout import RolloutResult
from flexmarl.marl.samplers import IterationSampler, OnPolicyRows, ReplayTransitions
from flexmarl.marl.workers import MarlWorkerSpec, marl_rollout_worker_main
from flexmarl.orchestrator.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    find_checkpoints,
)
from flexmarl.orchestrator.checkpointing import BoundaryCheckpoints
from flexmarl.orchestrator.run import host_run, release_signals, stop_on_signals
from flexmarl.orchestrator.schedules import schedule_for
from flexmarl.runtime.local.runtime import EnvRuntime, EnvWorkers
from flexmarl.runtime.local.workers import from_numpy
from flexmarl.runtime.ray.runtime import RayEnvRuntime
from flexmarl.store.experience import ExperienceStore, Row
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training.algorithms.mappo import MappoConfig

__all__ = ["MarlResult", "MarlRun", "PolicyError", "group_spec", "train_marl"]


@dataclass
class MarlResult:
    out_dir: Path | None
    records: list[dict[str, Any]]
    audit: dict[str, list[tuple[str, int, int, int]]]
    store_stats: dict[str, dict[str, int]]
    wall_s: float
    env_steps: int
    episodes: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] | None = None  # the supervisor's failures and recoveries
    resumed_env_steps: int = 0  # done before a resume, by an earlier process


class MarlRun:
    """One run: the policies' layout (from the environment's spaces, checked here, before
    any worker starts), the store, the runtime, and the schedule's two halves."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg, self.algo = cfg, cfg.env_algorithm
        env = cfg.environment
        probe = VecParallelEnv(env.id, env.options, 1, cfg.seed, env.opponents)
        probe.reset()
        self.agents = list(probe.agents)
        # the policies, checked against the spaces; on- and off-policy differ in the sampler
        self.layouts: dict[str, PolicyLayout]
        self.sampler: IterationSampler
        if isinstance(self.algo, MappoConfig):
            self.layouts = layouts(cfg, probe)
        else:
            self.layouts = q_layouts(cfg, probe)
        self.policy_of = {a: name for name, lay in self.layouts.items() for a in lay.agents}
        self.num_envs = env.num_envs * cfg.runtime.rollout_workers  # all workers'
        self.store = ExperienceStore(self.agents)
        self.sampler = (OnPolicyRows(self.store, self.agents, self.layouts, self.num_envs)
                        if isinstance(self.algo, MappoConfig) else ReplayTransitions())
        self.audit: dict[str, list[tuple[str, int, int, int]]] = defaultdict(list)
        self.runtime: Any = None
        self.telemetry: Any = None
        self.checkpoints: Any = None  # orchestrator.checkpointing.BoundaryCheckpoints
        self.records: list[dict[str, Any]] = []
        self.episodes: list[dict[str, Any]] = []
        self.published: dict[str, tuple[int, Any]] = {}  # per policy: its latest weights
        self.evaluator: Any = None  # train.eval_every: marl/evaluate.py's GreedyEvaluator
        self.n_iter = 0
        self._start = self._t_iter = 0.0
        # the schedule's signals, per iteration k: ("version", k) every policy is at version
        # k; ("started", k) / ("rolled", k) its rollout began / ended; ("put", k, i) rollout
        # worker i's results are in the sampler
        self._events: dict[tuple[Any, ...], asyncio.Event] = defaultdict(asyncio.Event)
        self._trained: dict[int, set[str]] = defaultdict(set)
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self.episodes_k: list[dict[str, Any]] = []
        self.payload_bytes = [0, 0]
        self.rollout_s = 0.0
        self.metrics_k: dict[str, float] = {}

    # --- the schedule's halves ---------------------------------------------------------------
    async def rollout_iteration(self, k: int) -> None:
        """Iteration k on every rollout worker once every policy is at version k; each
        worker's results go to the sampler as it ends, in worker order (so the rows, and what
        each step is handed, never depend on timing)."""
        await self._events["version", k].wait()
        t0 = time.perf_counter()
        pool = self.runtime.rollout
        running = [asyncio.ensure_future(pool.rollout_on(i, k)) for i in range(pool.n_workers)]
        self._events["started", k].set()
        try:
            for i, result in enumerate(running):
                self.put_rows(k, [await result])
                self._events["put", k, i].set()
        finally:
            for result in running:
                result.cancel()
        self.rollout_s = time.perf_counter() - t0
        self._events["rolled", k].set()

    def started_event(self, k: int) -> asyncio.Event:
        return self._events["started", k]

    async def iterations_ready(self, k: int) -> None:
        await self._events["rolled", k].wait()

    def put_rows(self, k: int, results: list[RolloutResult]) -> None:
        """Iteration k's results of every rollout worker, held by the sampler for step k."""
        self.sampler.put(k, results)
        for res in results:
            self.episodes_k += res.episodes
            self.payload_bytes[0] += res.payload_bytes[0]
            self.payload_bytes[1] += res.payload_bytes[1]

    def take(self, policy: str, k: int) -> dict[str, tuple[list[Row], list[MarlSample]]]:
        """MAPPO / IPPO: policy's rows of iteration k, per agent, taken from the store once."""
        assert isinstance(self.sampler, OnPolicyRows)
        return self.sampler.take(policy, k)

    async def train_iteration(self, policy: str, k: int) -> None:
        """Step k of `policy` in its training slot on what the sampler hands it, checked
        against the step's audit, then version k+1 to the rollout workers."""
        train = self.runtime.train
        await self.checkpoints.step_allowed.wait()  # a checkpoint reads the learners' states
        # each rollout worker's micro-batches as its results are in (all at once after a
        # sync rollout), then the step: queued in order, so the pool's runner holds one slot
        # lease from the last worker's micro-batches to the step
        acc = []
        for i in range(self.runtime.rollout.n_workers):
            await self._events["put", k, i].wait()
            acc += [asyncio.ensure_future(train.accumulate(policy, samples))
                    for samples in self.sampler.batches(policy, k)]
        stepped = asyncio.ensure_future(train.step(policy))
        await asyncio.gather(*acc)
        metrics, wire = await stepped
        audit = [tuple(e) for e in json.loads(wire[0])["meta"].get("trained_on", [])]
        self.sampler.check(policy, k, audit)
        self.audit[policy] += audit
        self.sampler.release(policy, k)
        await self.runtime.rollout.publish(policy, k + 1, wire)
        self.published[policy] = (k + 1, wire)
        self.metrics_k.update(self.sampler.step_metrics(policy, metrics))
        self._trained[k].add(policy)
        if len(self._trained[k]) == len(self.layouts):  # rollout k+1 may start
            self._events["version", k + 1].set()

    def _maybe_finish(self, k: int) -> None:
        """The async schedule: record iteration k once it is rolled out and trained."""
        if self._events["rolled", k].is_set() and len(self._trained[k]) == len(self.layouts):
            if not self.records or self.records[-1]["iteration"] < k:
                self._finish(k)

    # --- the run -----------------------------------------------------------------------------
    async def run_loop(self, telemetry: Telemetry, out: Path | None, on_iteration, n_iter: int,
                       resume: Checkpoint | None = None, on_runtime=None) -> MarlResult:
        """The schedule over the runtime's pools, hosted by `orchestrator.run.host_run` (which
        owns the files, the telemetry and the event loop); checkpoints and stop requests are
        the orchestrator's `BoundaryCheckpoints`, as in an LLM run."""
        first = 0
        if resume is not None:  # the host already put the checkpoint's records on disk
            first = self._load_position(resume)
        self.runtime = env_runtime(self.cfg, self.layouts, telemetry)
        self.telemetry, self.on_iteration, self.n_iter = telemetry, on_iteration, n_iter
        manager = (CheckpointManager(out / "checkpoints", self.cfg.train.keep_checkpoints)
                   if out is not None else None)
        self.checkpoints = BoundaryCheckpoints(
            self.cfg, telemetry, self.runtime.train,
            manager.save if manager is not None and self.runtime.capture else None,
            self._snapshot)
        self._start = time.perf_counter()
        await self.runtime.start()
        try:
            if resume is not None:  # each policy's learner and each worker's environments
                await self.checkpoints.restore_trainers(list(self.layouts), resume)
                await self.runtime.rollout.restore([
                    resume.extra[f"rollout-{i}.pkl"]
                    for i in range(self.cfg.runtime.rollout_workers)])
            for name in self.layouts:  # version `first`, from each policy's slot
                await self.runtime.rollout.publish(name, first,
                                                   await self.runtime.train.weights(name))
            self._events["version", first].set()
            if on_runtime is not None:
                on_runtime(self.runtime)
            self._t_iter = time.perf_counter()
            # sync, or async: each policy's micro-batches stream from each rollout worker as
            # it ends (module docstring); never one_step_off (refused by the config)
            schedule = schedule_for(self.cfg.pipeline.mode, self, self, None,
                                    self.runtime.train, list(self.layouts), self._finish,
                                    self._maybe_finish)
            handled = stop_on_signals(self.checkpoints.request_stop)
            try:
                await self.checkpoints.run_until_stop(schedule.drive(first, n_iter),
                                                      lambda: len(self.records))
            finally:
                release_signals(handled)
            if out is not None:
                for name in self.layouts:
                    await self.runtime.train.save(name, str(out / "checkpoints" / "final" / name))
            placement = self.runtime.placement()
            faults = self.runtime.fault_counts()
        finally:
            await self.runtime.stop()
        return MarlResult(out, self.records, dict(self.audit), self.store.stats(),
                          time.perf_counter() - self._start, n_iter * self.num_envs
                          * self.cfg.train.rollout_steps, self.episodes, placement, faults,
                          first * self.num_envs * self.cfg.train.rollout_steps)

    def _finish(self, k: int) -> None:
        """Iteration k is rolled out and every policy stepped: its record (and evaluation),
        and the checkpoint of its boundary when one is due."""
        now = time.perf_counter()
        rec = self._record(k, self._t_iter, now, self._start)
        rec.update(self._evaluate(k, self.n_iter))
        self._t_iter = now
        self.episodes.extend({"iteration": k, "env_steps": rec["env_steps"], **e}
                             for e in self.episodes_k)
        self.records.append(rec)
        self.telemetry.log(rec)
        if self.on_iteration is not None:
            self.on_iteration(rec)
        self._reset_iteration()
        for key in [key for key in self._events if key[1] == k and key[0] != "rolled"]:
            del self._events[key]  # ("rolled", k) stays: the async schedule's last check
        if self.checkpoints.due(k):
            self.checkpoints.capture(k, list(self.layouts))

    def _snapshot(self, completed: int) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                 dict[str, bytes]]:
        """A boundary's position and each rollout worker's environment state (as its last
        rollout left them); the rows are all trained on, so the store has none to keep."""
        position = {"completed": completed, "records": list(self.records),
                    "episodes": list(self.episodes),
                    "audit": {p: [list(t) for t in trail] for p, trail in self.audit.items()},
                    "seed": self.cfg.seed, "policies": list(self.layouts),
                    "rollout_workers": self.cfg.runtime.rollout_workers}
        extra = {}
        for i, blob in enumerate(self.runtime.rollout.env_state):
            assert blob is not None  # captured: checkpoint_every is set
            extra[f"rollout-{i}.pkl"] = blob
        return position, [], extra

    def _load_position(self, ckpt: Checkpoint) -> int:
        """Resume: the records, episodes and audit trail after iteration `completed - 1`,
        checked against this config before any worker starts."""
        if sorted(ckpt.trainer_states) != sorted(self.layouts):
            raise CheckpointError(f"resume {ckpt.path}: the checkpoint has policies "
                                  f"{sorted(ckpt.trainer_states)}, the config has "
                                  f"{sorted(self.layouts)} (the agents' network.base?)")
        n = int(ckpt.position["rollout_workers"])
        if n != self.cfg.runtime.rollout_workers:
            raise CheckpointError(f"resume {ckpt.path}: the checkpoint holds the environments "
                                  f"of {n} rollout workers; set runtime.rollout_workers={n}")
        self.records += ckpt.position["records"]
        self.episodes += ckpt.position["episodes"]
        for policy, trail in ckpt.position["audit"].items():
            self.audit[policy] = [(sid, int(v), int(s), int(e)) for sid, v, s, e in trail]
        return ckpt.completed

    def _evaluate(self, k: int, n_iter: int) -> dict[str, float]:
        """`train.eval_every`: after iterations eval_every - 1, 2 * eval_every - 1, ... and the
        last one, the greedy evaluation of version k+1 (`eval/*`, with `eval_s`). It reads
        the published weights only, so training is unchanged by it."""
        every = self.cfg.train.eval_every
        if every is None or ((k + 1) % every != 0 and k != n_iter - 1):
            return {}
        t0 = time.perf_counter()
        if self.evaluator is None:
            self.evaluator = GreedyEvaluator(self.cfg, self.layouts,
                                             self.cfg.train.eval_episodes)
        for name, (version, wire) in self.published.items():
            if version != k + 1:
                raise RuntimeError(f"evaluation after iteration {k}: policy {name!r} "
                                   f"published version {version}")
            self.evaluator.load(name, version, from_numpy(wire))
        out = self.evaluator.run()
        out["eval_s"] = time.perf_counter() - t0
        return out

    def _record(self, k: int, t0: float, t2: float, start: float) -> dict[str, Any]:
        n = self.num_envs * self.cfg.train.rollout_steps
        eps = self.episodes_k
        wall = t2 - t0
        rec: dict[str, Any] = {
            "iteration": k, "env_steps": (k + 1) * n, "wall_s": wall,
            "time_s": t2 - start, "rollout_s": self.rollout_s,
            "train_s": max(wall - self.rollout_s, 0.0),
            "rollout/env_steps_per_s": n / max(self.rollout_s, 1e-9),
            "env_steps_per_s": n / max(wall, 1e-9), "episodes/total": len(eps),
            "store/obs_bytes_raw": self.payload_bytes[0],
            "store/obs_bytes_stored": self.payload_bytes[1],
            "store/obs_bytes_saved_frac": 1 - self.payload_bytes[1] / max(self.payload_bytes[0],
                                                                           1),
        }
        rec.update(self.metrics_k)
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


def train_marl(cfg: RunConfig, out: str | Path | None = None, on_iteration=None,
               iterations: int | None = None, resume: str | Path | None = None,
               on_runtime=None) -> MarlResult:
    """Train a classic MARL run, hosted like every run (`orchestrator.run.host_run`): writes
    config.yaml, metrics.jsonl, summary.json, trace.json and checkpoints under `out`. With
    `resume` (a run folder or its checkpoints/), continue from its LATEST generation.
    `on_runtime(runtime)` is called once the workers run (fault tests)."""
    run = MarlRun(cfg)  # environments probed: spaces and agents checked
    out_path = Path(out) if out is not None else None
    ckpt = find_checkpoints(resume).load() if resume is not None else None
    n_iter = iterations if iterations is not None else cfg.train.iterations

    async def body(telemetry: Telemetry) -> MarlResult:
        return await run.run_loop(telemetry, out_path, on_iteration, n_iter, ckpt, on_runtime)

    def summary(result: MarlResult, wall_s: float) -> dict[str, Any]:
        steps_here = result.env_steps - result.resumed_env_steps
        return {"iterations": len(result.records), "env_steps": result.env_steps,
                "env_steps_this_process": steps_here, "wall_s": wall_s,
                "algorithm": cfg.env_algorithm.name,
                "final_return_mean": result.records[-1].get("return_mean")
                if result.records else None, "placement": result.placement,
                "faults": result.faults}

    return host_run(cfg, out_path, ckpt, body, summary)
