"""The planner: one plan for every runtime, between iterations.

A `Plan` carries the rollout replicas per agent (allotted along the episode graph's critical
path), the rollout/training split, the training slots the agents time-share and the order in
which trainable agents get them. `Planner.plan(demand, resources)` makes it; the runtimes
differ only in their `Demand` (`planning/demand.py`): the simulator prices phases and training
with its cost model (`CostModelDemand`), a real runtime with what it measured, node latencies
and training seconds (`MeasuredDemand`). `Resources` says what the planner may decide: the
simulator's cluster is one budget of accelerators to split; a real runtime was given its
rollout replicas and training slots (workers), so only their use is planned.

What the plan changes is placement and order, never what is computed: sampling is keyed by
(seed, sample id, version) and each agent's micro-batches are its own, so runs stay
bit-identical whatever the plan. The simulator's baselines are particular `PlanPolicy`
settings (colocated, static balance, static or sequential training).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flexmarl.rollout.balancer import (
    Allotment,
    allot_replicas,
    latency_allotments,
    path_allotment,
)

Node = tuple[str, str, Sequence[str]]  # (node id, agent, input node ids), topological


class Demand(Protocol):
    """What the planner prices a plan with; the one thing that differs between hosts.

    Units: the simulator's are accelerators and accelerator-seconds; a real runtime's are
    workers (a rollout replica or a training slot is one) and worker-seconds."""

    name: str  # the workload or run, for messages
    nodes: list[Node]  # one episode's nodes, topological
    agents: list[str]  # agents whose requests the rollout replicas serve
    trainable: list[str]
    units: dict[str, int]  # what one replica of an agent takes (tensor-parallel width)
    min_train: dict[str, int]  # what an agent's trainer needs at least

    @property
    def priced(self) -> bool:
        """Whether `phase_time` knows every served agent (a real runtime: each measured)."""
        ...

    def phase_time(self, agent: str, r: int) -> tuple[float, float]:
        """One iteration's requests of `agent` served on r replicas: the mean and the
        largest time from submission to completion."""
        ...

    def node_seconds(self, replicas: Mapping[str, int] | None) -> dict[str, float]:
        """Each node's time in one episode (with `replicas`, where the host predicts it)."""
        ...

    def train_seconds(self) -> dict[str, float]:
        """Training work per trainable agent and iteration (units x seconds)."""
        ...

    def train_calls(self) -> dict[str, float]:
        """Training calls (micro-batches and the step) each agent makes per iteration."""
        ...

    def swap_seconds(self, agent: str, g: int) -> float:
        """Moving the agent's training state between a slot of g units and the host."""
        ...

    def rollout_work(self) -> dict[str, float]:
        """Rollout work per agent and iteration: the static split's proportions."""
        ...


class PlanPolicy(Protocol):
    """What the planned system does (the simulator's `SimFeatures` are one)."""

    colocated: bool
    balance: str
    allocation: str
    sequential_training: bool
    time_shared: bool
    fixed_replicas: dict[str, int] | None


@dataclass
class Policy:
    """The real runtimes' policy: separate pools, `balance` as configured, agent-centric
    training slots."""

    balance: str = "hierarchical"
    colocated: bool = False
    allocation: str = "agent_centric"
    sequential_training: bool = False
    time_shared: bool = False
    fixed_replicas: dict[str, int] | None = None


@dataclass(frozen=True)
class Resources:
    """What there is to plan: `total` units; `rollout` / `train_slots` fixed when the runtime
    was given them (a real runtime's workers), None when the planner splits (simulator)."""

    total: int
    rollout: int | None = None
    train_slots: int | None = None
    # the devices (ranks) of each training slot when they differ (`runtime.slot_sizes`)
    slot_sizes: tuple[int, ...] | None = None


@dataclass
class Plan:
    """One plan: rollout replicas per agent (None: no more replicas than agents, so they are
    shared and the pool keeps its demand-proportional plan), the units of each pool, each
    trainable agent's training units, the time-shared slots `(members, units per slot,
    slots)` if any, the training order (most critical first), (colocated) each agent's own
    units, the episode's critical path and the predicted iteration."""

    iteration: int
    replicas: dict[str, int] | None
    rollout_accelerators: int
    train_accelerators: int
    train: dict[str, int]
    train_order: list[str] = field(default_factory=list)
    shared_slots: tuple[tuple[str, ...], int, int] | None = None
    groups: dict[str, int] | None = None
    critical_path_s: float = 0.0
    predicted_s: float | None = None
    node_s: dict[str, float] = field(default_factory=dict)
    # the replicas are interchangeable workers (real runtimes): the pool follows indices
    indexed: bool = False
    # training slots of different sizes, or of more than one device: their devices, and the
    # slot each agent is bound to (`bind_slots`: the heaviest agent on the largest slot)
    slot_sizes: list[int] | None = None
    slot_of: dict[str, int] | None = None

    def replica_indices(self) -> dict[str, list[int]] | None:
        """Which replicas serve each agent: contiguous runs, in agent order."""
        if self.replicas is None:
            return None
        out, nxt = {}, 0
        for agent, n in self.replicas.items():
            out[agent] = list(range(nxt, nxt + n))
            nxt += n
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan as recorded (`rollout/plan` in the metrics, the simulator's plans)."""
        plan: dict[str, Any] = {
            "rollout_accelerators": self.rollout_accelerators,
            "train_accelerators": self.train_accelerators,
            "train": dict(self.train), "train_order": list(self.train_order),
            "critical_path_s": round(self.critical_path_s, 4)}
        if self.replicas is not None:
            if self.indexed:  # whole replicas each: the share is their number
                plan["replicas"] = self.replica_indices()
                plan["share"] = {a: float(n) for a, n in self.replicas.items()}
            else:
                plan["replicas"] = dict(self.replicas)
        if self.shared_slots is not None:
            members, g, slots = self.shared_slots
            plan["shared_slots"] = {"agents": list(members), "slots": slots,
                                    "accelerators_per_slot": g}
        if self.predicted_s is not None:
            plan["predicted_s"] = round(self.predicted_s, 4)
        if self.slot_sizes is not None:
            plan["slot_sizes"] = list(self.slot_sizes)
            plan["slot_of"] = dict(self.slot_of or {})
        return plan


def bind_slots(load: Mapping[str, float], sizes: Sequence[int]) -> dict[str, int]:
    """Agent-centric allocation over slots of different sizes (devices): agents in order of
    decreasing training load, each to the slot whose load per device would be smallest with
    it (ties: the larger slot), so the heaviest agent gets the largest slot and the others
    fill the slots in proportion to their devices. Returns agent -> slot index."""
    per_slot = [0.0] * len(sizes)
    out: dict[str, int] = {}
    for agent in sorted(load, key=lambda a: (-load[a], a)):
        best = min(range(len(sizes)),
                   key=lambda i: ((per_slot[i] + load[agent]) / sizes[i], -sizes[i], i))
        per_slot[best] += load[agent]
        out[agent] = best
    return out


def balanced_split(load: dict[str, float], total: int, minimum: dict[str, int]) -> dict[str, int]:
    """Split `total` units so that the slowest agent's load / units is as small as possible,
    each agent getting at least `minimum[name]`: one unit at a time to the agent whose load
    per unit is the largest (proportional shares would leave an agent with a large memory
    minimum over-served and the others waiting on it)."""
    out = dict(minimum)
    heap = [(-load[k] / out[k], k) for k in out]
    heapq.heapify(heap)
    for _ in range(total - sum(out.values()) if heap else 0):  # nobody to give units to
        _, k = heapq.heappop(heap)
        out[k] += 1
        heapq.heappush(heap, (-load[k] / out[k], k))
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
    """`agents`, the one heading the longest remaining path first (ties: graph order).

    An agent's next-iteration nodes wait for its step, so the agent whose nodes head the
    longest remaining path is trained first: Jackson's rule, largest delivery time first, on
    the slots. Graph order would train a long-tailed agent at the end of a fan-out last, and
    the next iteration's longest rollout would then start last."""
    level = remaining_path(nodes, node_s)
    first: dict[str, int] = {}
    q: dict[str, float] = {}
    for i, (n, agent, _) in enumerate(nodes):
        first.setdefault(agent, i)
        q[agent] = max(q.get(agent, 0.0), level[n])
    return sorted(agents, key=lambda a: (-q.get(a, 0.0), first.get(a, len(nodes)), a))


class Planner:
    """Plans every runtime between iterations (see the module docstring).

    `mode` is the pipeline mode the predicted iteration assumes: rollout and training
    overlapped (`async`, `one_step_off`) or one after the other (`sync`). Keeps what it last
    planned from (`demand`, `resources`), every candidate's predicted iteration of the last
    plan (`predicted`: seconds, replicas) and the last plan's replicas (`previous`, a
    candidate of the next)."""

    def __init__(self, mode: str = "async", policy: PlanPolicy | None = None) -> None:
        self.mode = mode
        self.features: PlanPolicy = policy if policy is not None else Policy()
        self.previous: dict[str, int] | None = None
        self.predicted: list[tuple[float, dict[str, int]]] = []
        self.demand: Demand | None = None
        self.resources = Resources(0)

    # --- the plan ------------------------------------------------------------------------
    def plan(self, demand: Demand, resources: Resources, iteration: int = 0) -> Plan:
        """The plan for `iteration` from `demand`, within `resources`."""
        self.demand, self.resources = demand, resources
        f = self.features
        total = resources.total
        train_d = demand.train_seconds()
        mins = dict(demand.min_train)
        if resources.slot_sizes is not None:
            largest = max(resources.slot_sizes)
            for agent in demand.trainable:
                if mins.get(agent, 1) > largest:
                    raise ValueError(
                        f"{demand.name}: agent {agent!r} needs {mins[agent]} devices to train "
                        f"(its weights, gradients and optimizer state), the largest training "
                        f"slot has {largest} (slot_sizes {list(resources.slot_sizes)})")
        shared: tuple[tuple[str, ...], int, int] | None = None
        groups = None
        replicas: dict[str, int] | None
        predicted: float | None = None
        if f.colocated:
            groups = self.colocated_groups()
            roll_acc = train_acc = (total if f.time_shared else sum(groups.values()))
            replicas = {a: groups[a] // demand.units[a] for a in demand.agents}
            train_alloc = {a: groups[a] for a in demand.trainable}
        elif f.balance == "hierarchical":
            replicas, roll_acc, train_alloc, shared, predicted = self.plan_critical_path(
                train_d, mins)
            if f.fixed_replicas:
                assert replicas is not None
                replicas, roll_acc, train_alloc = self.pin_replicas(replicas, train_d, mins)
                shared = None
            train_acc = total - roll_acc
        else:
            # the equal-split baselines follow estimated, then measured busy, rollout work
            if resources.rollout is None:
                roll_d = demand.rollout_work()
                need_train = sum(mins.values())
                need_roll = sum(demand.units[a] for a in demand.agents)
                # in proportion to estimated rollout vs training work
                share = sum(roll_d.values()) / (sum(roll_d.values()) + sum(train_d.values()))
                roll_acc = min(total - need_train, max(need_roll, round(total * share)))
                # the production balancer's equal split, in whole replicas of tp
                replicas = allot_replicas(roll_d, roll_acc, "static", demand.units)
            else:  # a real pool deals its replicas equally itself
                roll_acc, replicas = resources.rollout, None
            train_acc = total - roll_acc
            if resources.train_slots is not None:
                train_alloc, shared = self.fixed_slots(resources.train_slots)
            else:
                train_alloc = self.train_split(train_d, train_acc, mins)
        node_s = demand.node_seconds(replicas)
        order = critical_order(demand.nodes, node_s, demand.trainable)
        path = max(remaining_path(demand.nodes, node_s).values(), default=0.0)
        plan = Plan(iteration, replicas, roll_acc, train_acc, train_alloc, order, shared,
                    groups, path, predicted, node_s, indexed=resources.rollout is not None)
        if resources.slot_sizes is not None and (len(set(resources.slot_sizes)) > 1
                                                 or max(resources.slot_sizes) > 1):
            sizes = list(resources.slot_sizes)
            plan.slot_sizes = sizes
            plan.slot_of = bind_slots({a: train_d.get(a, 0.0) for a in demand.trainable}, sizes)
            plan.train = {a: sizes[i] for a, i in plan.slot_of.items()}
            plan.train_accelerators = sum(sizes)
        return plan

    def plan_critical_path(
        self, train_d: dict[str, float], mins: dict[str, int],
    ) -> tuple[dict[str, int] | None, int, dict[str, int],
               tuple[tuple[str, ...], int, int] | None, float | None]:
        """Hierarchical balancing: the balancer's critical-path allotment over the episode
        graph, with the demand's phase times; the rollout/training split (when the planner
        has one to make) and the number of time-shared slots are the candidate whose
        predicted iteration is shortest: the rollout path plus whatever training delays the
        next iteration's nodes when pipelined, plus the slowest agent's training when
        synchronous. With rollout replicas fixed (a real runtime), only their allotment is
        chosen; with no more replicas than agents there is none to choose."""
        demand, res = self.demand, self.resources
        assert demand is not None
        total = res.total
        units = {a: demand.units[a] for a in demand.agents}
        if res.train_slots is not None:
            slots_given = max(1, res.train_slots)
            members = list(demand.trainable) if slots_given < len(demand.trainable) else []
            g = 1 if members else 0
            slot_counts = [slots_given] if members else [0]
        else:
            members, g = self.pool_candidates(train_d, mins)
            slot_counts = list(range(len(members), 0, -1)) if members else [0]
        if res.rollout is None:
            # a shared pool of S slots frees (len(members) - S) x g accelerators for rollout
            spare = (len(members) - 1) * g if members else 0
            capacity = total - sum(mins.values()) + spare
        else:
            capacity = res.rollout
        # the nodes the replicas serve (an agent behind an endpoint has none to allot)
        served = [n for n in demand.nodes if n[1] in units]
        steps: list[Allotment] = []
        if res.rollout is None or (capacity > len(units) and demand.priced):
            steps = latency_allotments(served, demand.phase_time, capacity, units)
            # The greedy steps are a heuristic: the equal splits (the static baseline's rule,
            # at a range of rollout capacities) and the previous plan are candidates too,
            # predicted the same way, so the plan is never worse than them by its own
            # prediction.
            steps += [path_allotment(served, demand.phase_time, reps, units)
                      for reps in self.other_allotments(capacity, units)]
        calls = demand.train_calls()
        best: tuple[float, dict[str, int] | None, int, dict[str, int], int] | None = None
        self.predicted = []
        candidates: list[Allotment | None] = list(steps) or [None]
        for step in candidates:
            used = res.rollout if res.rollout is not None else (
                step.accelerators if step is not None else 0)
            budget = total - used
            for slots in slot_counts:
                pooled = members if slots < len(members) else ()
                if budget - (slots * g if pooled else 0) < sum(
                        mins[a] for a in demand.trainable if a not in pooled):
                    continue
                alloc, train_s = self.pooled_split(train_d, budget, mins, pooled, g, slots,
                                                   calls)
                cycle = self.cycle(step, train_s)
                if step is not None:
                    self.predicted.append((cycle, step.replicas))
                if best is None or cycle < best[0]:
                    best = (cycle, None if step is None else step.replicas, used, alloc,
                            slots if pooled else 0)
        if best is None:
            raise ValueError(f"{demand.name}: {total} units leave too few for the trainers "
                             f"(they need {sum(mins.values())})")
        cycle, replicas, used, alloc, slots = best
        self.previous = replicas
        if replicas is not None and res.rollout is not None:
            replicas = self.fill(replicas, res.rollout)
        shared = (tuple(members), g, slots) if slots else None
        return replicas, used, alloc, shared, (cycle if steps else None)

    def cycle(self, step: Allotment | None, train_s: dict[str, float]) -> float:
        """The predicted iteration of a rollout allotment and training times."""
        if step is None:  # nothing priced: the training alone
            return max(train_s.values(), default=0.0)
        path = step.critical_path_s
        if self.mode == "sync":
            return path + max(train_s.values(), default=0.0)
        # rows are ready when their episodes end (from about a typical episode's length on);
        # agent a's nodes of the next iteration, which start once this rollout is over plus
        # a's offset in the graph, wait for its training
        return path + max((max(0.0, step.typical_path_s + t - path - step.first_start_s[a])
                           for a, t in train_s.items()), default=0.0)

    def fill(self, replicas: dict[str, int], n_replicas: int) -> dict[str, int]:
        """Replicas no move of the critical path wanted (a real runtime has them anyway): to
        the agent with the most work per replica, so none is idle."""
        demand = self.demand
        assert demand is not None
        counts = dict(replicas)
        calls = {a: sum(1 for _, b, _ in demand.nodes if b == a) for a in counts}
        for _ in range(n_replicas - sum(counts.values())):
            heavy = max(counts, key=lambda a: (demand.phase_time(a, counts[a])[0] * calls[a], a))
            counts[heavy] += 1
        return counts

    def other_allotments(self, capacity: int, units: dict[str, int]) -> list[dict[str, int]]:
        """Candidates beside the greedy search's steps: equal splits (whole replicas of each
        agent's tp, as the static baseline deals them) of 5%, 10%, ... of the cluster, and
        the previous plan, each where it fits in `capacity`."""
        out = []
        floor = sum(units.values())
        for pct in range(5, 100, 5):
            acc = min(capacity, self.resources.total * pct // 100)
            if acc >= floor:
                reps = allot_replicas(dict.fromkeys(units, 1.0), acc, "static", units)
                if reps not in out:
                    out.append(reps)
        prev = self.previous
        if prev is not None and set(prev) == set(units) \
                and sum(units[a] * n for a, n in prev.items()) <= capacity and prev not in out:
            out.append(dict(prev))
        return out

    # --- training ------------------------------------------------------------------------
    def fixed_slots(self, slots: int) -> tuple[dict[str, int], tuple[tuple[str, ...], int, int]
                                               | None]:
        """A real runtime's training slots: one each, or all agents time-sharing them."""
        assert self.demand is not None
        trainable = self.demand.trainable
        shared = (tuple(trainable), 1, slots) if slots < len(trainable) else None
        return dict.fromkeys(trainable, 1), shared

    def colocated_groups(self) -> dict[str, int]:
        """MARTI: every agent owns an equal share of the cluster (whole replicas of its tp), on
        which its engines and its trainer take turns; time-shared (MAS-RL-like): the share is
        the whole cluster."""
        demand = self.demand
        assert demand is not None
        total = self.resources.total
        share = total if self.features.time_shared else total // len(demand.agents)
        out = {}
        for a in demand.agents:
            tp = demand.units[a]
            need = tp
            if a in demand.trainable:
                need = max(need, math.ceil(demand.min_train[a] / tp) * tp)
            out[a] = max(need, share // tp * tp)
        if not self.features.time_shared and sum(out.values()) > total:
            raise ValueError(
                f"workload {demand.name}: the colocated baseline gives each agent its own "
                f"accelerators and needs {sum(out.values())}, but the cluster has {total}")
        return out

    def train_split(self, train_d: dict[str, float], train_acc: int,
                    mins: dict[str, int]) -> dict[str, int]:
        """Training accelerators per agent: in proportion to training load (agent-centric),
        equal shares (static), or all of them in turn (sequential)."""
        f = self.features
        assert self.demand is not None
        trainable = [a for a in self.demand.trainable if a in mins]
        if f.sequential_training:
            return dict.fromkeys(trainable, train_acc)
        if f.allocation == "agent_centric":
            return balanced_split(train_d, train_acc, mins)
        equal = train_acc // max(1, len(trainable))
        return {a: max(mins[a], equal) for a in trainable}

    def pin_replicas(self, replicas: dict[str, int], train_d: dict[str, float],
                     mins: dict[str, int]) -> tuple[dict[str, int], int, dict[str, int]]:
        """`fixed_replicas` over the planned replicas; training gets the rest, split as the
        system splits it (no time-shared slots)."""
        demand = self.demand
        assert demand is not None
        pinned = dict(replicas)
        for agent, n in (self.features.fixed_replicas or {}).items():
            if agent not in pinned:
                raise ValueError(f"fixed_replicas: no agent {agent!r} in workload "
                                 f"{demand.name} (agents: {', '.join(pinned)})")
            if n < 1:
                raise ValueError(f"fixed_replicas.{agent}: needs at least 1 replica, got {n}")
            pinned[agent] = n
        roll_acc = sum(n * demand.units[a] for a, n in pinned.items())
        budget = self.resources.total - roll_acc
        if budget < sum(mins.values()):
            raise ValueError(
                f"fixed_replicas: {roll_acc} rollout accelerators leave {budget} for training, "
                f"but the trainers need at least {sum(mins.values())}")
        return pinned, roll_acc, self.train_split(train_d, budget, mins)

    def pool_candidates(self, train_d: dict[str, float],
                        mins: dict[str, int]) -> tuple[list[str], int]:
        """Agents that may time-share training slots: the largest set of agents with the same
        memory minimum g that the agent-centric split leaves at that minimum even with every
        accelerator but the rollout's minimum (small, lightly loaded trainers)."""
        f = self.features
        demand = self.demand
        assert demand is not None
        if f.colocated or f.sequential_training or f.allocation != "agent_centric":
            return [], 0
        budget = self.resources.total - sum(demand.units[a] for a in demand.agents)
        if budget < sum(mins.values()):
            return [], 0
        alloc = balanced_split(train_d, budget, mins)
        by_g: dict[int, list[str]] = defaultdict(list)
        for a in demand.trainable:
            if alloc[a] == mins[a]:
                by_g[mins[a]].append(a)
        if not by_g:
            return [], 0
        g, members = max(by_g.items(), key=lambda kv: (len(kv[1]), -kv[0]))
        return (members, g) if len(members) > 1 else ([], 0)

    def pooled_split(self, train_d: dict[str, float], budget: int, mins: dict[str, int],
                     shared: Sequence[str], g: int, slots: int,
                     calls: dict[str, float]) -> tuple[dict[str, int], dict[str, float]]:
        """Training units per agent and each agent's predicted training time per iteration,
        with `shared` agents time-sharing `slots` slots of g units (each holds g; the rest
        are split agent-centric). A shared agent's time is the pool's work, swaps included (a
        call finds its state resident with odds slots / members), over its slots, and at
        least its own work on g."""
        demand = self.demand
        assert demand is not None
        own = [a for a in demand.trainable if a not in shared]
        rest = budget - (slots * g if shared else 0)
        alloc = self.train_split({a: train_d[a] for a in own}, rest,
                                 {a: mins[a] for a in own})
        train_s = {a: train_d[a] / alloc[a] for a in own}
        if shared:
            miss = 1.0 - slots / len(shared)
            swap = sum(calls[a] * miss * 2 * demand.swap_seconds(a, g) for a in shared)
            pooled = (sum(train_d[a] for a in shared) / g + swap) / slots
            for a in shared:
                alloc[a] = g
                train_s[a] = max(pooled, train_d[a] / g)
        return alloc, train_s
