"""The one graph executor: dependency-parallel nodes, branches that end, the task's errors."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.contracts import ContractError
from flexmarl.graph.executor import GraphExecutor, NodeCall, TaskCodeError
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt


def _graph(cond=lambda ctx: ctx.data["go"]) -> MEG:
    g = MEG()
    g.node("a", agent="x", prompt=lambda ctx: NodePrompt([1], 2))
    g.node("b", agent="y", prompt=lambda ctx: NodePrompt([2], 2))
    g.node("c", agent="x", inputs=["a", "b"], when=cond,
           prompt=lambda ctx: NodePrompt(ctx.output("a") + ctx.output("b"), 1),
           reward=lambda ctx: float(len(ctx.output("c"))))
    g.node("d", agent="y", inputs=["c"], prompt=lambda ctx: NodePrompt(ctx.output("c"), 1))
    g.episode_reward = lambda ctx: 1.5
    g.success = lambda ctx: "d" in ctx.outputs
    return g


def _run(graph: MEG, data: dict, call=None, handoff: str = "direct"
         ) -> tuple[dict[str, bool], EpisodeContext, list]:
    ex = GraphExecutor(graph, PromptRenderer({}, 16), ["x", "y"], handoff=handoff)
    ctx = EpisodeContext(input_id="0", trajectory_id=0, data=data)
    started: list[str] = []
    gate = asyncio.Event()

    async def echo(node: NodeCall) -> list[int]:
        started.append(node.name)
        if node.name in ("a", "b"):
            if len(started) == 2:
                gate.set()
            await gate.wait()  # a and b are both in flight before either finishes
        return [t + 1 for t in node.prompt.tokens]

    ran = asyncio.run(ex.run(ctx, call or echo))
    return ran, ctx, started


def test_independent_nodes_run_together_and_outputs_flow_downstream():
    ran, ctx, started = _run(_graph(), {"go": True})
    assert ran == {"a": True, "b": True, "c": True, "d": True}
    assert sorted(started[:2]) == ["a", "b"]
    assert ctx.outputs["c"] == [3, 4] and ctx.outputs["d"] == [4, 5]
    ex = GraphExecutor(_graph(), PromptRenderer({}, 16), ["x", "y"])
    assert ex.team_reward(ctx) == 1.5 and ex.node_rewards(ctx, ["a", "c"]) == {"a": 0.0, "c": 2.0}
    assert ex.success(ctx) is True


def test_a_false_condition_ends_its_branch():
    ran, ctx, _ = _run(_graph(), {"go": False})
    assert ran == {"a": True, "b": True, "c": False, "d": False}
    assert "d" not in ctx.outputs


def test_task_errors_are_named_and_wrong_values_are_contract_errors():
    with pytest.raises(TaskCodeError, match=r"node 'c': condition \(when=\) raised KeyError"):
        _run(_graph(), {})
    with pytest.raises(ContractError, match="node 'c': condition"):
        _run(_graph(cond=lambda ctx: "yes"), {"go": True})
    g = _graph()
    g.nodes["c"].reward = lambda ctx: 1 / 0
    ex = GraphExecutor(g, PromptRenderer({}, 16), ["x", "y"])
    with pytest.raises(TaskCodeError, match="node 'c': reward raised ZeroDivisionError"):
        ex.node_rewards(EpisodeContext("0", 0, {}), ["c"])


def test_a_reward_reading_a_skipped_node_fails_the_episode_not_the_run():
    ran, ctx, _ = _run(_graph(), {"go": False})
    g = _graph()
    g.episode_reward = lambda ctx: float(len(ctx.output("d")))  # d was skipped: a GraphError
    ex = GraphExecutor(g, PromptRenderer({}, 16), ["x", "y"])
    with pytest.raises(TaskCodeError, match="episode reward raised GraphError"):
        ex.team_reward(ctx)


@pytest.mark.parametrize("go", [True, False])
def test_bus_handoffs_deliver_each_input_and_end_branches_as_directly(go):
    """`handoff="bus"`: every edge is one message (encoded as on the wire), the results and
    outputs are those of direct hand-offs, a branch that ended included."""
    direct = _run(_graph(), {"go": go})
    bus = _run(_graph(), {"go": go}, handoff="bus")
    assert bus[0] == direct[0] and bus[1].outputs == direct[1].outputs
    ex = GraphExecutor(_graph(), PromptRenderer({}, 16), ["x", "y"], handoff="bus")
    assert ex.readers == {"a": ["c"], "b": ["c"], "c": ["d"], "d": []}
    seen: dict[str, list[int]] = {}

    async def call(node: NodeCall) -> list[int]:
        seen[node.name] = list(node.prompt.tokens)
        return [7] if node.name == "a" else [8, 9]

    ctx = EpisodeContext(input_id="0", trajectory_id=0, data={"go": True})
    asyncio.run(ex.run(ctx, call))
    assert ex.messages == 3 and seen["c"] == [7, 8, 9]  # a -> c, b -> c, c -> d
    with pytest.raises(ValueError, match="handoff 'http'"):
        GraphExecutor(_graph(), PromptRenderer({}, 16), ["x", "y"], handoff="http")
