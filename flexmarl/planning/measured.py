"""The planner's measured-demand entry point, for runtimes that run real models.

The simulator's `ResourcePlanner` plans from a `Workload` and a `CostModel`; a real runtime
has neither, only what the last iteration measured: each node's latency (submission to
completion, queueing included). From those, between iterations, `MeasuredPlanner` plans the
two things a real runtime can change within what it was given:

- the order in which trainable agents get training slots within an iteration, most critical
  first. An agent's next-iteration nodes wait for its step, so the agent whose nodes head the
  longest remaining path through the episode graph (its own node time plus everything
  downstream) is trained first: Jackson's rule, largest delivery time first, on the slots. The
  graph's topological order (the default) trains a long-tailed agent at the end of a fan-out
  last, and the next iteration's longest rollout then starts last;
- with more rollout replicas than agents, which replicas serve which agent: the balancer's
  critical-path allotment (`latency_allotments`) with phase times scaled from the measured
  ones (a request's time taken as inversely proportional to its agent's replica share).
  With no more replicas than agents, replicas are shared and the pool keeps its
  demand-proportional plan.

The plan changes only placement and order, never what is computed: sampling is keyed by
(seed, sample id, version) and each agent's micro-batches are its own, so runs stay
bit-identical whatever the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexmarl.rollout.balancer import latency_allotments

Node = tuple[str, str, Sequence[str]]  # (node id, agent, input node ids), topological


@dataclass
class MeasuredPlan:
    """One plan: trainable agents most critical first, and (None: keep the pool's own plan)
    the replica indices that serve each agent."""

    iteration: int
    train_order: list[str]
    replicas: dict[str, list[int]] | None
    critical_path_s: float
    node_s: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"train_order": list(self.train_order),
                               "critical_path_s": round(self.critical_path_s, 4)}
        if self.replicas is not None:  # whole replicas each: the share is their number
            out["replicas"] = {a: list(r) for a, r in self.replicas.items()}
            out["share"] = {a: float(len(r)) for a, r in self.replicas.items()}
        return out


def remaining_path(nodes: Sequence[Node], node_s: Mapping[str, float]) -> dict[str, float]:
    """Per node, the longest path from its start to the end of the episode (its own time plus
    its longest chain of successors): the graph's "bottom level"."""
    succ: dict[str, list[str]] = {n: [] for n, _, _ in nodes}
    for n, _, inputs in nodes:
        for i in inputs:
            if i in succ:
                succ[i].append(n)
    out: dict[str, float] = {}
    for n, _, _ in reversed(nodes):
        out[n] = node_s.get(n, 0.0) + max((out[s] for s in succ[n]), default=0.0)
    return out


def critical_order(nodes: Sequence[Node], node_s: Mapping[str, float],
                   agents: Sequence[str]) -> list[str]:
    """`agents`, the one heading the longest remaining path first (ties: graph order)."""
    level = remaining_path(nodes, node_s)
    first: dict[str, int] = {}
    q: dict[str, float] = {}
    for i, (n, agent, _) in enumerate(nodes):
        first.setdefault(agent, i)
        q[agent] = max(q.get(agent, 0.0), level[n])
    return sorted(agents, key=lambda a: (-q.get(a, 0.0), first.get(a, len(nodes)), a))


class MeasuredPlanner:
    """Plans a real runtime between iterations from measured node latencies.

    `nodes`: one episode's nodes (id, agent, inputs) in topological order; `agents`: the
    agents the rollout replicas serve; `n_replicas`: the replicas the runtime was given."""

    def __init__(self, nodes: Sequence[Node], agents: Sequence[str], trainable: Sequence[str],
                 n_replicas: int) -> None:
        self.nodes = [(n, a, tuple(i)) for n, a, i in nodes]
        self.agents = list(agents)
        self.trainable = list(trainable)
        self.n_replicas = n_replicas

    def plan(self, k: int, node_latency: Mapping[str, Sequence[float]],
             share: Mapping[str, float] | None = None) -> MeasuredPlan:
        """The plan for iteration k+1 from iteration k's latencies per node; `share`: each
        agent's replica capacity while they were measured (default 1)."""
        node_s = {n: sum(v) / len(v) for n, v in node_latency.items() if v}
        level = remaining_path(self.nodes, node_s)
        path = max(level.values(), default=0.0)
        order = critical_order(self.nodes, node_s, self.trainable)
        return MeasuredPlan(k + 1, order, self.allot(node_latency, share or {}), path, node_s)

    def allot(self, node_latency: Mapping[str, Sequence[float]],
              share: Mapping[str, float]) -> dict[str, list[int]] | None:
        """Replica indices per agent along the critical path, or None when the replicas must
        be shared (no more of them than agents) or nothing was measured."""
        served = [n for n in self.nodes if n[1] in self.agents]
        agents = list(dict.fromkeys(a for _, a, _ in served))
        if self.n_replicas <= len(agents) or set(agents) != set(self.agents):
            return None
        lat: dict[str, list[float]] = {a: [] for a in agents}
        for n, a, _ in served:
            lat[a] += list(node_latency.get(n, ()))
        if not all(lat.values()):
            return None
        base = {a: (sum(v) / len(v), max(v), max(share.get(a, 1.0), 1e-9))
                for a, v in lat.items()}

        def phase_time(agent: str, r: int) -> tuple[float, float]:
            mean, top, r0 = base[agent]
            return mean * r0 / r, top * r0 / r

        steps = latency_allotments(served, phase_time, self.n_replicas)
        best = min(steps, key=lambda s: (s.critical_path_s, s.accelerators))
        counts = dict(best.replicas)
        for _ in range(self.n_replicas - sum(counts.values())):
            # replicas no move of the critical path wanted: to the agent with the most work
            # per replica, so none is idle
            heavy = max(agents, key=lambda a: (phase_time(a, counts[a])[0]
                                               * sum(1 for _, b, _ in served if b == a), a))
            counts[heavy] += 1
        out, nxt = {}, 0
        for a in self.agents:
            out[a] = list(range(nxt, nxt + counts[a]))
            nxt += counts[a]
        return out
