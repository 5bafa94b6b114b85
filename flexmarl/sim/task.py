"""A simulated workload as the production orchestrator sees it: a RunConfig and a Task.

The graph is the workload's unrolled episode DAG (one MEG node per `EpisodeNode`). Tokens are
`SyntheticTokens`: only their number matters to the cost model, so none are materialised.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from flexmarl.config.schema import RunConfig, config_from_dict
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt
from flexmarl.graph.task import Task
from flexmarl.policy.model import stable_seed
from flexmarl.sim.cost import keyed_uniform
from flexmarl.sim.workload import Workload


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
        return iter(())  if self.n == 0 else (0 for _ in range(self.n))

    def __repr__(self) -> str:
        return f"SyntheticTokens({self.n})"


def _node_name(node_id: str) -> str:
    # MEG node names may not contain '_' (it separates sample_id parts)
    return node_id.replace("_", "-")


def workload_task(wl: Workload) -> Task:
    graph = MEG()
    for node in wl.episode_nodes():
        agent = wl.agent(node.agent)

        def prompt(ctx: EpisodeContext, node=node, agent=agent) -> NodePrompt:
            n = agent.prompt_length.draw(keyed_uniform(wl.seed, "prompt", ctx.input_id,
                                                       node.id))
            if agent.append_inputs:
                n += sum(len(ctx.outputs[_node_name(i)]) for i in node.inputs
                         if _node_name(i) in ctx.outputs)
            # max_new_tokens is the distribution's cap; the simulated engine draws the length
            return NodePrompt(SyntheticTokens(n), int(agent.output_length.upper))  # type: ignore[arg-type]

        graph.node(_node_name(node.id), agent=node.agent, prompt=prompt,
                   inputs=[_node_name(i) for i in node.inputs])

    def reward(ctx: EpisodeContext) -> float:
        # A keyed coin: rewards only shape advantages, which the simulator does not time.
        return float(stable_seed(wl.seed, "reward", ctx.input_id, ctx.trajectory_id) % 2)

    graph.set_episode_reward(reward)

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        return [{} for _ in range(n)]

    return Task(graph=graph, vocab_size=1, sample_inputs=sample_inputs,
                info={"workload": wl.name})


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
        "runtime": {"kind": "sim"},
    }, f"workload {wl.name}")
