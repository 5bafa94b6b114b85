"""The joint orchestrator: episodes along the graph, micro-batch pipeline, version gates.

Written once against `RolloutPool` / `TrainPool` and the running asyncio loop's clock, so it
runs unchanged on the local, Ray and simulated runtimes.

Pipelines (DESIGN.md section 5):
- `sync`: roll out iteration k completely, then train every agent on it, then publish;
- `async`: agent a's trainer consumes a's ready micro-batches of iteration k as they appear
  (accumulating gradients), steps when k's rows are all in, publishes version k+1; a's nodes of
  iteration k+1 start as soon as their inputs and a's version k+1 exist.
Both obey the consistency contract: agent a's step k trains on exactly the rows a generated
with version k, in episodes whose version vector is iteration k's, each row once.
"""

from __future__ import annotations

import asyncio
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.config.schema import CreditConfig, RunConfig
from flexmarl.graph.meg import EpisodeContext, GraphError, NodePrompt
from flexmarl.graph.task import Task
from flexmarl.policy.model import stable_seed
from flexmarl.policy.sampling import GenerationRequest
from flexmarl.runtime.base import RolloutPool, TrainPool, Weights
from flexmarl.store.experience import ExperienceStore, Row, Status, make_sample_id
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training import algorithms
from flexmarl.training.trainer import Sample


class EpisodeFailure(RuntimeError):
    """A user function (prompt builder, condition, reward) raised inside an episode."""


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
    ) -> None:
        self.cfg = cfg
        self.task = task
        self.graph = task.graph
        self.order = self.graph.validate(cfg.agents.keys())
        self.turns = self.graph.turn_of()
        self._downstream = self._downstream_hops()
        self.rollout = rollout
        self.train = train
        self.telemetry = telemetry
        self.on_iteration = on_iteration
        self.agents = list(cfg.agents)
        self.trainable = [a for a in self.agents if cfg.agents[a].trainable]
        self.store = ExperienceStore(self.agents)
        self.store.subscribe(self._on_store_change)
        self.versions = dict.fromkeys(self.agents, 0)
        self._gates: dict[tuple[str, int], asyncio.Event] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self.iterations: dict[int, IterationState] = {}
        self.consumed: dict[str, dict[int, list[str]]] = {a: defaultdict(list) for a in self.agents}
        # (sample_id, policy_version, optimizer step) of every row trained on: the audit trail
        # that "each row exactly once, by the step of its own version" is checked against.
        self.audit: dict[str, list[tuple[str, int, int]]] = {a: [] for a in self.agents}
        self.records: list[dict[str, Any]] = []
        self._last_done = 0.0
        self._start = 0.0

    # --- versions and notifications ----------------------------------------------------------
    def vector(self, iteration: int) -> dict[str, int]:
        """The version vector of iteration k: every trainable agent at k, frozen ones at 0."""
        return {a: (iteration if a in self.trainable else 0) for a in self.agents}

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

    def _on_store_change(self, agent: str) -> None:
        self._changed_event(agent).set()

    # --- episodes ----------------------------------------------------------------------------
    async def run_episode(
        self, it: IterationState, index: int, traj: int, data: dict[str, Any]
    ) -> None:
        k = it.index
        input_id = f"{k}-{index}"
        ctx = EpisodeContext(input_id=input_id, trajectory_id=traj, data=data)
        vector = self.vector(k)
        rows: dict[str, Row] = {}
        done: dict[str, asyncio.Future] = {
            n: asyncio.get_running_loop().create_future() for n in self.order
        }
        priority = (k, index, traj)

        async def run_node(name: str) -> None:
            node = self.graph.nodes[name]
            deps_ok = [await done[d] for d in node.inputs]
            if not all(deps_ok):
                done[name].set_result(False)  # an upstream branch ended: so does this one
                return
            try:
                if node.when is not None and not node.when(ctx):
                    done[name].set_result(False)
                    return
                prompt = node.prompt(ctx)
            except Exception as exc:  # noqa: BLE001 - user code
                raise EpisodeFailure(f"node {name!r}: prompt builder raised {exc!r}") from exc
            if not isinstance(prompt, NodePrompt):
                raise EpisodeFailure(f"node {name!r}: prompt builder returned "
                                     f"{type(prompt).__name__}, not NodePrompt")
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
            result = await self.rollout.generate(request, priority)
            self.store.set_generated(
                agent, sample_id,
                {"prompt": request.prompt, "response": result.tokens,
                 "allowed": prompt.allowed_tokens, "temperature": request.temperature},
                {"logprobs": np.asarray(result.logprobs, dtype=np.float32)},
            )
            ctx.outputs[name] = result.tokens
            done[name].set_result(True)

        tasks = [asyncio.ensure_future(run_node(n)) for n in self.order]
        error: str | None = None
        try:
            await asyncio.gather(*tasks)
            rewards = self._score(ctx, rows)
        except EpisodeFailure as exc:
            error = str(exc)
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
        self._maybe_group_ready(it, input_id)
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
                team = float(self.graph.episode_reward(ctx))
            except Exception as exc:  # noqa: BLE001
                raise EpisodeFailure(f"episode reward raised {exc!r}") from exc
        own: dict[str, float] = {}
        for name in rows:
            node = self.graph.nodes[name]
            own[name] = 0.0
            if node.reward is not None:
                try:
                    own[name] = float(node.reward(ctx))
                except Exception as exc:  # noqa: BLE001
                    raise EpisodeFailure(f"node {name!r}: reward raised {exc!r}") from exc
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
        it.groups_done.add(int(input_id.split("-")[1]))
        for agent in self.agents:
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
        rng = np.random.default_rng(stable_seed(self.cfg.seed, "inputs", k))
        inputs = self.task.sample_inputs(rng, n_inputs)
        if len(inputs) != n_inputs:
            raise GraphError(f"task returned {len(inputs)} inputs, expected {n_inputs}")
        episodes = [
            self.run_episode(it, i, j, inputs[i])
            for i in range(n_inputs) for j in range(group)
        ]
        await asyncio.gather(*episodes)
        end = getattr(self.rollout, "end_iteration", None)
        if end is not None:  # e.g. the balancer re-plans from this iteration's demand
            end(k)
        return it

    # --- training ----------------------------------------------------------------------------
    def _samples(self, rows: list[Row]) -> list[Sample]:
        return [
            Sample(
                sample_id=r.sample_id, prompt=r.data["prompt"], response=r.data["response"],
                old_logprobs=self.store.fetch(r, "logprobs").tolist(),
                advantage=r.data["advantage"], allowed=r.data["allowed"],
                temperature=r.data["temperature"], policy_version=r.policy_version,
                reward=r.data["reward"],
            )
            for r in rows
        ]

    async def train_iteration(self, agent: str, k: int) -> None:
        """Consume agent's rows of version k in canonical micro-batches, then step.

        A micro-batch is m complete groups (~micro_batch_size rows). In deterministic mode (and
        in sync mode, where all groups are complete anyway) micro-batch j is groups
        [j*m, (j+1)*m), so the split and the summation order of gradients never depend on
        timing and sync and async runs agree bitwise; otherwise the first m groups to complete
        go first, so training starts as early as possible.
        """
        it = self.iterations[k]
        n_inputs = self.cfg.train.inputs_per_iteration
        nodes = [n for n in self.order if self.graph.nodes[n].agent == agent]
        per_group = max(1, self.cfg.train.group_size * len(nodes))
        groups_per_mb = max(1, self.cfg.train.micro_batch_size // per_group)
        changed = self._changed_event(agent)
        vector = self.vector(k)
        table = self.store.table(agent)
        canonical = self.cfg.runtime.deterministic or self.cfg.pipeline.mode == "sync"
        taken: set[int] = set()
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
            rows = self.store.take_ready(agent, k, len(ids), step=k, expected_vector=vector,
                                         sample_ids=ids)
            self.consumed[agent][k].extend(r.sample_id for r in rows)
            self.audit[agent].extend((r.sample_id, r.policy_version, k) for r in rows)
            await self.train.accumulate(agent, self._samples(rows))
            self.store.release(rows)
        metrics, weights = await self.train.step(agent)
        if metrics.get("skipped"):
            self.telemetry.event("step_skipped", agent=agent, iteration=k)
        it.trained[agent] = metrics
        await self._publish(agent, k + 1, weights)
        self.store.evict(agent, k)
        it.train_done[agent] = self.telemetry.now()

    async def _publish(self, agent: str, version: int, weights: Weights) -> None:
        await self.rollout.publish(agent, version, weights)
        self.versions[agent] = version
        self._gate(agent, version).set()

    # --- drivers -----------------------------------------------------------------------------
    async def run(self) -> list[dict[str, Any]]:
        self._start = self._last_done = self.telemetry.now()
        # Version 0 comes from the trainers, so rollout and training start from the same weights.
        for agent in self.trainable:
            await self.rollout.publish(agent, 0, await self.train.weights(agent))
        iterations = self.cfg.train.iterations
        if self.cfg.pipeline.mode == "sync":
            for k in range(iterations):
                await self.rollout_iteration(k)
                await asyncio.gather(*(self.train_iteration(a, k) for a in self.trainable))
                self._finish_iteration(k)
        else:
            await asyncio.gather(self._async_rollouts(iterations), self._async_trainers(iterations))
        return self.records

    async def _async_rollouts(self, iterations: int) -> None:
        pending: list[asyncio.Task] = []
        for k in range(iterations):
            task = asyncio.ensure_future(self.rollout_iteration(k))
            pending.append(task)
            # Iteration k+1 only needs k's rollout to be complete: every agent's version k+1
            # depends on all of k's rows, so starting earlier could not run anything sooner.
            await self.iterations_ready(k)
        await asyncio.gather(*pending)

    async def iterations_ready(self, k: int) -> None:
        while k not in self.iterations:
            await asyncio.sleep(0)
        await self.iterations[k].rollout_done.wait()

    async def _async_trainers(self, iterations: int) -> None:
        async def trainer(agent: str) -> None:
            for k in range(iterations):
                while k not in self.iterations:
                    await asyncio.sleep(0.001)
                await self.train_iteration(agent, k)
                self._maybe_finish(k)

        await asyncio.gather(*(trainer(a) for a in self.trainable))
        for k in range(iterations):
            self._maybe_finish(k)

    def _maybe_finish(self, k: int) -> None:
        it = self.iterations[k]
        if it.rollout_done.is_set() and all(a in it.train_done for a in self.trainable):
            if not any(r["iteration"] == k for r in self.records):
                self._finish_iteration(k)

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
        for agent in self.agents:
            rewards = it.rewards.get(agent, [])
            record[f"agent/{agent}/reward_mean"] = float(np.mean(rewards)) if rewards else 0.0
            record[f"agent/{agent}/policy_version"] = self.versions[agent]
            record[f"agent/{agent}/rows_trained"] = len(self.consumed[agent].get(k, []))
            for key, value in it.trained.get(agent, {}).items():
                record[f"agent/{agent}/{key}"] = value
        if it.errors:
            record["errors"] = it.errors
        self.records.append(record)
        self.telemetry.log(record)
        if self.on_iteration is not None:
            self.on_iteration(record)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
