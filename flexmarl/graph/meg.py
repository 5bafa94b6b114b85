"""Multi-agent Execution Graph (MEG): which agent runs where in an episode, and what feeds what.

A node is one invocation of an agent inside an episode; its prompt is built from the episode's
input and the outputs of the nodes it depends on. Multi-round patterns are unrolled into nodes.
The graph is a DAG; `validate` names the cycle, the unknown agent or the missing input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flexmarl.errors import UserError


class GraphError(UserError, ValueError):
    """A graph that cannot run: names the node, agent or cycle at fault."""


@dataclass
class NodePrompt:
    """What a node asks its agent: prompt tokens, how many tokens it may emit, which ones.

    `allowed_tokens` constrains decoding (an action mask); the trainer re-applies the same mask
    so that training log-probs are those of the distribution that sampled.

    Example:
        ```python
        NodePrompt(tokens=[1, 5, 9], max_new_tokens=1, allowed_tokens=[3, 4])
        ```
    """

    tokens: list[int]
    max_new_tokens: int
    allowed_tokens: list[int] | None = None
    stop_tokens: list[int] = field(default_factory=list)
    # stop strings: decoding ends once the decoded response contains one (needs the agent's
    # tokenizer); the tokens sampled up to there are kept as they are for training
    stop: list[str] = field(default_factory=list)


@dataclass
class TextPrompt:
    """A text- or chat-level prompt: FlexMARL applies the agent's tokenizer (and, for chat
    messages, its chat template), samples, keeps the exact token ids for training and gives
    downstream nodes and rewards the decoded text (`ctx.text(node)`).

    A prompt builder may also return the plain string or the message list itself; then the
    agent's `sampling` settings (`max_tokens`, `stop`, `stop_token_ids`) apply unchanged.
    `max_new_tokens` overrides `sampling.max_tokens`; `stop` adds to `sampling.stop`.

    Example:
        ```python
        TextPrompt([{"role": "user", "content": "Is 3 + 4 = 7? Answer yes or no."}],
                   max_new_tokens=4, stop=["\n"])
        ```
    """

    prompt: str | list[dict[str, str]]
    max_new_tokens: int | None = None
    stop: list[str] | None = None


@dataclass
class EpisodeContext:
    """What a prompt builder or a reward function sees: the episode's input and node outputs.

    Attributes:
        input_id: `"<iteration>-<input index>"`, shared by the trajectories of one group.
        trajectory_id: which of the group's trajectories this episode is (0..G-1).
        data: the input dict that `Task.sample_inputs` returned for this episode.
        outputs: token ids of every node that has run, by node name (use `output`).
        texts: decoded responses of text-level nodes, by node name (use `text`).

    A `reward=` function receives this context once every node it can read has run, and
    returns a float (the node's own reward; `set_episode_reward`'s function returns the team's).

    Example:
        ```python
        def judge_reward(ctx: EpisodeContext) -> float:
            said_yes = ctx.text("judge").strip().lower().startswith("yes")
            right = ctx.text("answer").strip() == str(ctx.data["sum"])
            return float(said_yes == right)
        ```
    """

    input_id: str
    trajectory_id: int
    data: dict[str, Any]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # decoded responses of text-level nodes (cut before the first stop string)
    texts: dict[str, str] = field(default_factory=dict)

    def output(self, node: str) -> list[int]:
        """The token ids node `node` sampled (exactly those that are trained on)."""
        if node not in self.outputs:
            raise GraphError(f"node output {node!r} is not available in this episode")
        return self.outputs[node]

    def text(self, node: str) -> str:
        """The decoded response of a text-level node (special tokens skipped, cut before the
        first stop string); a token-level node has no text: use `output`."""
        if node not in self.outputs:
            raise GraphError(f"node output {node!r} is not available in this episode")
        if node not in self.texts:
            raise GraphError(f"node {node!r} is token-level (its prompt builder returned a "
                             "NodePrompt), so it has no text; use ctx.output(node) for its "
                             "token ids, or return text / chat messages / TextPrompt")
        return self.texts[node]


PromptValue = NodePrompt | TextPrompt | str | list[dict[str, str]]
PromptBuilder = Callable[[EpisodeContext], PromptValue]
"""`prompt(ctx)`: text, chat messages (`[{"role": "user", "content": ...}]`), a `TextPrompt`
or a `NodePrompt`. Example: `lambda ctx: f"Add {ctx.data['a']} and {ctx.data['b']}."`"""
RewardFn = Callable[[EpisodeContext], float]
"""`reward(ctx) -> float`: the reward of a node (`reward=`) or of the episode
(`set_episode_reward`). Example: `lambda ctx: float(ctx.text("answer") == ctx.data["gold"])`"""
Condition = Callable[[EpisodeContext], bool]
"""`when(ctx) -> bool`: False skips the node and everything downstream of it in this episode.
Example: `lambda ctx: ctx.data["needs_review"]`"""


@dataclass
class Node:
    name: str
    agent: str
    inputs: tuple[str, ...]
    prompt: PromptBuilder
    when: Condition | None = None
    reward: RewardFn | None = None
    # `when` reads only the episode's input and trajectory, never an output
    static_when: bool = False


@dataclass
class MEG:
    """A per-episode DAG of agent invocations plus the rewards that score an episode.

    Build it by chaining [`node`][flexmarl.graph.meg.MEG.node] calls; each node names its agent
    (a key of the run's `agents:`), the nodes whose outputs it reads (`inputs`) and a prompt
    builder `prompt(ctx)` that returns text, chat messages, a
    [`TextPrompt`][flexmarl.graph.meg.TextPrompt] or a token-level
    [`NodePrompt`][flexmarl.graph.meg.NodePrompt]. A `reward(ctx) -> float` on a node scores
    that node's response; [`set_episode_reward`][flexmarl.graph.meg.MEG.set_episode_reward]
    scores the whole episode (shared by every node as `train.credit` says).

    Example:
        ```python
        graph = (MEG()
                 .node("answer", agent="solver", prompt=lambda ctx: ctx.data["question"])
                 .node("judge", agent="judge", inputs=["answer"],
                       prompt=lambda ctx: f"Is this right? {ctx.text('answer')}",
                       reward=lambda ctx: float(ctx.text("judge").startswith("yes")
                                                == ctx.data["answer_is_right"]))
                 .set_episode_reward(lambda ctx: float(ctx.text("answer") == ctx.data["gold"])))
        ```
    """

    nodes: dict[str, Node] = field(default_factory=dict)
    episode_reward: RewardFn | None = None
    success: Callable[[EpisodeContext], bool] | None = None

    def node(
        self,
        name: str,
        *,
        agent: str,
        prompt: PromptBuilder,
        inputs: Iterable[str] = (),
        when: Condition | None = None,
        reward: RewardFn | None = None,
        static_when: bool = False,
    ) -> MEG:
        """Add a node; `when` may skip it (and so end its branch) for a given episode.

        `static_when`: `when` reads only the episode's input and trajectory, not its outputs,
        so it is decided when the episode starts and a node it skips, with everything
        downstream, costs nothing (a graph with many conditional variants of a node, as the
        simulator's, would otherwise run a task per variant per episode)."""
        if not name or "_" in name:
            raise GraphError(f"node name {name!r} must be non-empty and contain no '_'")
        if name in self.nodes:
            raise GraphError(f"node {name!r} is defined twice")
        self.nodes[name] = Node(name, agent, tuple(inputs), prompt, when, reward, static_when)
        return self

    def set_episode_reward(self, fn: RewardFn) -> MEG:
        """A team reward, credited to every node of the episode."""
        self.episode_reward = fn
        return self

    def set_success(self, fn: Callable[[EpisodeContext], bool]) -> MEG:
        """Task success (for metrics only; rewards drive learning)."""
        self.success = fn
        return self

    @property
    def agents(self) -> list[str]:
        return sorted({n.agent for n in self.nodes.values()})

    def topological_order(self) -> list[str]:
        """Nodes in dependency order (ties by insertion), raising on a cycle with its path."""
        order: list[str] = []
        state: dict[str, int] = {}  # 1 visiting, 2 done

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = path[path.index(name) :] + [name]
                raise GraphError("graph has a cycle: " + " -> ".join(cycle))
            state[name] = 1
            for dep in self.nodes[name].inputs:
                visit(dep, path + [name])
            state[name] = 2
            order.append(name)

        for name in self.nodes:
            visit(name, [])
        return order

    def validate(self, known_agents: Iterable[str] | None = None) -> list[str]:
        """Check the graph; returns the topological order. Errors name the node at fault."""
        if not self.nodes:
            raise GraphError("graph has no nodes")
        for node in self.nodes.values():
            for dep in node.inputs:
                if dep not in self.nodes:
                    raise GraphError(f"node {node.name!r} has missing input {dep!r}")
                if dep == node.name:
                    raise GraphError(f"graph has a cycle: {node.name} -> {node.name}")
        if known_agents is not None:
            known = set(known_agents)
            for node in self.nodes.values():
                if node.agent not in known:
                    raise GraphError(
                        f"node {node.name!r} uses unknown agent {node.agent!r} "
                        f"(configured agents: {', '.join(sorted(known)) or 'none'})"
                    )
        return self.topological_order()

    def turn_of(self) -> dict[str, int]:
        """The `turn` of each node in sample ids: its position in topological order."""
        return {name: i for i, name in enumerate(self.topological_order())}
