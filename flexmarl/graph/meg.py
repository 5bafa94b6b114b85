"""Multi-agent Execution Graph (MEG): which agent runs where in an episode, and what feeds what.

A node is one invocation of an agent inside an episode; its prompt is built from the episode's
input and the outputs of the nodes it depends on. Multi-round patterns are unrolled into nodes.
The graph is a DAG; `validate` names the cycle, the unknown agent or the missing input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from flexmarl.errors import UserError

if TYPE_CHECKING:
    from flexmarl.graph.envs import EnvSegment


class GraphError(UserError, ValueError):
    """A graph that cannot run: names the node, agent or cycle at fault."""


@dataclass
class NodePrompt:
    """A token-level prompt: the ids a node gives its agent, how many it may emit, which ones.

    For tasks with their own small vocabulary and random models (the referential game), where
    full control of the ids matters. `allowed_tokens` constrains decoding (an action mask);
    the trainer re-applies the same mask so that training log-probs are those of the
    distribution that sampled. `stop_tokens` end the response; `stop` strings need the agent's
    tokenizer.

    Example:
        ```python
        # the listener picks one of the candidates shown (token ids of the task's vocabulary)
        NodePrompt(tokens=[BOS, *candidates, SEP, *ctx.output("speak")], max_new_tokens=1,
                   allowed_tokens=candidates)
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
        def judge(ctx: EpisodeContext) -> TextPrompt:
            return TextPrompt([{"role": "user", "content": f"Is {ctx.text('ask')} right?"}],
                              max_new_tokens=2, stop=["\n"])
        ```
    """

    prompt: str | list[dict[str, str]]
    max_new_tokens: int | None = None
    stop: list[str] | None = None


@dataclass
class EpisodeContext:
    """`ctx`: what a prompt builder, a condition (`when=`) or a reward function sees.

    `data` is the episode's input, one of the dicts `Task.sample_inputs` returned; `input_id`
    and `trajectory_id` say which input and which of its `train.group_size` samples this
    episode is. `output(node)` gives the token ids a node sampled (what is trained on),
    `text(node)` a text-level node's decoded answer; both exist once the node ran, so a
    node reads only the nodes in its `inputs`.

    Example:
        ```python
        def reward(ctx: EpisodeContext) -> float:
            return float(ctx.text("ask").strip() == str(ctx.data["a"] + ctx.data["b"]))
        ```
    """

    input_id: str
    trajectory_id: int
    data: dict[str, Any]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # decoded responses of text-level nodes (cut before the first stop string)
    texts: dict[str, str] = field(default_factory=dict)
    # the episode's environment session, for network-policy nodes (graph/envs.py): made by
    # the task's prompt builders on first use
    env: Any = None

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


# a network-policy agent's node returns an `EnvSegment` (graph/envs.py, which builds on this
# module: named here for the type checker only)
PromptValue = Union[NodePrompt, TextPrompt, str, list[dict[str, str]], "EnvSegment"]  # noqa: UP007
PromptBuilder = Callable[[EpisodeContext], PromptValue]
RewardFn = Callable[[EpisodeContext], float]
# The true class of a node's decision (a judge's "the answer was right"), for label-balanced
# advantages (`algorithm.balance_labels`): any value; rows are grouped by its str().
LabelFn = Callable[[EpisodeContext], object]
Condition = Callable[[EpisodeContext], bool]


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
    label: LabelFn | None = None


@dataclass
class MEG:
    """The Multi-agent Execution Graph of one episode: its nodes (agent calls), what feeds
    what, and the rewards that score it.

    Build it with chained `node` calls; `set_episode_reward` adds a team reward credited to
    every node (`train.credit` says how), `set_success` the task's success (metrics only).
    The graph is a DAG: `validate` names a cycle, an unknown agent or a missing input.

    Example:
        ```python
        graph = (MEG()
                 .node("ask", agent="answerer", prompt=ask, reward=answer_right)
                 .node("judge", agent="judge", inputs=["ask"], prompt=judge,
                       reward=verdict_right)
                 .set_success(answer_right))
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
        label: LabelFn | None = None,
    ) -> MEG:
        """Add a node: one call of `agent` in every episode (unless `when` skips it).

        Args:
            name: the node's name (no `_`), unique in the graph.
            agent: the agent that answers, a key of the run config's `agents`.
            prompt: `prompt(ctx)` returns what the agent is asked: a string or a list of chat
                messages (`[{"role": ..., "content": ...}]`; the agent's chat template
                applies), a `TextPrompt`, or a token-level `NodePrompt`.
            inputs: the nodes whose outputs this one reads; it runs once they all ran.
            when: `when(ctx)` returns a bool; False skips the node and ends its branch
                (every node downstream of it is skipped too) in this episode.
            reward: `reward(ctx)` returns this node's own reward, a finite number, once the
                episode is complete; a function that raises fails the episode (counted
                against `train.max_failed_fraction`), one that returns something else stops
                the run with the node named.
            static_when: `when` reads only the episode's input and trajectory, not outputs,
                so it is decided when the episode starts and a node it skips, with everything
                downstream, costs nothing (many conditional variants of a node, as the
                simulator's graphs have, would otherwise run a task per variant).
            label: `label(ctx)` returns the true class of this node's decision once the
                episode is complete (a judge: whether the answer it judged was right). With
                `algorithm.balance_labels` every class weighs the same in the agent's loss,
                so a judge cannot win by answering the majority class to every input.

        Returns:
            The graph itself, so calls chain.
        """
        if not name or "_" in name:
            raise GraphError(f"node name {name!r} must be non-empty and contain no '_'")
        if name in self.nodes:
            raise GraphError(f"node {name!r} is defined twice")
        self.nodes[name] = Node(name, agent, tuple(inputs), prompt, when, reward, static_when,
                                 label)
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
