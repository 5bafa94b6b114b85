"""Episodes along the graph: each iteration's inputs, every episode's nodes run as their
inputs and their agent's version exist, credit assignment, group advantages, and the
iteration state the training driver and the metrics read.

The rollout half of the joint orchestrator (`joint.py` composes it with the training driver,
the versions, the checkpoint coordinator and a schedule).
"""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.api.runtime import RolloutPool
from flexmarl.config.schema import CreditConfig, GRPOConfig, RunConfig
from flexmarl.errors import UserError
from flexmarl.graph import contracts
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.executor import GraphExecutor, NodeCall, TaskCodeError
from flexmarl.graph.meg import MEG, EpisodeContext, GraphError
from flexmarl.graph.task import Task
from flexmarl.orchestrator.networks import NetworkActors, NetworkAgentError
from flexmarl.orchestrator.versions import Versions
from flexmarl.policy.model import stable_seed
from flexmarl.policy.tokenizer import model_vocab
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
from flexmarl.training.algorithms import grpo
from flexmarl.types import GenerationRequest


class EpisodeFailure(RuntimeError):
    """An episode's credited reward is not a finite number (the task's own functions raising
    are `graph.executor.TaskCodeError`)."""


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
    # rewards by the true class of their node (`MEG.node(label=...)`): a judge's accuracy per
    # class, where one verdict for every input shows as 1 on one class and 0 on the other
    label_rewards: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    # per node: an agent acting at several nodes (a judge that recomputes, then compares)
    node_rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
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
    # algorithm.normalize agent / batch: set once every group of the iteration is in and the
    # rows of those agents are normalised over the whole iteration (and ready)
    wide_ready: bool = False
    plan: dict[str, Any] | None = None
    # pool figures of the iteration beside the trace's (runtime.colocate: sleep and wake)
    pool_stats: dict[str, float] = field(default_factory=dict)
    # rollout.schedule=stage: node tasks still unresolved per graph level, and one event per
    # level that opens when every lower level is resolved in every episode
    stage_left: list[int] = field(default_factory=list)
    stage_open: list[asyncio.Event] = field(default_factory=list)
    # what the agents said: a few rows per agent (logging.samples_per_agent), for samples.jsonl
    samples: list[dict[str, Any]] = field(default_factory=list)
    # dynamic sampling: input slot i's group of round r has input index r * n_inputs + i; the
    # rounds launched per slot, each round's fresh inputs, the episodes still to await, and
    # the rows dropped per agent because their group's rewards all agreed
    n_inputs: int = 0
    rounds: dict[int, int] = field(default_factory=dict)
    round_inputs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    pending: list[asyncio.Future] = field(default_factory=list)
    rows_filtered: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def slot_groups(self, slot: int) -> list[str]:
        """The input ids of slot `slot`'s groups, the original first, then its replacements."""
        n = self.n_inputs
        return [f"{self.index}-{r * n + slot}" for r in range(self.rounds.get(slot, 0) + 1)]

    def original(self, input_id: str) -> bool:
        """One of the iteration's own inputs (not a dynamic-sampling replacement): rewards and
        success are reported over these, so curves compare across settings."""
        return int(input_id.split("-")[1]) < self.n_inputs


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


def truncated(request: GenerationRequest, tokens: list[int]) -> bool:
    """The budget, not the model, ended this completion: it used every token of a node that
    has a stop condition and did not end on a stop token. (A stop string ends a text node's
    completion early, so a full-length one ended by a string is rare: it counts as cut.)"""
    has_stop = bool(request.stop_tokens or request.stop)
    return (has_stop and len(tokens) >= request.max_new_tokens
            and not (tokens and tokens[-1] in request.stop_tokens))


def graph_levels(graph: MEG, order: list[str]) -> dict[str, int]:
    """Graph level of each node: 0 without inputs, else one more than its deepest input."""
    level: dict[str, int] = {}
    for name in order:  # topological
        inputs = graph.nodes[name].inputs
        level[name] = 1 + max((level[i] for i in inputs), default=-1)
    return level


def downstream_hops(graph: MEG) -> dict[str, dict[str, int]]:
    """For each node, the nodes that (transitively) consume its output, by fewest hops."""
    consumers: dict[str, list[str]] = {n: [] for n in graph.nodes}
    for name, node in graph.nodes.items():
        for dep in node.inputs:
            consumers[dep].append(name)
    out: dict[str, dict[str, int]] = {}
    for start in graph.nodes:
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


@dataclass(eq=False)
class EpisodeRunner:
    """Runs iterations' episodes against the rollout pool and writes their rows to the store.

    `on_group_ready` is called whenever all trajectories of an input are in (their rows are
    READY): the training driver's wake-up. `start_iteration` and `restored` come from a
    checkpoint: episodes of the first iteration that had finished before it are replayed from
    their rows instead of generated again."""

    cfg: RunConfig
    task: Task
    store: ExperienceStore
    rollout: RolloutPool
    telemetry: Telemetry
    versions: Versions
    trainable: list[str]
    on_group_ready: Callable[[], None]
    # network-policy agents (hybrid graphs): their nodes act in the episode's environment
    networks: NetworkActors | None = None

    def __post_init__(self) -> None:
        self.graph = self.task.graph
        # text- and chat-level nodes: each agent's tokenizer and sampling defaults
        self.renderer = PromptRenderer(self.cfg.agents, self.task.vocab_size)
        self.executor = GraphExecutor(self.graph, self.renderer, self.cfg.agents.keys())
        self.order = self.executor.order
        self.turns = self.graph.turn_of()
        self.level = graph_levels(self.graph, self.order)
        self.downstream = downstream_hops(self.graph)
        self.iterations: dict[int, IterationState] = {}
        self._started: dict[int, asyncio.Event] = {}
        self.start_iteration = 0
        self.restored: dict[tuple[int, int], list[dict[str, Any]]] = {}
        # resumed: per iteration before the checkpoint, each agent's reward (mean, std) from
        # its records (`normalize: agent_previous`)
        self.resumed_stats: dict[int, dict[str, tuple[float, float]]] = {}
        self.first_error: str | None = None
        # the simulator's synthetic prompts (placeholder ids, any length) feed no real model
        self._check_prompts = self.cfg.runtime.kind != "sim"
        # between iterations: the planner's plan for the next one (set by the orchestrator),
        # merged into the iteration's recorded plan
        self.plan_next: Callable[[IterationState], dict[str, Any] | None] | None = None

    async def run_episode(
        self, it: IterationState, index: int, traj: int, data: dict[str, Any]
    ) -> None:
        k = it.index
        input_id = f"{k}-{index}"
        ctx = EpisodeContext(input_id=input_id, trajectory_id=traj, data=data)
        restored = self.restored.pop((index, traj), None) if k == self.start_iteration else None
        if restored is not None:  # finished before the checkpoint: its rows, not a re-run
            self._replay_episode(it, ctx, restored)
            return
        vector = self.versions.vector(k)
        rows: dict[str, Row] = {}
        skipped = self.executor.skipped_at_start(ctx)
        priority = (k, index, traj)
        episode_start = self.telemetry.now()

        async def call(node: NodeCall) -> list[int]:
            if node.segment is not None or self.cfg.agents[node.agent].network is not None:
                return await self._segment(it, ctx, node, vector, rows, step_rewards)
            name, agent, prompt = node.name, node.agent, node.prompt
            # wrong types, token ids outside the vocabulary, empty or over-long prompts, a zero
            # budget: a bug in the task, not a flaky episode: stop the run with the node named
            if self._check_prompts:
                contracts.check_prompt(name, agent, prompt, self._vocab(agent, node.is_text),
                                       self.task.max_seq_len)
            if it.stage_open:  # rollout.schedule=stage: the level barrier
                await it.stage_open[self.level[name]].wait()
            version = vector[agent]
            await self.versions.gate(agent, version).wait()
            sample_id = make_sample_id(input_id, self.turns[name], traj)
            rows[name] = self.store.add(Row(
                sample_id=sample_id, agent=agent, node=name, input_id=input_id,
                turn=self.turns[name], trajectory_id=traj, iteration=k,
                policy_version=version, version_vector=vector,
            ))
            acfg = self.cfg.agents[agent]
            request = GenerationRequest(
                sample_id=sample_id, agent=agent, version=version, prompt=prompt.tokens,
                max_new_tokens=prompt.max_new_tokens, allowed_tokens=prompt.allowed_tokens,
                stop_tokens=prompt.stop_tokens, temperature=acfg.sampling.temperature,
                seed=self.cfg.seed, stop=list(prompt.stop), top_p=acfg.sampling.top_p,
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
                 "allowed": prompt.allowed_tokens, "temperature": request.temperature,
                 "truncated": truncated(request, result.tokens),
                 **({"stop": list(prompt.stop)} if node.is_text else {})},
                {"logprobs": result.logprobs if isinstance(result.logprobs, TensorRef)
                 else np.asarray(result.logprobs, dtype=np.float32)},
            )
            return result.tokens

        step_rewards: dict[str, float] = {}

        def count_level(name: str, task: asyncio.Task) -> None:
            # ran, skipped, failed or cancelled with its episode: the stage barrier counts it
            task.add_done_callback(functools.partial(self._node_resolved, it, self.level[name]))

        if it.stage_open:
            for n in skipped:
                self._resolved(it, self.level[n])
        error: str | None = None
        try:
            await self.executor.run(ctx, call, skip=skipped,
                                    on_task=count_level if it.stage_open else None)
            rewards = self._score(ctx, rows, step_rewards)
            labels = self.executor.node_labels(ctx, rows)
        except (TaskCodeError, EpisodeFailure) as exc:
            error = str(exc)
        except UserError:  # a contract violation (graph/contracts.py): the run stops, exit 2
            raise
        except Exception as exc:  # noqa: BLE001 - worker or user failure: fail this episode only
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            self._failed(it, ctx, rows, error)
        else:
            for name, row in rows.items():
                self.store.set_rewarded(row.agent, row.sample_id, rewards[name],
                                        labels.get(name))
                if it.original(input_id):
                    it.rewards[row.agent].append(rewards[name])
                    it.node_rewards[name].append(rewards[name])
                    if name in labels:
                        it.label_rewards[row.agent][labels[name]].append(rewards[name])
                if row.agent not in self.trainable:  # no advantage will come: show it now
                    self._keep_sample(it, row, None)
            if it.original(input_id):
                it.successes += int(bool(self.executor.success(ctx)))
        it.groups[input_id].append({n: r.sample_id for n, r in rows.items()} if error is None
                                   else {})
        it.episode_latency.append(self.telemetry.now() - episode_start)
        self._maybe_group_ready(it, input_id)
        it.episodes_done += 1
        if it.episodes_done == it.episodes_total:
            self._rollout_finished(it)

    async def _segment(self, it: IterationState, ctx: EpisodeContext, node: NodeCall,
                       vector: dict[str, int], rows: dict[str, Row],
                       step_rewards: dict[str, float]) -> list[int]:
        """A network agent's node: its segment of steps in the episode's environment, one
        row of its table (the arrays its learner trains on)."""
        name, agent = node.name, node.agent
        if node.segment is None or self.networks is None or agent not in self.networks:
            kind = "a network policy" if node.segment is None else "an LLM"
            what = "a prompt" if node.segment is None else "an EnvSegment"
            raise NetworkAgentError(f"node {name!r}: agent {agent!r} is {kind}, but the "
                                    f"node's prompt builder returned {what}")
        if it.stage_open:
            await it.stage_open[self.level[name]].wait()
        version = vector[agent]
        await self.versions.gate(agent, version).wait()
        sample_id = make_sample_id(ctx.input_id, self.turns[name], ctx.trajectory_id)
        rows[name] = self.store.add(Row(
            sample_id=sample_id, agent=agent, node=name, input_id=ctx.input_id,
            turn=self.turns[name], trajectory_id=ctx.trajectory_id, iteration=it.index,
            policy_version=version, version_vector=vector,
        ))
        started = self.telemetry.now()
        seg = await self.networks.run_segment(agent, version, node.segment, sample_id)
        it.node_latency[name].append(self.telemetry.now() - started)
        step_rewards[name] = seg.reward_sum
        self.store.set_generated(agent, sample_id,
                                 {"prompt": [], "response": seg.actions,
                                  "step_reward": seg.reward_sum}, seg.arrays)
        return seg.actions

    def _failed(self, it: IterationState, ctx: EpisodeContext, rows: dict[str, Row],
                error: str) -> None:
        """A failed episode: its rows failed (none trained), counted and reported."""
        for row in rows.values():
            if row.status in (Status.PENDING, Status.GENERATED, Status.REWARDED):
                self.store.set_failed(row.agent, row.sample_id, error)
        it.episodes_failed += 1
        where = f"episode {ctx.input_id}/{ctx.trajectory_id}"
        if self.first_error is None:
            self.first_error = f"iteration {it.index}, {where}: {error}"
        if len(it.errors) < 5:
            it.errors.append(error)
        self.telemetry.event("episode_failed", iteration=it.index, input_id=ctx.input_id,
                             trajectory=ctx.trajectory_id, error=error)

    def _node_resolved(self, it: IterationState, level: int, _task: asyncio.Future) -> None:
        self._resolved(it, level)

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
        if self.plan_next is not None:  # the planner, from what this iteration measured
            measured = self.plan_next(it)
            if measured is not None:
                it.plan = {**(it.plan or {}), **measured}
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
            if "stop" in d["data"]:  # a text-level node: the same decoding as the first time
                ctx.texts[row.node] = self.renderer.decode(
                    row.agent, ctx.outputs[row.node], list(d["data"]["stop"]))
            if it.original(ctx.input_id):
                it.rewards[row.agent].append(float(d["data"]["reward"]))
                it.node_rewards[row.node].append(float(d["data"]["reward"]))
                if "label" in d["data"]:
                    it.label_rewards[row.agent][d["data"]["label"]].append(
                        float(d["data"]["reward"]))
        if it.original(ctx.input_id):
            it.successes += int(bool(self.executor.success(ctx)))
        it.groups[ctx.input_id].append({n: r.sample_id for n, r in rows.items()})
        if it.stage_open:
            for name in self.order:
                self._resolved(it, self.level[name])
        self._maybe_group_ready(it, ctx.input_id)
        it.episodes_done += 1
        if it.episodes_done == it.episodes_total:
            it.rollout_finished_at = self.telemetry.now()
            it.rollout_done.set()

    def _score(self, ctx: EpisodeContext, rows: dict[str, Row],
               step_rewards: dict[str, float] | None = None) -> dict[str, float]:
        """Credit assignment across the graph (`train.credit`): each node that ran gets
        team * team reward + node * its own reward + a discounted share of the own rewards of
        the nodes downstream of it (upstream_discount ** hops). A network node without a
        `reward=` of its own has the sum of its step rewards as its own reward."""
        team = self.executor.team_reward(ctx)
        own = self.executor.node_rewards(ctx, rows)
        for name, total in (step_rewards or {}).items():
            if self.graph.nodes[name].reward is None:
                own[name] = total
        out = assign_credit(team, own, self.downstream, self.cfg.train.credit)
        for name, value in out.items():
            if not np.isfinite(value):
                raise EpisodeFailure(f"node {name!r}: reward is not finite ({value})")
        return out

    def _maybe_group_ready(self, it: IterationState, input_id: str) -> None:
        """When all G trajectories of an input are in, compute group advantages per node; a
        dynamic-sampling agent's group whose rewards all agree is dropped and, rounds left,
        its input slot gets a fresh group. A slot is done when its last group is in."""
        group = it.groups[input_id]
        if len(group) < self.cfg.train.group_size:
            return
        # Trajectory order, not completion order: advantages and the row order inside
        # micro-batches (hence float summation order) then never depend on timing, so a resumed
        # or recovered run (whose episodes finish in another order) equals an uninterrupted one.
        group.sort(key=lambda g: min((parse_sample_id(s)[2] for s in g.values()), default=-1))
        agreed = False
        for name in self.order:
            ids = [g[name] for g in group if name in g]
            if not ids:
                continue
            agent = self.graph.nodes[name].agent
            if agent not in self.trainable or self.normalize(agent) in ("agent", "batch"):
                continue
            table = self.store.table(agent)
            rewards = [table.get(i).data["reward"] for i in ids]
            if self.cfg.agents[agent].network is not None:
                # per-step advantages come from GAE in the learner (they need its critic's
                # value normaliser); the row's scalar is its credited reward
                for sid, reward in zip(ids, rewards, strict=True):
                    self._set_ready(it, agent, sid, reward)
                continue
            algo_cfg = self.cfg.agents[agent].algorithm
            previous = (self.previous_stats(it.index, agent, name)
                        if self.normalize(agent) == "agent_previous" else None)
            if previous is not None:
                assert isinstance(algo_cfg, GRPOConfig)  # normalize is a GRPO option
                for sid, adv in zip(ids, grpo.baseline_advantages(rewards, *previous, algo_cfg),
                                    strict=True):
                    self._set_ready(it, agent, sid, adv)
                continue
            if getattr(algo_cfg, "dynamic_sampling", False) and len(set(rewards)) == 1:
                agreed = True
                for sid in ids:
                    self.store.set_failed(agent, sid, "dynamic sampling: the group's rewards "
                                                      f"all agree ({rewards[0]:g})")
                it.rows_filtered[agent] += len(ids)
                continue
            advs = algorithms.get(algo_cfg.name).sequence_advantages(rewards, algo_cfg)
            for sid, adv in zip(ids, advs, strict=True):
                self._set_ready(it, agent, sid, adv)
        index = int(input_id.split("-")[1])
        slot, rnd = index % it.n_inputs, index // it.n_inputs
        if agreed and rnd < self.cfg.train.resample_rounds:
            self._resample(it, slot, rnd + 1)
            return
        it.groups_done.add(slot)
        self.on_group_ready()
        if len(it.groups_done) == it.n_inputs:
            self._normalize_wide(it)

    def _resample(self, it: IterationState, slot: int, rnd: int) -> None:
        """Dynamic sampling: a fresh group for input slot `slot`, round `rnd`. Its input is
        the slot's entry of the round's own draw (seeded by iteration and round), so which
        input replaces which never depends on the order groups finished in."""
        if rnd not in it.round_inputs:
            it.round_inputs[rnd] = self._draw_inputs(it.index, it.n_inputs, "resample", rnd)
        it.rounds[slot] = rnd
        group = self.cfg.train.group_size
        it.episodes_total += group
        for name in self.order:
            if it.stage_left:
                it.stage_left[self.level[name]] += group
        index = rnd * it.n_inputs + slot
        data = it.round_inputs[rnd][slot]
        self.telemetry.event("group_resampled", iteration=it.index, slot=slot, round=rnd)
        it.pending.extend(asyncio.ensure_future(self.run_episode(it, index, j, data))
                          for j in range(group))

    def _draw_inputs(self, k: int, n: int, *stream: Any) -> list[dict[str, Any]]:
        """Iteration k's n inputs from the task (a replacement round's: `stream` names it)."""
        rng = np.random.default_rng(stable_seed(self.cfg.seed, "inputs", k, *stream))
        try:
            inputs = self.task.sample_inputs(rng, n)
        except Exception as exc:  # noqa: BLE001 - user code
            raise contracts.ContractError(f"task {self.cfg.task_config.builder}: sample_inputs "
                                          f"raised {type(exc).__name__}: {exc}") from exc
        contracts.check_inputs(self.cfg.task_config.builder, inputs)
        if len(inputs) != n:
            raise GraphError(f"task returned {len(inputs)} inputs, expected {n}")
        return inputs

    def _set_ready(self, it: IterationState, agent: str, sample_id: str, adv: float) -> None:
        self._keep_sample(it, self.store.set_ready(agent, sample_id, adv), adv)

    def _keep_sample(self, it: IterationState, row: Row, advantage: float | None) -> None:
        """Rows of the first trajectory of the iteration's first `logging.samples_per_agent`
        inputs, as the agent saw and said them (decoded for text-level nodes): chosen by
        position, so two runs of one seed show the same samples."""
        index = int(row.input_id.split("-")[1])
        if row.trajectory_id != 0 or index >= self.cfg.logging.samples_per_agent:
            return
        prompt: Any = list(row.data["prompt"])
        answer: Any = list(row.data["response"])
        if "stop" in row.data:  # a text-level node: its agent has a tokenizer
            tok = self.renderer.tokenizer(row.agent)
            prompt, answer = tok.decode(prompt), tok.decode(answer)
        it.samples.append({
            "iteration": it.index, "agent": row.agent, "node": row.node,
            "input_id": row.input_id, "prompt": prompt, "answer": answer,
            "answer_tokens": len(row.data["response"]), "reward": row.data.get("reward"),
            "advantage": advantage})

    def normalize(self, agent: str) -> str:
        """`algorithm.normalize` of a GRPO agent (group, agent, batch or agent_previous);
        others: group."""
        if self.cfg.agents[agent].network is not None:
            return "group"
        return getattr(self.cfg.agents[agent].algorithm, "normalize", "group")

    def previous_stats(self, k: int, agent: str, node: str) -> tuple[float, float] | None:
        """`normalize: agent_previous`: the mean and std of `agent`'s rewards (at `node` alone
        when the agent acts at several nodes, as `normalize: agent`) in the iteration whose
        step made the weights iteration k samples with (k - 1; k - 2 in one_step_off), or None
        (the first iterations: group baselines). That iteration's rollout is over by then: the
        agent's step on it preceded these weights. After a resume they come from the
        checkpoint's records."""
        source = k - 1 - self.cfg.pipeline.max_staleness
        if source < 0:
            return None
        per_node = sum(n.agent == agent for n in self.graph.nodes.values()) > 1
        if source in self.resumed_stats:
            return self.resumed_stats[source].get(f"node/{node}" if per_node else agent)
        past = self.iterations.get(source)
        values = past and (past.node_rewards.get(node) if per_node else past.rewards.get(agent))
        if not values:
            return None
        return grpo.reward_stats(values)

    def _normalize_wide(self, it: IterationState) -> None:
        """Every group of the iteration is in: advantages of the agents whose GRPO normalises
        over more than one group. `agent`: over all of the agent's rows of the iteration (its
        own mean and std, Dr. MAS's agent-wise normalisation; an agent acting at several nodes,
        a different job at each, over its rows of each node apart); `batch`: over the rows of
        every trainable agent (one global baseline). Rows of failed episodes take no part."""
        wide = [a for a in self.trainable if self.normalize(a) in ("agent", "batch")]
        if not wide or it.wide_ready:
            it.wide_ready = True
            return
        # per agent, per node: the rows' sample ids, in a fixed order (sync == async)
        ids: dict[str, dict[str, list[str]]] = {a: {} for a in self.trainable}
        for i in range(it.n_inputs):
            for episode in (e for gid in it.slot_groups(i) for e in it.groups[gid]):
                for name, sid in sorted(episode.items()):
                    agent = self.graph.nodes[name].agent
                    if agent in ids:
                        ids[agent].setdefault(name, []).append(sid)
        rewards = {a: {n: [self.store.table(a).get(s).data["reward"] for s in sids]
                       for n, sids in by_node.items()} for a, by_node in ids.items()}
        pooled = [r for a in self.trainable for rs in rewards[a].values() for r in rs
                  if self.cfg.agents[a].network is None]  # LLM agents' rewards only
        for agent in wide:
            algo_cfg = self.cfg.agents[agent].algorithm
            for node, sids in sorted(ids[agent].items()):
                own = rewards[agent][node]
                if getattr(algo_cfg, "balance_labels", False):
                    assert isinstance(algo_cfg, GRPOConfig)  # balance_labels is a GRPO option
                    table = self.store.table(agent)
                    labels = [table.get(s).data.get("label", "") for s in sids]
                    advs = grpo.label_balanced_advantages(own, labels, algo_cfg)
                else:
                    advs = algorithms.get(algo_cfg.name).normalized_advantages(
                        own, pooled if self.normalize(agent) == "batch" else own, algo_cfg)
                for sid, adv in zip(sids, advs, strict=True):
                    self._set_ready(it, agent, sid, adv)
        it.wide_ready = True
        self.on_group_ready()  # the trainers of those agents were waiting for this

    def _vocab(self, agent: str, is_text: bool) -> int:
        """The ids a prompt may hold: the task's vocabulary, or for text-level nodes that of
        the agent's model (its tokenizer was checked to fit it when loaded)."""
        if not is_text:
            return self.task.vocab_size

        return model_vocab(self.cfg.agents[agent].model, self.task.vocab_size)

    async def rollout_iteration(self, k: int) -> IterationState:
        n_inputs = self.cfg.train.inputs_per_iteration
        group = self.cfg.train.group_size
        it = IterationState(index=k, episodes_total=n_inputs * group,
                            started_at=self.telemetry.now(), n_inputs=n_inputs)
        self.iterations[k] = it
        self.started_event(k).set()
        if self.cfg.rollout.schedule == "stage":
            levels = 1 + max(self.level.values(), default=0)
            it.stage_left = [0] * levels
            for name in self.order:
                it.stage_left[self.level[name]] += it.episodes_total
            it.stage_open = [asyncio.Event() for _ in range(levels)]
            it.stage_open[0].set()
        inputs = self._draw_inputs(k, n_inputs)
        episodes = [
            self.run_episode(it, i, j, inputs[i])
            for i in range(n_inputs) for j in range(group)
        ]
        try:
            await asyncio.gather(*episodes)
            while it.pending:  # dynamic sampling's replacement groups, launched as needed
                launched, it.pending = it.pending, []
                await asyncio.gather(*launched)
        finally:
            for fut in it.pending:
                fut.cancel()
        return it

    def started_event(self, k: int) -> asyncio.Event:
        """Set once iteration k's rollout has started (its `IterationState` exists)."""
        if k not in self._started:
            self._started[k] = asyncio.Event()
            if k in self.iterations:
                self._started[k].set()
        return self._started[k]

    async def iterations_ready(self, k: int) -> None:
        await self.started_event(k).wait()
        await self.iterations[k].rollout_done.wait()
