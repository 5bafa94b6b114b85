"""The joint orchestrator: episodes along the graph, micro-batch pipeline, version gates.

Written once against `RolloutPool` / `TrainPool` and the running asyncio loop's clock, so it
runs unchanged on the local, Ray and simulated runtimes.

Pipelines (docs/design.md section 5):
- `sync`: roll out iteration k completely, then train every agent on it, then publish;
- `async`: agent a's trainer consumes a's ready micro-batches of iteration k as they appear
  (accumulating gradients), steps when k's rows are all in, publishes version k+1; a's nodes of
  iteration k+1 start as soon as their inputs and a's version k+1 exist;
- `one_step_off`: one-step off-policy async (verl's / AReaL's, applied per agent): iteration k
  is generated with every trainable agent at version max(0, k-1), so iteration k+1's rollout
  (version k) overlaps step k. The driver is async's: k+1's rollout starts once k's is done,
  trainers consume k's micro-batches as they appear; step k publishes version k+1 to the
  replicas only once iteration k+1's rollout is done (a replica serves one version per agent),
  which is when iteration k+2 needs it. The trainers accept rows one version older than
  themselves (`pipeline.max_staleness` = 1); the loss's ratio against the recorded behaviour
  log-probs is the off-policy correction. Checkpoints are not supported in this mode.
All obey the consistency contract: agent a's step k trains on exactly the rows of iteration k,
each once, generated with a's entry of iteration k's version vector (k on-policy, max(0, k-1)
one step off), in episodes whose version vector is iteration k's.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.config.schema import ConfigError, CreditConfig, RunConfig
from flexmarl.errors import UserError
from flexmarl.graph.meg import EpisodeContext, GraphError
from flexmarl.graph.task import Task
from flexmarl.orchestrator import contracts
from flexmarl.policy.model import stable_seed
from flexmarl.policy.sampling import GenerationRequest
from flexmarl.runtime.base import RolloutPool, TrainPool, Weights
from flexmarl.store.experience import (
    ExperienceStore,
    Row,
    Status,
    TensorRef,
    make_sample_id,
    parse_sample_id,
)
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training import algorithms


class EpisodeFailure(RuntimeError):
    """A user function (prompt builder, condition, reward) raised inside an episode."""


class TrainingDiverged(UserError, RuntimeError):
    """More optimizer steps were skipped for NaN/inf than `train.max_skipped_steps` allows."""


class FailureBudgetExceeded(RuntimeError):
    """Episodes failed beyond `train.max_failed_fraction` in more consecutive iterations than
    `train.max_consecutive_failed_iterations` allows: the run stops (exit code 1), with the first error."""

    def __init__(self, message: str, first_error: str | None) -> None:
        super().__init__(message)
        self.first_error = first_error


class RunInterrupted(RuntimeError):
    """SIGTERM / Ctrl-C: the run stopped at an iteration boundary (after a checkpoint, when
    checkpointing is configured)."""

    def __init__(self, message: str, checkpoint: str | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


# save(completed, position, trainer_states, rows) -> path: the checkpoint writer (blocking; it
# runs in a thread while the pipeline goes on).
SaveCheckpoint = Callable[[int, dict[str, Any], dict[str, Any], list[dict[str, Any]]], Any]


@dataclass
class IterationState:
    index: int
    episodes_total: int
    started_at: float = 0.0
    episodes_done: int = 0
    episodes_failed: int = 0
    successes: int = 0
    rollout_done: asyncio.Event = field(default_factory=asyncio.Event)
    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    groups: dict[str, list[dict[str, str]]] = field(default_factory=lambda: defaultdict(list))
    groups_done: set[int] = field(default_factory=set)
    trained: dict[str, dict[str, float]] = field(default_factory=dict)
    train_done: dict[str, float] = field(default_factory=dict)
    rollout_finished_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    # rollout measurements: per agent queue waits (s) and tokens generated, per node latency
    queue_waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # how often each agent gave each response (doctor: an agent stuck on one answer)
    responses: dict[str, dict[tuple, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    node_latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    episode_latency: list[float] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    # rollout.schedule=stage: node tasks still unresolved per graph level, and one event per
    # level that opens when every lower level is resolved in every episode
    stage_left: list[int] = field(default_factory=list)
    stage_open: list[asyncio.Event] = field(default_factory=list)


def assign_credit(
    team: float, own: dict[str, float], downstream: dict[str, dict[str, int]], credit: CreditConfig
) -> dict[str, float]:
    """Node rewards of one episode: team * team reward + node * own reward + the discounted own
    rewards of the nodes downstream (upstream_discount ** hops); `own` holds the nodes that ran."""
    out = {}
    for name in own:
        value = credit.team * team + credit.node * own[name]
        if credit.upstream_discount > 0:
            for down, hops in downstream.get(name, {}).items():
                if down in own:
                    value += credit.upstream_discount ** hops * own[down]
        out[name] = value
    return out


class JointOrchestrator:
    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        rollout: RolloutPool,
        train: TrainPool,
        telemetry: Telemetry,
        on_iteration: Callable[[dict[str, Any]], None] | None = None,
        save_checkpoint: SaveCheckpoint | None = None,
        resume: Any = None,
        store: ExperienceStore | None = None,
    ) -> None:
        """`save_checkpoint` writes a generation every `train.checkpoint_every` iterations and
        on `request_stop`; `resume` (a checkpoint.Checkpoint) continues a run where it left;
        `store` is the runtime's experience store (default: an in-process one)."""
        self.cfg = cfg
        self.task = task
        self.graph = task.graph
        self.order = self.graph.validate(cfg.agents.keys())
        self.turns = self.graph.turn_of()
        self.level = self._levels()
        self._downstream = self._downstream_hops()
        self.rollout = rollout
        self.train = train
        self.telemetry = telemetry
        self.on_iteration = on_iteration
        self.agents = list(cfg.agents)
        self.trainable = [a for a in self.agents if cfg.agents[a].trainable]
        # Trainers wait for whole groups (`_maybe_group_ready` wakes them), not for every
        # store change: a wake-up per row would cost each trainer a scan per generated row.
        # The runtime may bring its own store (Ray: one table actor per agent) with the same
        # interface; the orchestrator is the same code either way.
        self.store = store if store is not None else ExperienceStore(self.agents)
        self.versions = dict.fromkeys(self.agents, 0)
        self._gates: dict[tuple[str, int], asyncio.Event] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self.iterations: dict[int, IterationState] = {}
        self._started: dict[int, asyncio.Event] = {}
        self.consumed: dict[str, dict[int, list[str]]] = {a: defaultdict(list) for a in self.agents}
        # (sample_id, policy_version, optimizer step) of every row trained on: the audit trail
        # that "each row exactly once, by the step of its own version" is checked against.
        self.audit: dict[str, list[tuple[str, int, int]]] = {a: [] for a in self.agents}
        self.records: list[dict[str, Any]] = []
        # more per-iteration metrics (GPU utilisation and memory): each called once per record
        self.metric_sources: list[Callable[[], dict[str, Any]]] = []
        # (agent, step) -> [first micro-batch queued at, rows, tokens]: trainer throughput
        self._train_work: dict[tuple[str, int], list[float]] = {}
        self._last_done = 0.0
        self._start = 0.0
        # failure budget: consecutive iterations over train.max_failed_fraction, first error
        self.failed_iterations = 0
        self.first_error: str | None = None
        # the simulator's synthetic prompts (placeholder ids, any length) feed no real model
        self._check_prompts = cfg.runtime.kind != "sim"
        # --- reliability: checkpoints, resume, stop requests, skipped steps ---
        self.save_checkpoint = save_checkpoint
        self.resume = resume
        self.start_iteration = 0
        self.skipped_steps = 0
        self.last_checkpoint: str | None = None
        self._capture_idle = asyncio.Event()
        self._capture_idle.set()
        self._writing: asyncio.Future | None = None
        self._stop_requests = 0
        self._stop = asyncio.Event()
        self._restored: dict[tuple[int, int], list[dict[str, Any]]] = {}
        # one_step_off: how many versions the rollout lags training, and per agent the weights
        # of its last step, held until the iteration generated with the previous version is done
        self.staleness = cfg.pipeline.max_staleness
        self._held: dict[str, tuple[int, Weights]] = {}
        if self.staleness:
            if resume is not None:
                raise ConfigError(f"resume {getattr(resume, 'path', resume)}: checkpoints are "
                                  "not supported with pipeline.mode=one_step_off")
            # no boundary has a resumable state (iteration k+1 is in flight on version k
            # weights no trainer holds): a stop request stops at once, without a checkpoint
            self.save_checkpoint = None
        if resume is not None:
            self._load_position(resume)

    # --- versions and notifications ----------------------------------------------------------
    def vector(self, iteration: int) -> dict[str, int]:
        """The version vector of iteration k: every trainable agent at k (at max(0, k-1) in
        one_step_off), frozen ones at 0."""
        v = max(0, iteration - self.staleness)
        return {a: (v if a in self.trainable else 0) for a in self.agents}

    def _gate(self, agent: str, version: int) -> asyncio.Event:
        key = (agent, version)
        if key not in self._gates:
            self._gates[key] = asyncio.Event()
            if self.versions[agent] >= version:
                self._gates[key].set()
        return self._gates[key]

    def _changed_event(self, agent: str) -> asyncio.Event:
        if agent not in self._changed:
            self._changed[agent] = asyncio.Event()
        return self._changed[agent]

    # --- episodes ----------------------------------------------------------------------------
    async def run_episode(
        self, it: IterationState, index: int, traj: int, data: dict[str, Any]
    ) -> None:
        k = it.index
        input_id = f"{k}-{index}"
        ctx = EpisodeContext(input_id=input_id, trajectory_id=traj, data=data)
        restored = self._restored.pop((index, traj), None) if k == self.start_iteration else None
        if restored is not None:  # finished before the checkpoint: its rows, not a re-run
            self._replay_episode(it, ctx, restored)
            return
        vector = self.vector(k)
        rows: dict[str, Row] = {}
        done: dict[str, asyncio.Future] = {
            n: asyncio.get_running_loop().create_future() for n in self.order
        }
        priority = (k, index, traj)
        episode_start = self.telemetry.now()

        async def run_node(name: str) -> None:
            node = self.graph.nodes[name]
            deps_ok = [await done[d] for d in node.inputs]
            if not all(deps_ok):
                done[name].set_result(False)  # an upstream branch ended: so does this one
                return
            try:
                if node.when is not None and not contracts.check_condition(name, node.when(ctx)):
                    done[name].set_result(False)
                    return
                prompt = node.prompt(ctx)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - user code
                raise EpisodeFailure(f"node {name!r}: prompt builder raised {exc!r}") from exc
            # wrong types, token ids outside the vocabulary, empty or over-long prompts, a zero
            # budget: a bug in the task, not a flaky episode: stop the run with the node named
            if self._check_prompts:
                contracts.check_prompt(name, node.agent, prompt, self.task.vocab_size,
                                       self.task.max_seq_len)
            if it.stage_open:  # rollout.schedule=stage: the level barrier
                await it.stage_open[self.level[name]].wait()
            agent = node.agent
            version = vector[agent]
            await self._gate(agent, version).wait()
            sample_id = make_sample_id(input_id, self.turns[name], traj)
            row = self.store.add(Row(
                sample_id=sample_id, agent=agent, node=name, input_id=input_id,
                turn=self.turns[name], trajectory_id=traj, iteration=k,
                policy_version=version, version_vector=vector,
            ))
            rows[name] = row
            acfg = self.cfg.agents[agent]
            request = GenerationRequest(
                sample_id=sample_id, agent=agent, version=version, prompt=prompt.tokens,
                max_new_tokens=prompt.max_new_tokens, allowed_tokens=prompt.allowed_tokens,
                stop_tokens=prompt.stop_tokens, temperature=acfg.sampling.temperature,
                seed=self.cfg.seed,
            )
            submitted = self.telemetry.now()
            result = await self.rollout.generate(request, priority)
            it.node_latency[name].append(self.telemetry.now() - submitted)
            it.queue_waits[agent].append(result.queue_s)
            it.tokens[agent] += len(result.tokens)
            it.responses[agent][tuple(result.tokens)] += 1
            self.store.set_generated(
                agent, sample_id,
                {"prompt": request.prompt, "response": result.tokens,
                 "allowed": prompt.allowed_tokens, "temperature": request.temperature},
                {"logprobs": result.logprobs if isinstance(result.logprobs, TensorRef)
                 else np.asarray(result.logprobs, dtype=np.float32)},
            )
            ctx.outputs[name] = result.tokens
            done[name].set_result(True)

        tasks = [asyncio.ensure_future(run_node(n)) for n in self.order]
        if it.stage_open:
            for n, t in zip(self.order, tasks, strict=True):
                # ran, skipped, failed or cancelled with its episode: the level counts it
                t.add_done_callback(lambda _t, level=self.level[n]: self._resolved(it, level))
        error: str | None = None
        try:
            await asyncio.gather(*tasks)
            rewards = self._score(ctx, rows)
        except EpisodeFailure as exc:
            error = str(exc)
        except UserError:  # a contract violation (contracts.py): the run stops, exit code 2
            raise
        except Exception as exc:  # noqa: BLE001 - worker or user failure: fail this episode only
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        if error is not None:
            for row in rows.values():
                if row.status in (Status.PENDING, Status.GENERATED, Status.REWARDED):
                    self.store.set_failed(row.agent, row.sample_id, error)
            it.episodes_failed += 1
            if self.first_error is None:
                self.first_error = f"iteration {k}, episode {input_id}/{traj}: {error}"
            if len(it.errors) < 5:
                it.errors.append(error)
            self.telemetry.event("episode_failed", iteration=k, input_id=input_id,
                                 trajectory=traj, error=error)
        else:
            for name, row in rows.items():
                self.store.set_rewarded(row.agent, row.sample_id, rewards[name])
                it.rewards[row.agent].append(rewards[name])
            if self.graph.success is not None:
                try:
                    it.successes += int(bool(self.graph.success(ctx)))
                except Exception:  # noqa: BLE001 - a metric must not kill the run
                    pass
        it.groups[input_id].append({n: r.sample_id for n, r in rows.items()} if error is None
                                   else {})
        it.episode_latency.append(self.telemetry.now() - episode_start)
        self._maybe_group_ready(it, input_id)
        it.episodes_done += 1
        if it.episodes_done == it.episodes_total:
            self._rollout_finished(it)

    def _levels(self) -> dict[str, int]:
        """Graph level of each node: 0 without inputs, else one more than its deepest input."""
        level: dict[str, int] = {}
        for name in self.order:  # topological
            inputs = self.graph.nodes[name].inputs
            level[name] = 1 + max((level[i] for i in inputs), default=-1)
        return level

    def _resolved(self, it: IterationState, level: int, count: int = 1) -> None:
        it.stage_left[level] -= count
        for lvl in range(1, len(it.stage_open)):
            if it.stage_left[lvl - 1] > 0:
                break
            if not it.stage_open[lvl].is_set():
                it.stage_open[lvl].set()

    def _rollout_finished(self, it: IterationState) -> None:
        """Iteration k's last episode is in: let the rollout pool re-plan from the store's
        statistics (hierarchical balancing) before iteration k+1 submits anything."""
        it.rollout_finished_at = self.telemetry.now()
        it.plan = self.rollout.end_iteration(it.index, self.store.generation_stats(it.index))
        if it.plan is not None:
            self.telemetry.event("rollout_plan", **it.plan)
        it.rollout_done.set()

    def _replay_episode(
        self, it: IterationState, ctx: EpisodeContext, saved: list[dict[str, Any]]
    ) -> None:
        """Account a restored episode exactly as `run_episode` accounted it the first time."""
        rows = {}
        for d in sorted(saved, key=lambda d: d["turn"]):
            row = self.store.restore_row(d)
            rows[row.node] = row
            ctx.outputs[row.node] = list(d["data"]["response"])
            it.rewards[row.agent].append(float(d["data"]["reward"]))
        if self.graph.success is not None:
            try:
                it.successes += int(bool(self.graph.success(ctx)))
            except Exception:  # noqa: BLE001 - a metric must not kill the run
                pass
        it.groups[ctx.input_id].append({n: r.sample_id for n, r in rows.items()})
        if it.stage_open:
            for name in self.order:
                self._resolved(it, self.level[name])
        self._maybe_group_ready(it, ctx.input_id)
        it.episodes_done += 1
        if it.episodes_done == it.episodes_total:
            it.rollout_finished_at = self.telemetry.now()
            it.rollout_done.set()

    def _score(self, ctx: EpisodeContext, rows: dict[str, Row]) -> dict[str, float]:
        """Credit assignment across the graph (`train.credit`): each node that ran gets
        team * team reward + node * its own reward + a discounted share of the own rewards of
        the nodes downstream of it (upstream_discount ** hops)."""
        credit = self.cfg.train.credit
        team = 0.0
        if self.graph.episode_reward is not None:
            try:
                team = self.graph.episode_reward(ctx)
            except Exception as exc:  # noqa: BLE001
                raise EpisodeFailure(f"episode reward raised {exc!r}") from exc
            team = contracts.check_reward("episode reward", team)
        own: dict[str, float] = {}
        for name in rows:
            node = self.graph.nodes[name]
            own[name] = 0.0
            if node.reward is not None:
                try:
                    value = node.reward(ctx)
                except Exception as exc:  # noqa: BLE001
                    raise EpisodeFailure(f"node {name!r}: reward raised {exc!r}") from exc
                own[name] = contracts.check_reward(f"node {name!r}: reward", value)
        out = assign_credit(team, own, self._downstream, credit)
        for name, value in out.items():
            if not np.isfinite(value):
                raise EpisodeFailure(f"node {name!r}: reward is not finite ({value})")
        return out

    def _downstream_hops(self) -> dict[str, dict[str, int]]:
        """For each node, the nodes that (transitively) consume its output, by fewest hops."""
        consumers: dict[str, list[str]] = {n: [] for n in self.graph.nodes}
        for name, node in self.graph.nodes.items():
            for dep in node.inputs:
                consumers[dep].append(name)
        out: dict[str, dict[str, int]] = {}
        for start in self.graph.nodes:
            hops: dict[str, int] = {}
            frontier, h = [start], 0
            while frontier:
                h += 1
                nxt = []
                for n in frontier:
                    for c in consumers[n]:
                        if c not in hops:
                            hops[c] = h
                            nxt.append(c)
                frontier = nxt
            out[start] = hops
        return out

    def _maybe_group_ready(self, it: IterationState, input_id: str) -> None:
        """When all G trajectories of an input are in, compute group advantages per node."""
        group = it.groups[input_id]
        if len(group) < self.cfg.train.group_size:
            return
        # Trajectory order, not completion order: advantages and the row order inside
        # micro-batches (hence float summation order) then never depend on timing, so a resumed
        # or recovered run (whose episodes finish in another order) equals an uninterrupted one.
        group.sort(key=lambda g: min((parse_sample_id(s)[2] for s in g.values()), default=-1))
        it.groups_done.add(int(input_id.split("-")[1]))
        for agent in self.trainable:
            self._changed_event(agent).set()
        for name in self.order:
            ids = [g[name] for g in group if name in g]
            if not ids:
                continue
            agent = self.graph.nodes[name].agent
            if agent not in self.trainable:
                continue
            table = self.store.table(agent)
            rewards = [table.get(i).data["reward"] for i in ids]
            algo_cfg = self.cfg.agents[agent].algorithm
            advs = algorithms.get(algo_cfg.name).sequence_advantages(rewards, algo_cfg)
            for sid, adv in zip(ids, advs, strict=True):
                self.store.set_ready(agent, sid, adv)

    async def rollout_iteration(self, k: int) -> IterationState:
        n_inputs = self.cfg.train.inputs_per_iteration
        group = self.cfg.train.group_size
        it = IterationState(index=k, episodes_total=n_inputs * group,
                            started_at=self.telemetry.now())
        self.iterations[k] = it
        self._started_event(k).set()
        if self.cfg.rollout.schedule == "stage":
            levels = 1 + max(self.level.values(), default=0)
            it.stage_left = [0] * levels
            for name in self.order:
                it.stage_left[self.level[name]] += it.episodes_total
            it.stage_open = [asyncio.Event() for _ in range(levels)]
            it.stage_open[0].set()
        rng = np.random.default_rng(stable_seed(self.cfg.seed, "inputs", k))
        try:
            inputs = self.task.sample_inputs(rng, n_inputs)
        except Exception as exc:  # noqa: BLE001 - user code
            raise contracts.ContractError(f"task {self.cfg.task.builder}: sample_inputs raised "
                                          f"{type(exc).__name__}: {exc}") from exc
        contracts.check_inputs(self.cfg.task.builder, inputs)
        if len(inputs) != n_inputs:
            raise GraphError(f"task returned {len(inputs)} inputs, expected {n_inputs}")
        episodes = [
            self.run_episode(it, i, j, inputs[i])
            for i in range(n_inputs) for j in range(group)
        ]
        await asyncio.gather(*episodes)
        return it

    # --- training ----------------------------------------------------------------------------
    async def train_iteration(self, agent: str, k: int) -> None:
        """Consume agent's rows of version k in canonical micro-batches, then step.

        A micro-batch is m complete groups (~micro_batch_size rows). In deterministic mode (and
        in sync mode, where all groups are complete anyway) micro-batch j is groups
        [j*m, (j+1)*m), so the split and the summation order of gradients never depend on
        timing and sync and async runs agree bitwise; otherwise the first m groups to complete
        go first, so training starts as early as possible.
        """
        it = self.iterations[k]
        vector = self.vector(k)
        taken: set[int] = set()
        # Micro-batches are queued with the pool as they become ready, without waiting for the
        # previous one: the pool runs an agent's calls in order, and an agent that holds a
        # training slot drains what it has queued before yielding it (sticky slots).
        # The step is queued right behind the last micro-batch, so the slot does not go to
        # another agent in between.
        queued: list[asyncio.Future] = []
        try:
            await self._queue_micro_batches(agent, k, it, taken, queued)
            await self._capture_idle.wait()  # a checkpoint is reading trainer states: no step
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
        nodes = [n for n in self.order if self.graph.nodes[n].agent == agent]
        per_group = max(1, self.cfg.train.group_size * len(nodes))
        groups_per_mb = max(1, self.cfg.train.micro_batch_size // per_group)
        changed = self._changed_event(agent)
        vector = self.vector(k)
        table = self.store.table(agent)
        canonical = self.cfg.runtime.deterministic or self.cfg.pipeline.mode == "sync"
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
                for episode in it.groups[f"{k}-{i}"]
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
            queued.append(asyncio.ensure_future(
                self._accumulate(agent, rows, self.store.micro_batch(agent, rows))))

    async def _accumulate(self, agent: str, rows: list[Row], batch: Any) -> None:
        await self.train.accumulate(agent, batch)
        self.store.release(rows)

    async def _stepped(self, agent: str, k: int, it: IterationState, vector: dict[str, int],
                       metrics: dict[str, float], weights: Weights) -> None:
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
        if self.staleness and k + 1 < self.cfg.train.iterations:
            # one_step_off: iteration k+1 is being generated with version k; the trainer loop
            # publishes k+1 once that rollout is done (`_publish_held`)
            self._held[agent] = (k + 1, weights)
        else:
            await self._publish(agent, k + 1, weights)
        self.store.evict(agent, vector[agent])
        it.train_done[agent] = self.telemetry.now()

    async def _publish_held(self, agent: str, version: int, weights: Weights) -> None:
        """one_step_off: publish the version the last step made once the iteration generated
        with its predecessor (iteration `version`) is rolled out."""
        await self.iterations_ready(version)
        await self._publish(agent, version, weights)

    async def _publish(self, agent: str, version: int, weights: Weights) -> None:
        await self.rollout.publish(agent, version, weights)
        self.versions[agent] = version
        self._gate(agent, version).set()

    # --- drivers -----------------------------------------------------------------------------
    async def run(self) -> list[dict[str, Any]]:
        self._start = self._last_done = self.telemetry.now()
        if self.records:  # resumed: time keeps counting from where the run stopped
            self._start -= float(self.records[-1].get("time_s", 0.0))
        if self.resume is not None:
            for agent in self.trainable:
                await self.train.set_state(agent, self.resume.trainer_states[agent])
        # Version 0 (or the resumed version) comes from the trainers, so rollout and training
        # start from the same weights.
        for agent in self.trainable:
            await self.rollout.publish(agent, self.versions[agent],
                                       await self.train.weights(agent))
        main = asyncio.ensure_future(self._drive())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not main.done():  # stop requested: the checkpoint (if any) is written, end here
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
            await self._wait_writes()
            where = f"; resume from {self.last_checkpoint}" if self.last_checkpoint else ""
            raise RunInterrupted(f"stopped after {len(self.records)} iterations{where}",
                                 self.last_checkpoint)
        main.result()
        await self._wait_writes()
        return self.records

    async def _drive(self) -> None:
        iterations = self.cfg.train.iterations
        first = self.start_iteration
        if self.cfg.pipeline.mode == "sync":
            # Time-shared training slots (fewer than agents): train agent after agent, so each
            # state is swapped in once per iteration instead of on every micro-batch.
            slots = self.train.training_slots()
            one_by_one = slots is not None and slots < len(self.trainable)
            for k in range(first, iterations):
                await self.rollout_iteration(k)
                if one_by_one:
                    for a in self.trainable:
                        await self.train_iteration(a, k)
                else:
                    await asyncio.gather(*(self.train_iteration(a, k) for a in self.trainable))
                self._finish_iteration(k)
        else:
            await asyncio.gather(self._async_rollouts(first, iterations),
                                 self._async_trainers(first, iterations))

    async def _async_rollouts(self, first: int, iterations: int) -> None:
        pending: list[asyncio.Task] = []
        for k in range(first, iterations):
            task = asyncio.ensure_future(self.rollout_iteration(k))
            pending.append(task)
            # Iteration k+1 only needs k's rollout to be complete: every agent's version k+1
            # depends on all of k's rows, so starting earlier could not run anything sooner.
            # (one_step_off: k+1 needs version k only, but one iteration in flight beyond the
            # one in training is the mode's bound on staleness and on the store.)
            ready = asyncio.ensure_future(self.iterations_ready(k))
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled() and task.exception() is not None:
                ready.cancel()  # the rollout failed (e.g. bad task input): fail the run
                raise task.exception()  # type: ignore[misc]
            await ready
        await asyncio.gather(*pending)

    def _started_event(self, k: int) -> asyncio.Event:
        """Set once iteration k's rollout has started (its `IterationState` exists)."""
        if k not in self._started:
            self._started[k] = asyncio.Event()
            if k in self.iterations:
                self._started[k].set()
        return self._started[k]

    async def iterations_ready(self, k: int) -> None:
        await self._started_event(k).wait()
        await self.iterations[k].rollout_done.wait()

    async def _async_trainers(self, first: int, iterations: int) -> None:
        async def trainer(agent: str) -> None:
            for k in range(first, iterations):
                await self._started_event(k).wait()
                held = self._held.pop(agent, None)
                if held is not None:  # one_step_off: version k goes out after k's rollout
                    await asyncio.gather(self.train_iteration(agent, k),
                                         self._publish_held(agent, *held))
                else:
                    await self.train_iteration(agent, k)
                self._maybe_finish(k)

        await asyncio.gather(*(trainer(a) for a in self.trainable))
        for k in range(first, iterations):
            # nothing trained (every agent frozen): an iteration is done with its rollout
            await self.iterations_ready(k)
            self._maybe_finish(k)

    # --- checkpoints and resume --------------------------------------------------------------
    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: checkpoint at the next iteration boundary, then stop. A second
        request stops at once, without a checkpoint."""
        self._stop_requests += 1
        self.telemetry.fault("stop_requested", count=self._stop_requests)
        if self._stop_requests > 1 or self.save_checkpoint is None:
            self._stop.set()

    def _position(self, completed: int) -> dict[str, Any]:
        return {
            "completed": completed,
            "versions": dict(self.versions),
            "records": list(self.records),
            "consumed": {a: {str(k): list(ids) for k, ids in per.items() if k < completed}
                         for a, per in self.consumed.items()},
            "audit": {a: [list(t) for t in trail if t[2] < completed]
                      for a, trail in self.audit.items()},
            "evicted": {a: dict(c) for a, c in self.store.evicted.items()},
            "skipped_steps": self.skipped_steps,
            "seed": self.cfg.seed,
            "agents": self.agents,
        }

    def _load_position(self, ckpt: Any) -> None:
        pos = ckpt.position
        if sorted(pos["agents"]) != sorted(self.agents):
            raise GraphError(f"resume {ckpt.path}: the checkpoint has agents {pos['agents']}, "
                             f"the config has {self.agents}")
        self.start_iteration = int(pos["completed"])
        self.versions.update({a: int(v) for a, v in pos["versions"].items()})
        self.records = list(pos["records"])
        for agent, per in pos["consumed"].items():
            for k, ids in per.items():
                self.consumed[agent][int(k)] = list(ids)
        for agent, trail in pos["audit"].items():
            self.audit[agent] = [(sid, int(v), int(step)) for sid, v, step in trail]
        for agent, counts in pos["evicted"].items():
            self.store.evicted[agent].update(counts)
        self.skipped_steps = int(pos.get("skipped_steps", 0))
        # Episodes of the next iteration that had finished (all rows rewarded, payload kept)
        # are restored instead of re-run; the rest are generated again (same keyed sampling).
        by_episode: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for d in ckpt.rows:
            if d["iteration"] == self.start_iteration:
                index = int(d["input_id"].split("-")[1])
                by_episode[(index, int(d["trajectory_id"]))].append(d)
        for key, rows in by_episode.items():
            if rows and all(d["status"] in (Status.REWARDED.value, Status.READY.value)
                            and "logprobs" in d["arrays"] for d in rows):
                self._restored[key] = rows

    def _checkpoint_due(self, k: int) -> bool:
        every = self.cfg.train.checkpoint_every
        if self.save_checkpoint is None:
            return False
        return self._stop_requests > 0 or (every is not None and (k + 1) % every == 0)

    def _capture(self, k: int) -> None:
        """Checkpoint at the boundary after iteration k: the position and the store are taken
        now (synchronously), the trainer states next, before any trainer may step again."""
        position = self._position(k + 1)
        rows = self.store.snapshot(k + 1)
        self._capture_idle.clear()
        previous = self._writing

        async def capture() -> None:
            try:
                if previous is not None:  # generations are written one after another
                    await previous
                states = dict(zip(self.trainable, await asyncio.gather(
                    *(self.train.get_state(a) for a in self.trainable)), strict=True))
                for agent, (_, meta) in states.items():
                    if int(meta["version"]) != k + 1:
                        raise RuntimeError(f"checkpoint after iteration {k}: trainer of "
                                           f"{agent!r} is at version {meta['version']}")
            finally:
                self._capture_idle.set()
            t0 = self.telemetry.now()
            assert self.save_checkpoint is not None
            path = await asyncio.to_thread(self.save_checkpoint, k + 1, position, states, rows)
            self.last_checkpoint = str(path)
            self.telemetry.fault("checkpoint", completed=k + 1, path=str(path),
                                 rows_in_flight=len(rows), save_s=self.telemetry.now() - t0)
            if self._stop_requests > 0:
                self._stop.set()

        self._writing = asyncio.ensure_future(capture())
        self._writing.add_done_callback(self._write_done)

    def _write_done(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self.telemetry.fault("checkpoint_failed", error=str(fut.exception()))
            self._stop.set()  # a failed save stops the run loudly (run() re-raises it)

    async def _wait_writes(self) -> None:
        if self._writing is not None:
            await self._writing  # re-raises a failed save

    def _maybe_finish(self, k: int) -> None:
        it = self.iterations[k]
        if it.rollout_done.is_set() and all(a in it.train_done for a in self.trainable):
            if not any(r["iteration"] == k for r in self.records):
                self._finish_iteration(k)

    def _rollout_metrics(self, it: IterationState) -> dict[str, Any]:
        """Balance and latency of one iteration's rollout (docs/design.md section 9 names)."""
        t0, t1 = it.started_at, it.rollout_finished_at
        span = max(t1 - t0, 1e-9)
        busy = self.telemetry.busy_by_worker("rollout", self.rollout.n_workers, t0, t1)
        out: dict[str, Any] = {}
        for i, b in enumerate(busy):
            out[f"rollout/replica/{i}/busy_frac"] = b / span
        mean = float(np.mean(busy)) if busy else 0.0
        # max/mean busy time across the pool's replicas: 1.0 is perfect balance
        out["rollout/imbalance"] = max(busy) / mean if mean > 0 else 1.0
        lat = it.episode_latency
        out["rollout/episode_latency_p50_s"] = _quantile(lat, 0.5)
        out["rollout/episode_latency_p95_s"] = _quantile(lat, 0.95)
        for agent in self.agents:
            waits = it.queue_waits.get(agent, [])
            out[f"agent/{agent}/queue_wait_p50_s"] = _quantile(waits, 0.5)
            out[f"agent/{agent}/queue_wait_p95_s"] = _quantile(waits, 0.95)
            out[f"agent/{agent}/tokens_per_s"] = it.tokens.get(agent, 0) / span
            out[f"agent/{agent}/tokens_generated"] = it.tokens.get(agent, 0)
            counts = it.responses.get(agent) or {}
            n = sum(counts.values())
            out[f"agent/{agent}/distinct_responses"] = len(counts)
            out[f"agent/{agent}/top_response_frac"] = max(counts.values()) / n if n else 0.0
        for node, values in it.node_latency.items():
            out[f"node/{node}/latency_p50_s"] = _quantile(values, 0.5)
        if it.plan is not None:
            out["rollout/plan"] = it.plan
        return out

    def _finish_iteration(self, k: int) -> None:
        it = self.iterations[k]
        now = self.telemetry.now()
        t0 = self._last_done
        self._last_done = now
        n_ok = it.episodes_total - it.episodes_failed
        record: dict[str, Any] = {
            "iteration": k,
            "wall_s": now - t0,
            "time_s": now - self._start,
            "task/success_rate": it.successes / max(n_ok, 1),
            "episodes/total": it.episodes_total,
            "episodes/failed": it.episodes_failed,
            "pool/rollout/busy_frac": self.telemetry.busy_frac(
                "rollout", self.rollout.n_workers, t0, now),
            "pool/train/busy_frac": self.telemetry.busy_frac("train", self.train.n_workers, t0, now),
            "rollout/makespan_s": it.rollout_finished_at - it.started_at,
        }
        record.update(self._rollout_metrics(it))
        for source in self.metric_sources:
            record.update(source())
        diffs = [it.trained[a] for a in self.trainable
                 if "logprob_diff_mean" in it.trained.get(a, {})]
        if diffs:  # rollout vs trainer log-probs of the same weights, over every agent
            record["rollout/logprob_diff_mean"] = float(np.mean(
                [d["logprob_diff_mean"] for d in diffs]))
            record["rollout/logprob_diff_max"] = max(d["logprob_diff_max"] for d in diffs)
        # training-state swaps (a trainer bound to a slot it was not resident on) that ended
        # in this iteration's window: agents time-sharing training slots
        swaps = self.telemetry.labelled("train", "swap:", t0, now)
        record["pool/train/swaps"] = sum(n for n, _ in swaps.values())
        record["pool/train/swap_s"] = sum(secs for _, secs in swaps.values())
        for agent in self.agents:
            # fsum is exactly rounded, so the mean does not depend on the order in which
            # episodes finished (placement changes that order, never the rewards).
            rewards = it.rewards.get(agent, [])
            record[f"agent/{agent}/reward_mean"] = (
                math.fsum(rewards) / len(rewards) if rewards else 0.0)
            record[f"agent/{agent}/policy_version"] = self.versions[agent]
            record[f"agent/{agent}/rows_trained"] = len(self.consumed[agent].get(k, []))
            if agent in self.trainable:
                record[f"agent/{agent}/swaps"] = swaps.get(agent, (0, 0.0))[0]
            for key, value in it.trained.get(agent, {}).items():
                record[f"agent/{agent}/{key}"] = value
        if it.errors:
            record["errors"] = it.errors
        self.records.append(record)
        self.telemetry.log(record)
        if self.on_iteration is not None:
            self.on_iteration(record)
        self._check_failure_budget(it)
        if self._checkpoint_due(k):
            self._capture(k)


    def _check_failure_budget(self, it: IterationState) -> None:
        """`train.max_failed_fraction` / `train.max_consecutive_failed_iterations`: stop a run whose
        episodes keep failing, before it writes "final" checkpoints of an untrained model."""
        limit = self.cfg.train.max_failed_fraction
        fraction = it.episodes_failed / max(it.episodes_total, 1)
        if it.episodes_failed == 0 or fraction <= limit:
            self.failed_iterations = 0
            return
        self.failed_iterations += 1
        if self.failed_iterations <= self.cfg.train.max_consecutive_failed_iterations:
            return
        self.telemetry.fault("failure_budget_exceeded", iteration=it.index,
                             failed=it.episodes_failed, total=it.episodes_total,
                             first_error=self.first_error)
        raise FailureBudgetExceeded(
            f"iteration {it.index}: {it.episodes_failed} of {it.episodes_total} episodes failed "
            f"({fraction:.0%} > train.max_failed_fraction={limit:g}) in "
            f"{self.failed_iterations} consecutive iteration(s) (train.max_consecutive_failed_iterations="
            f"{self.cfg.train.max_consecutive_failed_iterations}); first error: {self.first_error}",
            self.first_error)


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else 0.0


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
