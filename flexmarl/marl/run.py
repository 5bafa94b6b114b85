"""A classic MARL run (`env:`), hosted like every run: `orchestrator.run.host_run` (files,
telemetry, signals, summary), the schedule of `pipeline.mode` (`orchestrator/schedules.py`)
over the run's rollout source (`source.EnvSource`), the orchestrator's `BoundaryCheckpoints`,
`IterationMetrics` and `FailureBudget`. What is MARL's here: the policies' layout (from the
environment's spaces, checked before any worker starts), the sampler (on- and off-policy
differ only in it, `samplers.py`), the greedy evaluation, and what a checkpoint holds besides
the learners (each rollout worker's environments, the episodes, the audit trail). Why
rollout k+1 never overlaps step k (on-policy, every policy acts in every step): docs/marl.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexmarl.config.schema import RunConfig
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.marl.evaluate import PeriodicEvaluation
from flexmarl.marl.offpolicy import q_layouts
from flexmarl.marl.policies import PolicyError, PolicyLayout, group_spec, layouts
from flexmarl.marl.samplers import IterationSampler, OnPolicyRows, ReplayTransitions
from flexmarl.marl.source import EnvSource, env_runtime
from flexmarl.orchestrator.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    find_checkpoints,
)
from flexmarl.orchestrator.checkpointing import BoundaryCheckpoints
from flexmarl.orchestrator.metrics import FailureBudget, IterationMetrics
from flexmarl.orchestrator.run import StopRequests, host_run
from flexmarl.orchestrator.schedules import schedule_for
from flexmarl.store.experience import ExperienceStore
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training.algorithms.mappo import MappoConfig

__all__ = ["MarlResult", "MarlRun", "PolicyError", "group_spec", "train_marl"]


@dataclass
class MarlResult:
    out_dir: Path | None
    records: list[dict[str, Any]]
    audit: dict[str, list[tuple[str, int, int, int]]]
    store_stats: dict[str, dict[str, int]]
    wall_s: float  # the schedule's, workers' start to stop
    env_steps: int
    algorithm: str
    episodes: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] | None = None  # the supervisor's failures and recoveries
    resumed_env_steps: int = 0  # done before a resume, by an earlier process

    def summary(self, wall_s: float) -> dict[str, Any]:
        return {"env_steps": self.env_steps,
                "env_steps_this_process": self.env_steps - self.resumed_env_steps,
                "algorithm": self.algorithm, "final_return_mean":
                self.records[-1].get("return_mean") if self.records else None}


class MarlRun:
    """One run: the policies' layout (checked against the environment's spaces before any
    worker starts), the store, the sampler, and its rollout source."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg, self.algo = cfg, cfg.env_algorithm
        env = cfg.environment
        probe = VecParallelEnv(env.id, env.options, 1, cfg.seed, env.opponents)
        probe.reset()
        self.agents = list(probe.agents)
        on_policy = isinstance(self.algo, MappoConfig)
        self.layouts: dict[str, PolicyLayout] = (layouts(cfg, probe) if on_policy
                                                 else q_layouts(cfg, probe))
        self.store = ExperienceStore(self.agents)
        self.sampler: IterationSampler = (
            OnPolicyRows(self.store, self.agents, self.layouts, env.num_envs) if on_policy
            else ReplayTransitions())
        self.records: list[dict[str, Any]] = []
        self.source: EnvSource | None = None

    async def run_loop(self, telemetry: Telemetry, stops: StopRequests, out: Path | None,
                       on_iteration, n_iter: int, resume: Checkpoint | None = None,
                       on_runtime=None) -> MarlResult:
        """The schedule of `pipeline.mode` over the source, from iteration `first` (0, or the
        checkpoint's) to `n_iter`; one_step_off is refused by the config."""
        cfg = self.cfg
        source = self.source = EnvSource(cfg, self.agents, self.layouts, self.sampler,
                                         FailureBudget(cfg, telemetry))
        first = self._load_position(resume, source) if resume is not None else 0
        runtime = source.runtime = env_runtime(cfg, self.layouts, telemetry)
        source.telemetry = telemetry
        manager = (CheckpointManager(out / "checkpoints", cfg.train.keep_checkpoints)
                   if out is not None else None)
        checkpoints = BoundaryCheckpoints(
            cfg, telemetry, runtime.train,
            manager.save if manager is not None and runtime.capture else None,
            self._snapshot, source.step_allowed)
        evaluation = PeriodicEvaluation(cfg, self.layouts, n_iter)
        start = telemetry.now()
        if self.records:  # resumed: time keeps counting from where the run stopped
            start -= float(self.records[-1].get("time_s", 0.0))
        t_start = time.perf_counter()
        await runtime.start()
        try:
            metrics = IterationMetrics(telemetry, runtime.rollout, runtime.train, self.agents,
                                       list(self.layouts))
            if resume is not None:  # each policy's learner and each worker's environments
                await checkpoints.restore_trainers(list(self.layouts), resume)
                await runtime.rollout.restore([resume.extra[f"rollout-{i}.pkl"]
                                               for i in range(cfg.runtime.rollout_workers)])
            for name in self.layouts:  # version `first`, from each policy's slot
                await source.publish(name, first, await runtime.train.weights(name))
            if on_runtime is not None:
                on_runtime(runtime)
            last = [telemetry.now()]

            def finish(k: int) -> None:
                """Iteration k is rolled out and every policy stepped: its record (and
                evaluation), and the checkpoint of its boundary when one is due."""
                now = telemetry.now()
                rec = metrics.common(k, last[0], now, start)
                rec.update(source.record(k, now - last[0]))
                rec.update(evaluation.after(k, source.published))
                last[0] = now
                self.records.append(rec)
                telemetry.log(rec)
                if on_iteration is not None:
                    on_iteration(rec)
                if checkpoints.due(k):
                    checkpoints.capture(k, list(self.layouts))

            def maybe_finish(k: int) -> None:
                if source.complete(k):
                    finish(k)

            schedule = schedule_for(cfg.pipeline.mode, source, source, None, runtime.train,
                                    list(self.layouts), finish, maybe_finish)
            stops.route(checkpoints.request_stop)
            await checkpoints.run_until_stop(schedule.drive(first, n_iter),
                                             lambda: len(self.records))
            if out is not None:
                for name in self.layouts:
                    await runtime.train.save(name, str(out / "checkpoints" / "final" / name))
            placement, faults = runtime.placement(), runtime.fault_counts()
        finally:
            await runtime.stop()
        steps = source.steps_per_iteration
        return MarlResult(out, self.records, dict(source.audit), self.store.stats(),
                          time.perf_counter() - t_start, n_iter * steps, self.algo.name,
                          source.episodes, placement, faults, first * steps)

    def _snapshot(self, completed: int) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                 dict[str, bytes]]:
        """A boundary's position and each rollout worker's environment state (as its last
        rollout left them); the rows are all trained on, so the store has none to keep."""
        assert self.source is not None
        position = {"completed": completed, "records": list(self.records),
                    "episodes": list(self.source.episodes),
                    "audit": {p: [list(t) for t in trail]
                              for p, trail in self.source.audit.items()},
                    "seed": self.cfg.seed, "policies": list(self.layouts),
                    "rollout_workers": self.cfg.runtime.rollout_workers}
        extra = {}
        for i, blob in enumerate(self.source.runtime.rollout.env_state):
            assert blob is not None  # captured: checkpoint_every is set
            extra[f"rollout-{i}.pkl"] = blob
        return position, [], extra

    def _load_position(self, ckpt: Checkpoint, source: EnvSource) -> int:
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
        source.episodes += ckpt.position["episodes"]
        for policy, trail in ckpt.position["audit"].items():
            source.audit[policy] = [(sid, int(v), int(s), int(e)) for sid, v, s, e in trail]
        source.recorded = ckpt.completed - 1
        return ckpt.completed


def train_marl(cfg: RunConfig, out: str | Path | None = None, on_iteration=None,
               iterations: int | None = None, resume: str | Path | None = None,
               on_runtime=None, run: MarlRun | None = None) -> MarlResult:
    """Train a classic MARL run, hosted like every run (`orchestrator.run.host_run`): writes
    config.yaml, metrics.jsonl, summary.json, trace.json and checkpoints under `out`. With
    `resume` (a run folder or its checkpoints/), continue from its LATEST generation.
    `on_runtime(runtime)` is called once the workers run (fault tests); `run`, a `MarlRun` of
    `cfg` not yet run (the CLI's, whose environments it probed for its header)."""
    run = run if run is not None else MarlRun(cfg)  # environments probed: spaces, agents
    out_path = Path(out) if out is not None else None
    ckpt = find_checkpoints(resume).load() if resume is not None else None
    n_iter = iterations if iterations is not None else cfg.train.iterations

    async def body(telemetry: Telemetry, stops: StopRequests) -> MarlResult:
        return await run.run_loop(telemetry, stops, out_path, on_iteration, n_iter, ckpt,
                                  on_runtime)

    return host_run(cfg, out_path, ckpt, body)
