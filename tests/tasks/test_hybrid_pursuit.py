"""The hybrid pursuit task (an LLM coordinator, MAPPO pursuers on MPE): its graph's rates, its
spaces against what the world observes, and its rewards on one episode run in-process."""

import asyncio

import numpy as np
import pytest

from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.executor import GraphExecutor, NodeCall
from flexmarl.graph.meg import EpisodeContext

pytest.importorskip("mpe2")

from flexmarl.config.schema import load_config  # noqa: E402
from flexmarl.orchestrator.networks import NetworkActors  # noqa: E402
from flexmarl.orchestrator.run import prepare  # noqa: E402
from tests.orchestrator.test_hybrid import EXAMPLES  # noqa: E402


def test_one_episode_names_a_landmark_per_segment_and_pursuers_act_every_step():
    cfg = load_config(EXAMPLES / "hybrid_pursuit.yaml",
                      ["task.options={pursuers: 2, segments: 3, segment_steps: 4}",
                       "agents={coordinator: {}, pursuer0: {network: {hidden: [8]}}, "
                       "pursuer1: {network: {hidden: [8]}}}"])
    task = prepare(cfg)  # the spaces go into the agents' configs; a mismatch fails below
    graph = task.graph
    assert [n for n in graph.topological_order() if n.startswith("coordinator")] == \
        ["coordinator-seg0", "coordinator-seg1", "coordinator-seg2"]
    assert graph.nodes["coordinator-seg1"].inputs == ("pursuer0-seg0", "pursuer1-seg0")
    actors = NetworkActors(cfg)
    executor = GraphExecutor(graph, PromptRenderer(cfg.agents, task.vocab_size), cfg.agents)
    data = task.sample_inputs(np.random.default_rng(0), 1)[0]
    ctx = EpisodeContext("0-0", 0, data)

    async def call(node: NodeCall) -> list[int]:
        if node.segment is not None:
            seg = await actors.run_segment(node.agent, 0, node.segment, f"0-0_{node.name}_0")
            # MPE's 12 features for 2 agents, then the named landmark: one-hot 2, position 2
            assert seg.arrays["obs"].shape == (4, 12 + 2 + 2)
            return seg.actions
        goal = ctx.data["goals"][int(node.name[-1])]
        return [node.prompt.allowed_tokens[goal]]  # a coordinator that always knows

    ran = asyncio.run(executor.run(ctx, call))
    assert all(ran.values()) and ctx.env.t == 12 and ctx.env.done
    own = executor.node_rewards(ctx, ran)
    assert [own[f"coordinator-seg{s}"] for s in range(3)] == [1.0, 1.0, 1.0]
    assert executor.success(ctx) is True
    assert -3.0 < executor.team_reward(ctx) < 0.0
