"""A real runtime's demand for the planner (`planner.Demand`): phase times scaled from the node
latencies the last iteration measured (a request's time taken as inversely proportional to its
agent's replica share), training seconds from the training slots' own clock. Units: workers.

The simulator's demand, priced by its cost model, is `sim.demand.CostModelDemand`: the planner
is the same, only the demand differs between hosts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexmarl.planning.planner import Node


class MeasuredDemand:
    """A real runtime's demand after one iteration.

    `nodes`: one episode's nodes, topological; `agents`: the agents the rollout replicas
    serve (not those behind an endpoint); `node_latency`: each node's latencies, submission
    to completion, queueing included; `share`: each agent's replica capacity while they were
    measured (default 1); `train_s`: seconds each agent's training calls took on its slot in
    the iteration (none measured: 0, training then prices nothing); `calls`: its training
    calls per iteration; `swap_s`: seconds per swap of its state."""

    def __init__(self, name: str, nodes: Sequence[Node], agents: Sequence[str],
                 trainable: Sequence[str], node_latency: Mapping[str, Sequence[float]],
                 share: Mapping[str, float] | None = None,
                 train_s: Mapping[str, float] | None = None,
                 calls: Mapping[str, float] | None = None,
                 swap_s: Mapping[str, float] | None = None) -> None:
        self.name = name
        self.nodes: list[Node] = [(n, a, tuple(i)) for n, a, i in nodes]
        self.agents = list(agents)
        self.trainable = list(trainable)
        self.units = dict.fromkeys(self.agents, 1)
        self.min_train = dict.fromkeys(self.trainable, 1)
        self.node_latency = node_latency
        self.train_s = dict(train_s or {})
        self.calls = dict(calls or {})
        self.swap_s = dict(swap_s or {})
        served = [n for n in self.nodes if n[1] in self.agents]
        lat: dict[str, list[float]] = {}
        for n, a, _ in served:
            lat.setdefault(a, []).extend(node_latency.get(n, ()))
        share = share or {}
        self._base = {a: (sum(v) / len(v), max(v), max(share.get(a, 1.0), 1e-9))
                      for a, v in lat.items() if v}

    @property
    def priced(self) -> bool:
        return bool(self.agents) and all(a in self._base for a in self.agents) and {
            a for _, a, _ in self.nodes if a in self.agents} == set(self.agents)

    def phase_time(self, agent: str, r: int) -> tuple[float, float]:
        mean, top, r0 = self._base[agent]
        return mean * r0 / r, top * r0 / r

    def node_seconds(self, replicas: Mapping[str, int] | None) -> dict[str, float]:
        """Each node's mean measured latency (as measured: the plan's order is that of the
        iteration just seen)."""
        return {n: sum(v) / len(v) for n, v in self.node_latency.items() if v}

    def train_seconds(self) -> dict[str, float]:
        return {a: float(self.train_s.get(a, 0.0)) for a in self.trainable}

    def train_calls(self) -> dict[str, float]:
        return {a: float(self.calls.get(a, 1.0)) for a in self.trainable}

    def swap_seconds(self, agent: str, g: int) -> float:
        return float(self.swap_s.get(agent, 0.0))

    def rollout_work(self) -> dict[str, float]:
        return {a: self.phase_time(a, 1)[0] if a in self._base else 0.0 for a in self.agents}
