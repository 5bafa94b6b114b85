"""The resource planner: replica allotment along the episode graph's critical path, the
rollout/training split of the accelerators, and the training slots agents time-share.

Between iterations it plans from the cost model on the workload's (or the last iteration's
measured) lengths and training costs. The simulator follows its plans; the baselines are
particular `SimFeatures` (colocated, static balance, static or sequential training). It is
its own module so that a runtime other than the simulator can host it.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flexmarl.rollout.balancer import allot_replicas, latency_allotments, path_allotment
from flexmarl.sim.cost import CostModel
from flexmarl.sim.workload import Workload

if TYPE_CHECKING:
    from flexmarl.runtime.sim.runtime import SimFeatures


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


@dataclass
class ResourcePlan:
    """One plan: rollout replicas per agent, the accelerators of each pool, each trainable
    agent's training accelerators, the time-shared slots `(members, accelerators per slot,
    slots)` if any, and (colocated) each agent's own accelerators."""

    replicas: dict[str, int]
    rollout_accelerators: int
    train_accelerators: int
    train: dict[str, int]
    shared_slots: tuple[tuple[str, ...], int, int] | None = None
    groups: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plan as recorded (`rollout/plan` in the metrics)."""
        plan: dict[str, Any] = {
            "rollout_accelerators": self.rollout_accelerators,
            "train_accelerators": self.train_accelerators,
            "replicas": dict(self.replicas), "train": dict(self.train)}
        if self.shared_slots is not None:
            members, g, slots = self.shared_slots
            plan["shared_slots"] = {"agents": list(members), "slots": slots,
                                    "accelerators_per_slot": g}
        return plan


class ResourcePlanner:
    """Plans a workload's accelerators for the system `features` describes.

    The measurements are the host's, shared by reference and read at each `plan`: `lengths`
    and `prompts` (each agent's output and prompt lengths since the last plan), `train_cost`
    (per agent: busy training accelerator-seconds and the tokens they trained), and
    `measured_rollout()` (busy rollout accelerator-seconds per agent since it was last
    called). `mode` is the pipeline mode the predicted iteration assumes."""

    def __init__(self, wl: Workload, features: SimFeatures, cost: CostModel, mode: str,
                 lengths: dict[str, list[int]], prompts: dict[str, list[int]],
                 train_cost: dict[str, list[float]],
                 measured_rollout: Callable[[], dict[str, float]]) -> None:
        self.wl = wl
        self.features = features
        self.cost = cost
        self.mode = mode
        self.total = wl.cluster.total_accelerators
        self.trainable = [a.name for a in wl.agents if a.trainable]
        self.nodes = [(n.id, n.agent, n.inputs) for n in wl.episode_nodes()]
        self.lengths = lengths
        self.prompts = prompts
        self.train_cost = train_cost
        self.measured_rollout = measured_rollout
        self.pool_plan: tuple[tuple[str, ...], int, int] | None = None
        # hierarchical: the last plan's replicas (a candidate of the next), and every
        # candidate's predicted iteration (seconds, replicas) of the last plan
        self.previous: dict[str, int] | None = None
        self.predicted: list[tuple[float, dict[str, int]]] = []

    def plan(self, measured: bool = False) -> ResourcePlan:
        """The next plan: from the workload's distributions, or (`measured`) from what the
        last iteration measured."""
        wl, f = self.wl, self.features
        train_d = self.train_demand(measured)
        self.pool_plan = None
        groups = None
        mins = {a: self.cost.min_train_accelerators(wl.agent(a).model) for a in self.trainable}
        if f.colocated:
            groups = self.colocated_groups()
            roll_acc = train_acc = (self.total if f.time_shared else sum(groups.values()))
            replicas = {a.name: groups[a.name] // a.tp for a in wl.agents}
            train_alloc = {a: groups[a] for a in self.trainable}
        elif f.balance == "hierarchical":
            replicas, roll_acc, train_alloc = self.plan_critical_path(measured, train_d, mins)
            if f.fixed_replicas:
                replicas, roll_acc, train_alloc = self.pin_replicas(replicas, train_d, mins)
            train_acc = self.total - roll_acc
        else:
            # the equal-split baselines follow estimated, then measured busy, rollout work
            roll_d = self.measured_rollout() if measured else self.rollout_demand()
            need_train = sum(mins.values())
            need_roll = sum(a.tp for a in wl.agents)
            # in proportion to estimated rollout vs training work
            share = sum(roll_d.values()) / (sum(roll_d.values()) + sum(train_d.values()))
            roll_acc = min(self.total - need_train, max(need_roll, round(self.total * share)))
            train_acc = self.total - roll_acc
            units = {a.name: a.tp for a in wl.agents}
            # the production balancer's equal split, in whole replicas of tp
            replicas = allot_replicas(roll_d, roll_acc, "static", units)
            train_alloc = self.train_split(train_d, train_acc, mins)
        return ResourcePlan(replicas, roll_acc, train_acc, train_alloc, self.pool_plan, groups)

    def rollout_demand(self) -> dict[str, float]:
        """Estimated accelerator-seconds per iteration of each agent's rollout (cost x
        tokens), before anything is measured: the equal-split baselines' rollout/training
        split follows it."""
        wl, cost = self.wl, self.cost
        out = {}
        for a in wl.agents:
            calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
            tokens = calls * a.output_length.mean
            # per-token cost at a typical batch of 64 sequences
            step = cost.decode_step_time(a.model, a.tp, 64, 64 * (self.expected_prompt(a.name)
                                                                   + 256))
            out[a.name] = tokens * step * a.tp / 64
        return out

    def expected_prompt(self, agent: str) -> float:
        """An agent's mean prompt over its nodes of the full graph: its own prompt plus, with
        `append_inputs`, its inputs' mean outputs (a summariser reading three 2,048-token
        drafts trains on 4x the tokens its own prompt says; leaving them out once made the
        first plan starve its training)."""
        spec = self.wl.agent(agent)
        mine = [inputs for _, a, inputs in self.nodes if a == agent]
        if not spec.append_inputs or not mine:
            return spec.prompt_length.mean
        agent_of = {node: a for node, a, _ in self.nodes}
        added = sum(self.wl.agent(agent_of[i]).output_length.mean
                    for inputs in mine for i in inputs) / len(mine)
        return spec.prompt_length.mean + added

    def train_demand(self, measured: bool) -> dict[str, float]:
        """Accelerator-seconds of training each agent needs per iteration: its rows' tokens
        (the last iteration's requests once measured) x its training cost per token (measured
        busy accelerator-seconds per trained token once it has trained, else the cost model's
        6 x params / (peak x MFU)). Per token, not per step: the cost stays the same whatever
        number of accelerators did the work, so the measurement does not follow the plan."""
        wl, cost = self.wl, self.cost
        out = {}
        for a in wl.agents:
            if not a.trainable:
                continue
            if measured and self.lengths.get(a.name):
                tokens = float(sum(self.lengths[a.name]) + sum(self.prompts[a.name]))
            else:
                calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
                tokens = calls * (self.expected_prompt(a.name) + a.output_length.mean)
            spent, trained = self.train_cost[a.name]
            rate = (spent / trained if measured and trained > 0
                    else cost.train_compute_time(a.model, 1, 1.0) + cost.policy_forwards_time(
                        a.model, 1, 1.0, wl.training.forward_passes))
            out[a.name] = rate * tokens
        return out

    def colocated_groups(self) -> dict[str, int]:
        """MARTI: every agent owns an equal share of the cluster (whole replicas of its tp), on
        which its engines and its trainer take turns; time-shared (MAS-RL-like): the share is
        the whole cluster."""
        wl, cost = self.wl, self.cost
        share = self.total if self.features.time_shared else self.total // len(wl.agents)
        out = {}
        for a in wl.agents:
            need = a.tp
            if a.trainable:
                need = max(need, math.ceil(cost.min_train_accelerators(a.model) / a.tp) * a.tp)
            out[a.name] = max(need, share // a.tp * a.tp)
        if not self.features.time_shared and sum(out.values()) > self.total:
            raise ValueError(
                f"workload {wl.name}: the colocated baseline gives each agent its own "
                f"accelerators and needs {sum(out.values())}, but the cluster has {self.total}")
        return out

    def train_split(self, train_d: dict[str, float], train_acc: int,
                     mins: dict[str, int]) -> dict[str, int]:
        """Training accelerators per agent: in proportion to training load (agent-centric),
        equal shares (static), or all of them in turn (sequential)."""
        f = self.features
        if f.sequential_training:
            return dict.fromkeys(self.trainable, train_acc)
        if f.allocation == "agent_centric":
            return balanced_split(train_d, train_acc, mins)
        equal = train_acc // max(1, len(self.trainable))
        return {a: max(mins[a], equal) for a in self.trainable}

    def phases(self, measured: bool) -> dict[str, tuple[np.ndarray, int]]:
        """Per agent, one round's output lengths (longest first) and the mean prompt length:
        the last iteration's requests once measured, else quantiles of the workload's
        distributions for every call of the full graph."""
        wl = self.wl
        out = {}
        for a in wl.agents:
            rounds = len(wl.agent_rounds(a.name))
            lengths = self.lengths.get(a.name) if measured else None
            if lengths:
                ordered = np.sort(np.asarray(lengths, dtype=np.int64))[::-1][::rounds]
                prompt = round(float(np.mean(self.prompts[a.name])))
            else:
                n = wl.episodes_per_iteration * wl.copies_per_round(a.name)
                ordered = np.array([max(1, a.output_length.draw(1 - (i + 0.5) / n))
                                    for i in range(n)], dtype=np.int64)
                ordered[::-1].sort()
                prompt = round(self.expected_prompt(a.name))
            out[a.name] = (ordered, prompt)
        return out

    def plan_critical_path(self, measured: bool, train_d: dict[str, float],
                            mins: dict[str, int]) -> tuple[dict[str, int], int, dict[str, int]]:
        """Hierarchical balancing: the production balancer's critical-path allotment over the
        episode graph, with phase times from the cost model on the (measured) lengths; the
        rollout/training split is the step of that allotment whose predicted iteration is
        shortest: the rollout path plus whatever training delays the next iteration's nodes
        when pipelined, plus the slowest agent's training when synchronous."""
        wl, cost = self.wl, self.cost
        phases = self.phases(measured)

        memo: dict[tuple[str, int], tuple[float, float]] = {}

        def phase_time(agent: str, r: int) -> tuple[float, float]:
            if (agent, r) not in memo:
                lengths, prompt = phases[agent]
                spec = wl.agent(agent)
                timing = cost.generation_timing(spec.model, spec.tp, prompt, lengths[::r])
                memo[agent, r] = float(timing.finish_s.mean()), timing.total_s
            return memo[agent, r]

        units = {a.name: a.tp for a in wl.agents}
        members, g = self.pool_candidates(train_d, mins)
        # a shared pool of S slots frees (len(members) - S) x g accelerators for rollout
        spare = (len(members) - 1) * g if members else 0
        capacity = self.total - sum(mins.values()) + spare
        steps = latency_allotments(self.nodes, phase_time, capacity, units)
        # The greedy steps are a heuristic: the equal splits (the static baseline's rule, at
        # a range of rollout capacities) and the previous plan are candidates too, predicted
        # the same way, so the plan is never worse than them by its own prediction.
        steps += [path_allotment(self.nodes, phase_time, reps, units)
                  for reps in self.other_allotments(capacity, units)]
        calls = self.train_calls()
        best: tuple[float, dict[str, int], int, dict[str, int], int] | None = None
        self.predicted = []
        for step in steps:
            budget = self.total - step.accelerators
            for slots in range(len(members), 0, -1) if members else [0]:
                shared = members if slots < len(members) else ()
                if budget - (slots * g if shared else 0) < sum(
                        mins[a] for a in self.trainable if a not in shared):
                    continue
                alloc, train_s = self.pooled_split(train_d, budget, mins, shared, g, slots,
                                                    calls)
                path = step.critical_path_s
                if self.mode == "sync":
                    cycle = path + max(train_s.values(), default=0.0)
                else:
                    # rows are ready when their episodes end (from about a typical episode's
                    # length on); agent a's nodes of the next iteration, which start once this
                    # rollout is over plus a's offset in the graph, wait for its training
                    cycle = path + max((max(0.0, step.typical_path_s + t - path
                                            - step.first_start_s[a])
                                        for a, t in train_s.items()), default=0.0)
                self.predicted.append((cycle, step.replicas))
                if best is None or cycle < best[0]:
                    best = (cycle, step.replicas, step.accelerators, alloc,
                            slots if shared else 0)
        assert best is not None
        self.pool_plan = (tuple(members), g, best[4]) if best[4] else None
        self.previous = best[1]
        return best[1], best[2], best[3]

    def other_allotments(self, capacity: int, units: dict[str, int]) -> list[dict[str, int]]:
        """Candidates beside the greedy search's steps: equal splits (whole replicas of each
        agent's tp, as the static baseline deals them) of 5%, 10%, ... of the cluster, and
        the previous plan, each where it fits in `capacity`."""
        out = []
        floor = sum(units.values())
        for pct in range(5, 100, 5):
            acc = min(capacity, self.total * pct // 100)
            if acc >= floor:
                reps = allot_replicas(dict.fromkeys(units, 1.0), acc, "static", units)
                if reps not in out:
                    out.append(reps)
        prev = self.previous
        if prev is not None and set(prev) == set(units) \
                and sum(units[a] * n for a, n in prev.items()) <= capacity and prev not in out:
            out.append(dict(prev))
        return out

    def pin_replicas(self, replicas: dict[str, int], train_d: dict[str, float],
                      mins: dict[str, int]) -> tuple[dict[str, int], int, dict[str, int]]:
        """`fixed_replicas` over the planned replicas; training gets the rest, split as the
        system splits it (no time-shared slots)."""
        pinned = dict(replicas)
        for agent, n in (self.features.fixed_replicas or {}).items():
            if agent not in pinned:
                raise ValueError(f"fixed_replicas: no agent {agent!r} in workload "
                                 f"{self.wl.name} (agents: {', '.join(pinned)})")
            if n < 1:
                raise ValueError(f"fixed_replicas.{agent}: needs at least 1 replica, got {n}")
            pinned[agent] = n
        roll_acc = sum(n * self.wl.agent(a).tp for a, n in pinned.items())
        budget = self.total - roll_acc
        if budget < sum(mins.values()):
            raise ValueError(
                f"fixed_replicas: {roll_acc} rollout accelerators leave {budget} for training, "
                f"but the trainers need at least {sum(mins.values())}")
        self.pool_plan = None
        return pinned, roll_acc, self.train_split(train_d, budget, mins)

    def pool_candidates(self, train_d: dict[str, float],
                         mins: dict[str, int]) -> tuple[list[str], int]:
        """Agents that may time-share training slots: the largest set of agents with the same
        memory minimum g that the agent-centric split leaves at that minimum even with every
        accelerator but the rollout's minimum (small, lightly loaded trainers)."""
        f = self.features
        if f.colocated or f.sequential_training or f.allocation != "agent_centric":
            return [], 0
        budget = self.total - sum(a.tp for a in self.wl.agents)
        if budget < sum(mins.values()):
            return [], 0
        alloc = balanced_split(train_d, budget, mins)
        by_g: dict[int, list[str]] = defaultdict(list)
        for a in self.trainable:
            if alloc[a] == mins[a]:
                by_g[mins[a]].append(a)
        if not by_g:
            return [], 0
        g, members = max(by_g.items(), key=lambda kv: (len(kv[1]), -kv[0]))
        return (members, g) if len(members) > 1 else ([], 0)

    def train_calls(self) -> dict[str, float]:
        """Training calls (micro-batches and the step) each agent makes per iteration."""
        wl = self.wl
        mb = wl.micro_batch_size
        return {a: wl.calls_per_episode(a) * wl.episodes_per_iteration / mb + 1
                for a in self.trainable}

    def pooled_split(self, train_d: dict[str, float], budget: int, mins: dict[str, int],
                      shared: Sequence[str], g: int, slots: int,
                      calls: dict[str, float]) -> tuple[dict[str, int], dict[str, float]]:
        """Training accelerators per agent and each agent's predicted training time per
        iteration, with `shared` agents time-sharing `slots` slots of g accelerators (each
        holds g; the rest are split agent-centric). A shared agent's time is the pool's work,
        swaps included (a call finds its state resident with odds slots / members), over its
        slots, and at least its own work on g."""
        own = [a for a in self.trainable if a not in shared]
        rest = budget - (slots * g if shared else 0)
        alloc = self.train_split({a: train_d[a] for a in own}, rest,
                                  {a: mins[a] for a in own})
        train_s = {a: train_d[a] / alloc[a] for a in own}
        if shared:
            miss = 1.0 - slots / len(shared)
            swap = sum(calls[a] * miss * 2 * self.cost.train_state_swap_time(
                self.wl.agent(a).model, g) for a in shared)
            pooled = (sum(train_d[a] for a in shared) / g + swap) / slots
            for a in shared:
                alloc[a] = g
                train_s[a] = max(pooled, train_d[a] / g)
        return alloc, train_s
