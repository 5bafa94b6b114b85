"""One episode's walk along the graph, written once for training and for serving.

`GraphExecutor.run` starts every node as a task that waits for its inputs (dependency-parallel:
independent nodes run at once), decides whether the node runs (`when=`, an upstream branch that
ended), builds and renders its prompt, hands it to the caller's `call` (the rollout pool in
training, `flexmarl serve`'s agents when serving) and records the sampled ids, and the decoded
text of a text-level node, in the episode's context. Scoring reads the task's reward functions
through the same contracts. What the callers add stays theirs: training's store rows, version
gates and stage barrier live inside its `call`; serving's request options inside its own.

Hand-offs (`handoff=`): "direct" (training's default), a node reads its inputs' outputs from
the episode's context once they are set; "bus" (`flexmarl serve`'s episodes), a finished node
sends its output, encoded as on the wire (`graph.messages`: msgpack), to the mailbox of each
node that reads it, and that node waits for one message per input and takes its inputs from
the messages, an input that did not run included (which ends the branch, as directly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from flexmarl.errors import UserError
from flexmarl.graph import contracts
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.envs import EnvSegment
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt
from flexmarl.graph.messages import MessageBus


class TaskCodeError(RuntimeError):
    """A task's own function (condition, prompt builder, reward) raised inside an episode.

    An episode failure, not a bug in FlexMARL: training counts it against the failure budget,
    serving answers 400. Values of the wrong kind are `contracts.ContractError` instead."""

    def __init__(self, node: str | None, what: str, error: BaseException) -> None:
        where = f"node {node!r}: " if node is not None else ""
        super().__init__(f"{where}{what} raised {error!r}")
        self.node = node
        self.what = what
        self.error = error


def _task_code(node: str | None, what: str, fn: Callable[[EpisodeContext], Any],
               ctx: EpisodeContext, *, user_errors_stop: bool = True) -> Any:
    """`fn(ctx)`, with what it raises named. A `UserError` from a condition or a prompt builder
    (a bad prompt, an output read before it exists) stops the run; a reward's is an episode
    failure like any other exception (`user_errors_stop=False`)."""
    try:
        return fn(ctx)
    except Exception as exc:  # noqa: BLE001 - the task's code
        if user_errors_stop and isinstance(exc, UserError):
            raise
        raise TaskCodeError(node, what, exc) from exc


@dataclass(frozen=True)
class NodeCall:
    """A node ready to sample: its name, agent, rendered prompt (token ids) and whether it is
    text-level (its response is decoded for downstream nodes)."""

    name: str
    agent: str
    prompt: NodePrompt
    is_text: bool
    # a network agent's node: the environment segment it acts in (its prompt is empty)
    segment: EnvSegment | None = None


Call = Callable[[NodeCall], Awaitable[list[int]]]


class GraphExecutor:
    """Walks episodes of one graph; `agents` are the names it may use (validated once)."""

    def __init__(self, graph: MEG, renderer: PromptRenderer, agents: Iterable[str],
                 handoff: str = "direct") -> None:
        if handoff not in ("direct", "bus"):
            raise ValueError(f"handoff {handoff!r}: expected 'direct' or 'bus'")
        self.graph = graph
        self.renderer = renderer
        self.order = graph.validate(agents)
        self.handoff = handoff
        self.messages = 0  # hand-offs sent through the bus, all episodes together
        # who reads each node's output (a bus message per reader)
        self.readers: dict[str, list[str]] = {n: [] for n in self.order}
        for name in self.order:
            for d in graph.nodes[name].inputs:
                self.readers[d].append(name)
        # nodes whose condition is decided at the episode's start (`MEG.node(static_when=)`)
        self._static = frozenset(n for n, nd in graph.nodes.items()
                                 if nd.when is not None and nd.static_when)

    def skipped_at_start(self, ctx: EpisodeContext) -> set[str]:
        """Nodes whose `static_when` condition skips them in this episode, with everything
        downstream of them: they get no task (what `run` would decide after their inputs,
        decided up front). A condition that raises is left to `run`, which reports it."""
        if not self._static:
            return set()
        out: set[str] = set()
        for name in self.order:
            node = self.graph.nodes[name]
            if any(i in out for i in node.inputs):
                out.add(name)
            elif name in self._static:
                try:
                    if not contracts.check_condition(name, node.when(ctx)):  # type: ignore[misc]
                        out.add(name)
                except Exception:  # noqa: BLE001, S110 - `run` raises it as it would
                    pass
        return out

    def prepare(self, ctx: EpisodeContext, name: str) -> NodeCall | None:
        """The node's rendered prompt, or None when its condition skips it."""
        node = self.graph.nodes[name]
        if node.when is not None and not contracts.check_condition(
                name, _task_code(name, "condition (when=)", node.when, ctx)):
            return None
        value = _task_code(name, "prompt builder", node.prompt, ctx)
        if isinstance(value, EnvSegment):  # a network agent acts in the episode's env
            return NodeCall(name, node.agent, NodePrompt([], 0), False, segment=value)
        prompt, is_text = self.renderer.render(name, node.agent, value)
        return NodeCall(name, node.agent, prompt, is_text)

    async def run(
        self,
        ctx: EpisodeContext,
        call: Call,
        *,
        skip: Collection[str] = (),
        on_task: Callable[[str, asyncio.Task], None] | None = None,
    ) -> dict[str, bool]:
        """Run the episode's nodes (all but `skip`); {node: whether it ran}. The first node that
        fails cancels the others and its error propagates. `on_task(name, task)` sees each
        node's task as it is made (training's stage barrier counts them)."""
        names = [n for n in self.order if n not in skip]
        walk = _EpisodeWalk(self, ctx, call, names)
        tasks = [asyncio.ensure_future(walk.run_node(n)) for n in names]
        if on_task is not None:
            for n, t in zip(names, tasks, strict=True):
                on_task(n, t)
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        return {n: walk.done[n].result() for n in names}

    def address(self, node: str) -> str:
        """A node's mailbox on the bus: its agent and the node (one agent may run many)."""
        return f"{self.graph.nodes[node].agent}/{node}"

    def team_reward(self, ctx: EpisodeContext) -> float:
        """The episode's team reward (0 without one), checked to be a finite number."""
        if self.graph.episode_reward is None:
            return 0.0
        value = _task_code(None, "episode reward", self.graph.episode_reward, ctx,
                           user_errors_stop=False)
        return contracts.check_reward("episode reward", value)

    def node_rewards(self, ctx: EpisodeContext, ran: Iterable[str]) -> dict[str, float]:
        """Each node's own reward (0 for a node without one), for the nodes that ran."""
        out: dict[str, float] = {}
        for name in ran:
            fn = self.graph.nodes[name].reward
            out[name] = 0.0
            if fn is not None:
                value = _task_code(name, "reward", fn, ctx, user_errors_stop=False)
                out[name] = contracts.check_reward(f"node {name!r}: reward", value)
        return out

    def node_labels(self, ctx: EpisodeContext, ran: Iterable[str]) -> dict[str, str]:
        """The true class (`label=`) of each node that ran and declares one, as a string."""
        out: dict[str, str] = {}
        for name in ran:
            fn = self.graph.nodes[name].label
            if fn is not None:
                out[name] = str(_task_code(name, "label", fn, ctx, user_errors_stop=False))
        return out

    def success(self, ctx: EpisodeContext) -> bool | None:
        """The task's success flag for a finished episode; None without one or when it raises
        (a metric must not fail an episode)."""
        if self.graph.success is None:
            return None
        try:
            return bool(self.graph.success(ctx))
        except Exception:  # noqa: BLE001 - a metric must not kill the run
            return None


class _EpisodeWalk:
    """One episode of `GraphExecutor.run`: each node's task waits for its inputs (their
    futures, or with the "bus" hand-off one message from each), runs unless its inputs did not
    all run or its condition skips it, and tells the nodes that read it."""

    def __init__(self, executor: GraphExecutor, ctx: EpisodeContext, call: Call,
                 names: list[str]) -> None:
        self.executor = executor
        self.ctx = ctx
        self.call = call
        loop = asyncio.get_running_loop()
        self.done: dict[str, asyncio.Future[bool]] = {n: loop.create_future() for n in names}
        self.bus = (MessageBus([executor.address(n) for n in names])
                    if executor.handoff == "bus" else None)

    def finish(self, name: str, ran: bool) -> None:
        self.done[name].set_result(ran)
        if self.bus is None:
            return
        ctx, ex = self.ctx, self.executor
        msg: dict[str, Any] = {"node": name, "ran": ran}
        if ran:
            msg["tokens"] = ctx.outputs[name]
            if name in ctx.texts:
                msg["text"] = ctx.texts[name]
        for reader in ex.readers[name]:
            if reader in self.done:
                self.bus.send(ex.address(name), ex.address(reader), msg)
                ex.messages += 1

    async def inputs_ran(self, name: str) -> bool:
        node = self.executor.graph.nodes[name]
        if self.bus is None:
            return all([await self.done[d] for d in node.inputs])
        ran = True
        for _ in node.inputs:  # one message from each input, in the order they finish
            _env, msg = await self.bus.receive(self.executor.address(name))
            if msg["ran"]:
                self.ctx.outputs[msg["node"]] = list(msg["tokens"])
                if "text" in msg:
                    self.ctx.texts[msg["node"]] = msg["text"]
            ran = ran and msg["ran"]
        return ran

    async def run_node(self, name: str) -> None:
        if not await self.inputs_ran(name):
            self.finish(name, False)  # an upstream branch ended: so does this one
            return
        ex, ctx = self.executor, self.ctx
        ready = ex.prepare(ctx, name)
        if ready is None:
            self.finish(name, False)
            return
        tokens = await self.call(ready)
        ctx.outputs[name] = tokens
        if ready.is_text:  # the sampled ids stay as they are; downstream reads them decoded
            ctx.texts[name] = ex.renderer.decode(ready.agent, tokens, ready.prompt.stop)
        self.finish(name, True)
