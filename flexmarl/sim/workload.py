"""Simulated workloads: which cluster, which agents, how they call each other, how much work.

Why: the simulator needs one declarative description of a multi-agent RL run -- cluster,
agents (model, tensor parallelism, prompt and output lengths), the per-episode agent graph and
the amount of rollout per iteration -- that users write in YAML and the sim runtime turns into
simulated work. Validation happens at load time and names the file and the field at fault.

The agent graph is unrolled into the per-episode node DAG of docs/design.md section 3:

* the graph runs for ``graph.rounds`` rounds; an agent takes part in every round unless its
  ``rounds`` lists the ones it joins;
* per round an agent has ``calls_per_episode / (its number of rounds)`` parallel nodes (copies);
* an edge ``src -> dst`` with ``lag: 0`` feeds src's round-r nodes into dst's round-r nodes
  (these must form a DAG inside a round); with ``lag: 1`` it feeds src's round r into dst's
  round r + 1 (debate rounds, refine loops); fan-out is a list of ``dst`` agents;
* an edge with ``probability < 1`` is conditional (a router picking specialists): per episode
  and round it is taken with that probability, and a node none of whose inputs arrive is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flexmarl.sim.cost import KV_MEMORY_FRACTION, CostModel
from flexmarl.sim.hardware import AcceleratorSpec, get_accelerator
from flexmarl.sim.lengths import LengthDistribution
from flexmarl.sim.models import ModelSpec, get_model

__all__ = [
    "AgentSpec",
    "ClusterSpec",
    "EdgeSpec",
    "EpisodeNode",
    "GraphSpec",
    "RolloutSpec",
    "TrainingSpec",
    "Workload",
    "WorkloadError",
    "load_workload",
    "parse_workload",
]

_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
_CROSS_FIELD = "workload_consistency"


def _fail(field: str, detail: str) -> PydanticCustomError:
    """A cross-field validation error that names the field at fault.

    Errors raised by a model validator carry no location of their own, so the field path
    travels in the error's context (and braces in ``detail`` are never templated).
    """
    return PydanticCustomError(
        _CROSS_FIELD, "{field}: {detail}", {"field": field, "detail": detail}
    )


class RandomSource(Protocol):
    """What `Workload.episode_nodes` draws its conditional edges from: a numpy Generator, or
    the enumerator of `sim.task` that returns fixed draws."""

    def random(self) -> float: ...


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterSpec(_Strict):
    """The simulated cluster: ``nodes`` machines of ``accelerators_per_node`` identical devices."""

    nodes: PositiveInt
    accelerators_per_node: PositiveInt = 8
    accelerator: AcceleratorSpec

    @field_validator("accelerator", mode="before")
    @classmethod
    def _lookup_accelerator(cls, value: object) -> object:
        return get_accelerator(value) if isinstance(value, str) else value

    @property
    def total_accelerators(self) -> int:
        return self.nodes * self.accelerators_per_node


class AgentSpec(_Strict):
    """One agent: its model, inference tensor parallelism, lengths and calls per episode.

    ``prompt_length`` is the agent's own prompt (instructions, task); with ``append_inputs`` the
    outputs of a node's inputs are appended to it, as when an agent reads the others' answers.
    """

    name: str = Field(pattern=_NAME_PATTERN)
    model: ModelSpec
    tp: PositiveInt = 1
    prompt_length: LengthDistribution
    output_length: LengthDistribution
    calls_per_episode: PositiveInt | None = None
    rounds: list[PositiveInt] | None = None
    append_inputs: bool = True
    trainable: bool = True

    @field_validator("model", mode="before")
    @classmethod
    def _lookup_model(cls, value: object) -> object:
        return get_model(value) if isinstance(value, str) else value

    @field_validator("rounds")
    @classmethod
    def _sorted_unique_rounds(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("rounds must list at least one round (or be left out for all)")
        if len(set(value)) != len(value):
            raise ValueError(f"rounds has duplicates: {value}")
        return sorted(value)


class EdgeSpec(_Strict):
    """Each ``src`` agent's nodes feed each ``dst`` agent's nodes, in the same round or (lag 1)
    the next. One name or a list on either side: a list of ``dst`` is a fan-out, of ``src`` a
    fan-in."""

    src: list[str]
    dst: list[str]
    lag: Literal[0, 1] = 0
    probability: float = Field(default=1.0, gt=0.0, le=1.0)

    @field_validator("src", "dst", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("src", "dst")
    @classmethod
    def _nonempty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name at least one agent")
        if len(set(value)) != len(value):
            raise ValueError(f"names an agent twice: {value}")
        return value


class GraphSpec(_Strict):
    """The agent graph, run for ``rounds`` rounds per episode."""

    rounds: PositiveInt = 1
    edges: list[EdgeSpec] = Field(default_factory=list)


class RolloutSpec(_Strict):
    """Rollout per iteration: ``prompts_per_iteration`` prompts, ``group_size`` episodes each
    (GRPO-style groups)."""

    prompts_per_iteration: PositiveInt
    group_size: PositiveInt = 1

    @property
    def episodes_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.group_size


class TrainingSpec(_Strict):
    """What one training step runs besides forward + backward over the rows.

    GRPO and PPO as verl, OpenRLHF and MARTI run them recompute the rows' log-probabilities
    under the policy that sampled them (the old policy) and under the frozen reference model
    (for the KL term) before the update: one forward pass each over every trained token.
    ``micro_batch_size`` is rows per micro-batch (default: ``max(group_size, episodes / 32)``).
    """

    old_policy_forward: bool = True
    reference_forward: bool = True
    micro_batch_size: PositiveInt | None = None
    # training slots of these many devices each, as the run's `runtime.slot_sizes`: the
    # planner binds the agents to them (heaviest to the largest) and each agent trains
    # sharded over its slot's devices; None: the planner sizes every agent's trainer
    slot_sizes: list[PositiveInt] | None = None

    @property
    def forward_passes(self) -> int:
        """Extra forward passes per trained token and step."""
        return int(self.old_policy_forward) + int(self.reference_forward)


@dataclass(frozen=True)
class EpisodeNode:
    """One invocation of an agent in an episode: ``round`` is 1-based, ``copy`` 0-based."""

    id: str
    agent: str
    round: int
    copy: int
    inputs: tuple[str, ...]


class Workload(_Strict):
    """A complete simulated workload (see the module docstring for the graph's meaning)."""

    name: str
    description: str = ""
    seed: NonNegativeInt = 0
    iterations: PositiveInt
    cluster: ClusterSpec
    agents: list[AgentSpec] = Field(min_length=1)
    graph: GraphSpec = Field(default_factory=GraphSpec)
    rollout: RolloutSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)

    # --- validation across fields ------------------------------------------------------------

    @model_validator(mode="after")
    def _check_consistency(self) -> Workload:
        seen: dict[str, int] = {}
        for i, agent in enumerate(self.agents):
            if agent.name in seen:
                raise _fail(
                    f"agents[{i}].name",
                    f"duplicate agent name {agent.name!r} (also agents[{seen[agent.name]}])",
                )
            seen[agent.name] = i
        self._check_agents()
        self._check_edges(seen)
        self._topological_agents()  # raises on a cycle inside a round
        return self

    def _check_agents(self) -> None:
        cluster = self.cluster
        acc = cluster.accelerator
        for i, agent in enumerate(self.agents):
            where = f"agents[{i}] ({agent.name})"
            for r in agent.rounds or []:
                if r > self.graph.rounds:
                    raise _fail(
                        f"{where}.rounds", f"round {r} is beyond graph.rounds = {self.graph.rounds}"
                    )
            active = len(self.agent_rounds(agent.name))
            calls = agent.calls_per_episode
            if calls is not None and calls % active:
                raise _fail(
                    f"{where}.calls_per_episode",
                    f"{calls} is not a multiple of the agent's {active} round(s), so calls "
                    "cannot be spread evenly over rounds",
                )
            if agent.tp > cluster.accelerators_per_node:
                raise _fail(
                    f"{where}.tp",
                    f"{agent.tp} exceeds cluster.accelerators_per_node = "
                    f"{cluster.accelerators_per_node} (tensor parallelism stays inside a node)",
                )
            per_device = agent.model.weight_bytes / agent.tp
            if per_device > acc.memory_bytes * KV_MEMORY_FRACTION:
                raise _fail(
                    f"{where}.tp",
                    f"{agent.model.name} weights need {per_device / 1e9:.1f} GB per device at "
                    f"tp={agent.tp}, more than {KV_MEMORY_FRACTION:.0%} of {acc.name}'s "
                    f"{acc.memory_bytes / 1e9:.0f} GB; raise tp",
                )
        needed = sum(agent.tp for agent in self.agents)
        if needed > cluster.total_accelerators:
            raise _fail(
                "cluster",
                f"one inference replica per agent needs {needed} accelerators, the cluster "
                f"has {cluster.total_accelerators}",
            )

    def _check_edges(self, index: Mapping[str, int]) -> None:
        known = ", ".join(index)
        for e, edge in enumerate(self.graph.edges):
            where = f"graph.edges[{e}]"
            for side in ("src", "dst"):
                for j, name in enumerate(getattr(edge, side)):
                    if name not in index:
                        raise _fail(
                            f"{where}.{side}[{j}]", f"unknown agent {name!r}; agents are: {known}"
                        )
            for dst in edge.dst:
                if edge.lag == 0 and dst in edge.src:
                    raise _fail(
                        where,
                        f"{dst!r} feeds itself in the same round; use lag: 1 to feed its next "
                        "round",
                    )
            if edge.lag == 1 and self.graph.rounds < 2:
                raise _fail(f"{where}.lag", "lag 1 feeds the next round, but graph.rounds is 1")

    def _topological_agents(self) -> list[str]:
        """Agents in an order where every same-round (lag 0) edge points forward."""
        names = [a.name for a in self.agents]
        succ: dict[str, list[str]] = {n: [] for n in names}
        indeg = dict.fromkeys(names, 0)
        for edge in self.graph.edges:
            if edge.lag == 0:
                for src in edge.src:
                    for dst in edge.dst:
                        succ[src].append(dst)
                        indeg[dst] += 1
        order = [n for n in names if indeg[n] == 0]
        for n in order:  # order grows while we walk it (Kahn's algorithm)
            for m in succ[n]:
                indeg[m] -= 1
                if indeg[m] == 0:
                    order.append(m)
        if len(order) < len(names):
            raise _fail(
                "graph.edges", f"same-round (lag 0) edges form a cycle: {self._cycle(succ)}"
            )
        return order

    @staticmethod
    def _cycle(succ: Mapping[str, list[str]]) -> str:
        """One cycle of ``succ`` written as ``a -> b -> a`` (depth-first search)."""
        state: dict[str, int] = {}  # 1: on the current path, 2: finished
        path: list[str] = []

        def visit(n: str) -> list[str] | None:
            state[n] = 1
            path.append(n)
            for m in succ[n]:
                if state.get(m) == 1:
                    return path[path.index(m) :] + [m]
                if m not in state and (found := visit(m)):
                    return found
            path.pop()
            state[n] = 2
            return None

        for n in succ:
            if n not in state and (found := visit(n)):
                return " -> ".join(found)
        return "?"

    # --- derived facts -----------------------------------------------------------------------

    def agent(self, name: str) -> AgentSpec:
        """The agent called ``name``."""
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise KeyError(f"no agent {name!r}; agents are: {', '.join(a.name for a in self.agents)}")

    def agent_rounds(self, name: str) -> list[int]:
        """The rounds (1-based) in which the agent has nodes."""
        agent = self.agent(name)
        return agent.rounds or list(range(1, self.graph.rounds + 1))

    def copies_per_round(self, name: str) -> int:
        """Parallel nodes the agent has in each of its rounds."""
        agent = self.agent(name)
        active = len(self.agent_rounds(name))
        return (agent.calls_per_episode or active) // active

    def calls_per_episode(self, name: str) -> int:
        """Total nodes of the agent per episode (before conditional edges prune any)."""
        return self.copies_per_round(name) * len(self.agent_rounds(name))

    @property
    def episodes_per_iteration(self) -> int:
        return self.rollout.episodes_per_iteration

    @property
    def micro_batch_size(self) -> int:
        """Rows per training micro-batch: the workload's, or max(group, episodes / 32)."""
        return self.training.micro_batch_size or max(self.rollout.group_size,
                                                     self.episodes_per_iteration // 32)

    def cost_model(self, **overrides: Any) -> CostModel:
        """A cost model for this cluster's accelerators (efficiency factors overridable)."""
        return CostModel(
            self.cluster.accelerator,
            accelerators_per_node=self.cluster.accelerators_per_node,
            **overrides,
        )

    def episode_nodes(self, rng: RandomSource | None = None) -> list[EpisodeNode]:
        """Unroll the agent graph into one episode's node DAG, in a topological order.

        Without ``rng`` every edge is taken (the full graph). With ``rng`` each conditional
        edge is drawn per round; nodes none of whose inputs arrive are left out.
        """
        order = self._topological_agents()
        active_rounds = {a.name: set(self.agent_rounds(a.name)) for a in self.agents}
        ids: dict[tuple[str, int], list[str]] = {}
        nodes: list[EpisodeNode] = []
        for r in range(1, self.graph.rounds + 1):
            taken: list[tuple[EdgeSpec, bool]] = []
            for edge in self.graph.edges:
                keep = rng is None or edge.probability >= 1.0 or rng.random() < edge.probability
                taken.append((edge, keep))
            for name in order:
                if r not in active_rounds[name]:
                    continue
                declared = False
                inputs: list[str] = []
                for edge, keep in taken:
                    if name not in edge.dst:
                        continue
                    src_round = r - edge.lag
                    for src in edge.src:
                        if src_round < 1 or src_round not in active_rounds[src]:
                            continue
                        declared = True
                        if keep:
                            inputs.extend(ids.get((src, src_round), []))
                if declared and not inputs:
                    continue  # every input was skipped or not taken: this node does not run
                copies = self.copies_per_round(name)
                made = []
                for c in range(copies):
                    node_id = f"{name}@{r}" if copies == 1 else f"{name}@{r}#{c}"
                    nodes.append(EpisodeNode(node_id, name, r, c, tuple(dict.fromkeys(inputs))))
                    made.append(node_id)
                ids[(name, r)] = made
        return nodes


# --- Loading ------------------------------------------------------------------------------------


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and each bad field."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = [f"{source}: {f}: {msg}" if f else f"{source}: {msg}" for f, msg in problems]
        super().__init__("\n".join(lines))


def _field_path(loc: tuple[int | str, ...], data: object) -> str:
    """Turn pydantic's ``('agents', 1, 'tp')`` into ``agents[1] (coder).tp``."""
    out = ""
    node: object = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, Mapping) and isinstance(node.get("name"), str):
                out += f" ({node['name']})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, Mapping) else None
    return out


def _message(error: Mapping[str, Any]) -> str:
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if error["type"] == "extra_forbidden":
        msg = "unknown field (not part of the workload schema)"
    return msg


def parse_workload(data: object, source: str = "<workload>") -> Workload:
    """Validate already-parsed YAML/JSON data; errors name ``source`` and the fields."""
    if not isinstance(data, Mapping):
        got = type(data).__name__
        raise WorkloadError(source, [("", f"expected a mapping at top level, got {got}")])
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            ctx = error.get("ctx") or {}
            if error["type"] == _CROSS_FIELD:
                problems.append((str(ctx["field"]), str(ctx["detail"])))
            else:
                problems.append((_field_path(tuple(error["loc"]), data), _message(error)))
        raise WorkloadError(source, problems) from None


def load_workload(path: str | Path) -> Workload:
    """Load and validate a workload YAML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(str(path), [("", f"cannot read file: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkloadError(str(path), [("", f"invalid YAML: {exc}")]) from None
    return parse_workload(data, str(path))
