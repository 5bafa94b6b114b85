"""A simulated workload as the production orchestrator sees it: a RunConfig and a Task.

The graph is the workload's unrolled episode DAG (one MEG node per `EpisodeNode`). Tokens are
`SyntheticTokens`: only their number matters to the cost model, so none are materialised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from flexmarl.config.schema import RunConfig, config_from_dict
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt
from flexmarl.graph.task import RANDOM_MODEL_SEQ_LEN, Task
from flexmarl.policy.model import stable_seed
from flexmarl.sim.lengths import keyed_uniform
from flexmarl.sim.workload import EpisodeNode, Workload


class SyntheticTokens(Sequence[int]):
    """`n` placeholder tokens (all 0) that cost O(1) memory."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = max(0, int(n))

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> SyntheticTokens: ...
    def __getitem__(self, i: int | slice) -> int | SyntheticTokens:
        if isinstance(i, slice):
            return SyntheticTokens(len(range(*i.indices(self.n))))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return 0

    def __iter__(self) -> Iterator[int]:
        # the orchestrator counts distinct responses (tuple(tokens)): iterate in C
        return itertools.repeat(0, self.n)

    def __repr__(self) -> str:
        return f"SyntheticTokens({self.n})"


def _node_name(node_id: str) -> str:
    # MEG node names may not contain '_' (it separates sample_id parts)
    return node_id.replace("_", "-")


# conditional draws per episode beyond which the variants are not enumerated
MAX_CONDITIONAL_DRAWS = 12


class _Draws:
    """Stands in for `Workload.episode_nodes`' rng: its `random()` calls return `values` in
    order (one per conditional edge and round)."""

    def __init__(self, values: Sequence[float]) -> None:
        self._values = iter(values)

    def random(self) -> float:
        return next(self._values)


def _conditional_draws(wl: Workload) -> int:
    """How many `random()` calls `episode_nodes` makes: one per round and conditional edge."""
    return wl.graph.rounds * sum(1 for e in wl.graph.edges if e.probability < 1.0)


def episode_variants(wl: Workload) -> tuple[list[tuple[str, EpisodeNode, tuple[str, ...]]],
                                            Callable[[str, int], frozenset[str]],
                                            frozenset[str]]:
    """The MEG nodes of a workload with conditional edges, and which of them an episode runs.

    A node's inputs differ between episodes when conditional edges are drawn (a supervisor
    reads whichever specialists the router consulted), and the MEG's inputs are fixed, so
    each node appears once per set of inputs it can have (``name``, ``name-v2``, ...), each
    run only in the episodes that draw it. The draws are keyed by the workload's seed, the
    input and the trajectory, so every simulated system sees the same episodes.

    Returns (MEG name, node, MEG input names) in topological order, a function from
    (input_id, trajectory) to the set of MEG names that episode runs, and the names every
    episode runs.
    """
    n = _conditional_draws(wl)
    if n == 0:
        nodes = [(_node_name(nd.id), nd, tuple(_node_name(i) for i in nd.inputs))
                 for nd in wl.episode_nodes()]
        every = frozenset(name for name, _, _ in nodes)
        return nodes, lambda input_id, traj: every, every
    if n > MAX_CONDITIONAL_DRAWS:
        raise ValueError(f"workload {wl.name}: {n} conditional edge draws per episode; the "
                         f"simulator enumerates at most {MAX_CONDITIONAL_DRAWS}")
    names: dict[tuple[str, tuple[str, ...]], str] = {}  # (node id, MEG inputs) -> MEG name
    count: dict[str, int] = {}
    out: list[tuple[str, EpisodeNode, tuple[str, ...]]] = []
    runs: dict[tuple[bool, ...], frozenset[str]] = {}
    for combo in itertools.product((True, False), repeat=n):
        # 0.0 < p takes an edge, 1.0 < p never does
        episode = wl.episode_nodes(_Draws([0.0 if keep else 1.0 for keep in combo]))
        meg: dict[str, str] = {}
        for nd in episode:
            inputs = tuple(meg[i] for i in nd.inputs)
            key = (nd.id, inputs)
            if key not in names:
                count[nd.id] = count.get(nd.id, 0) + 1
                k = count[nd.id]
                names[key] = _node_name(nd.id) + ("" if k == 1 else f"-v{k}")
                out.append((names[key], nd, inputs))
            meg[nd.id] = names[key]
        runs[combo] = frozenset(meg.values())
    # topological: a variant's inputs were named in an earlier combo or earlier in this one;
    # order by the full graph's node order, then by first appearance
    rank = {nd.id: i for i, nd in enumerate(wl.episode_nodes())}
    out.sort(key=lambda item: rank[item[1].id])
    probs = [e.probability for _ in range(wl.graph.rounds) for e in wl.graph.edges
             if e.probability < 1.0]

    drawn: dict[tuple[str, int], frozenset[str]] = {}  # every node asks: draw once

    def running(input_id: str, traj: int) -> frozenset[str]:
        key = (input_id, traj)
        out = drawn.get(key)
        if out is None:
            combo = tuple(keyed_uniform(wl.seed, "edge", input_id, traj, j) < p
                          for j, p in enumerate(probs))
            out = drawn[key] = runs[combo]
            if len(drawn) > 65536:  # episodes of iterations long gone
                drawn.pop(next(iter(drawn)))
        return out

    return out, running, frozenset.intersection(*runs.values())


def workload_task(wl: Workload) -> Task:
    graph = MEG()
    variants, running, always = episode_variants(wl)
    for name, node, inputs in variants:
        agent = wl.agent(node.agent)

        def prompt(ctx: EpisodeContext, node=node, agent=agent, inputs=inputs) -> NodePrompt:
            n = agent.prompt_length.draw(keyed_uniform(wl.seed, "prompt", ctx.input_id,
                                                       node.id))
            if agent.append_inputs:
                n += sum(len(ctx.outputs[i]) for i in inputs if i in ctx.outputs)
            # max_new_tokens is the distribution's cap; the simulated engine draws the length
            return NodePrompt(SyntheticTokens(n), int(agent.output_length.upper))  # type: ignore[arg-type]

        def when(ctx: EpisodeContext, name=name) -> bool:
            return name in running(ctx.input_id, ctx.trajectory_id)

        # the draws are keyed by the episode, not by outputs: decided at its start
        graph.node(name, agent=node.agent, prompt=prompt, inputs=list(inputs),
                   when=None if name in always else when, static_when=True)

    def reward(ctx: EpisodeContext) -> float:
        # A keyed coin: rewards only shape advantages, which the simulator does not time.
        return float(stable_seed(wl.seed, "reward", ctx.input_id, ctx.trajectory_id) % 2)

    graph.set_episode_reward(reward)

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        return [{} for _ in range(n)]

    return Task(graph=graph, vocab_size=1, sample_inputs=sample_inputs,
                max_seq_len=RANDOM_MODEL_SEQ_LEN, info={"workload": wl.name})


def workload_config(wl: Workload, *, mode: str, schedule: str = "dependency",
                    iterations: int | None = None) -> RunConfig:
    agents = {a.name: {"trainable": a.trainable} for a in wl.agents}
    return config_from_dict({
        "name": wl.name,
        "seed": wl.seed,
        "task": {"builder": "flexmarl.sim.task:workload_task"},
        "agents": agents,
        "train": {
            "iterations": iterations or wl.iterations,
            "inputs_per_iteration": wl.rollout.prompts_per_iteration,
            "group_size": wl.rollout.group_size,
            "micro_batch_size": wl.micro_batch_size,
        },
        "pipeline": {"mode": mode},
        "rollout": {"schedule": schedule},
        "runtime": {"kind": "sim", **({"slot_sizes": list(wl.training.slot_sizes)}
                                       if wl.training.slot_sizes else {})},
    }, f"workload {wl.name}")
