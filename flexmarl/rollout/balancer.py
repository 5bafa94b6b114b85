"""Hierarchical load balancing of rollout (docs/design.md section 6), shared by every runtime.

Two levels, as in the paper:
- inter-agent: rollout capacity (replicas, or shares of one) is allotted to agents in
  proportion to their measured demand, tokens generated x per-token model cost, read from the
  experience store's statistics and re-planned between iterations;
- intra-agent: a request goes to the replica of its agent with the least outstanding work,
  counted in tokens (prompt + expected output), not in requests, except that the samples of
  a group and the turns of its episodes stay on one replica (affinity: they share a prompt or
  a conversation, which that replica's prefix cache holds) unless it carries clearly more
  work than the least loaded one.
`static` is the peers' behaviour (MARTI-like): replicas split equally between agents, requests
dealt round robin whatever their length. `shared` (MAS-RL-like) gives every agent every
replica, requests dealt round robin: under a turn-by-turn schedule each turn's agents hold the
whole pool.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

BalanceMode = Literal["hierarchical", "static", "shared"]

# Prefill processes a prompt in one batched forward pass, decode one token per pass over the
# weights: on memory-bound engines a prompt token costs roughly a tenth of a generated one.
PREFILL_TOKEN_WEIGHT = 0.1

# A group or episode stays on its replica while that replica's outstanding work is within
# this many tokens (or this fraction) of the least loaded replica's: enough for a GRPO group of
# 8 samples of a few hundred tokens, or the next turns of a conversation, to follow each other.
AFFINITY_SLACK_TOKENS = 8192
AFFINITY_SLACK_RATIO = 0.5
AFFINITY_MEMORY = 1 << 16  # affinity keys remembered (least recently used forgotten first)


def affinity_key(sample_id: str) -> str | None:
    """What a request shares its prompt prefix with: the input id of `{input_id}_{turn}_
    {trajectory}` (store.experience.make_sample_id), the same for every sample of a group and
    every turn of their episodes; None for an id of another form (no affinity)."""
    parts = sample_id.rsplit("_", 2)
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()) or not parts[0]:
        return None
    return parts[0]


def allot_replicas(
    demand: Mapping[str, float],
    capacity: int,
    mode: BalanceMode = "hierarchical",
    units: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Replicas per agent: one each, then one at a time to the agent with the most demand per
    replica (`hierarchical`) or the fewest accelerators (`static`). A replica of agent a takes
    `units[a]` of the `capacity` (its tensor-parallel width; 1 by default)."""
    units = dict(units or dict.fromkeys(demand, 1))
    replicas = dict.fromkeys(demand, 1)
    budget = capacity - sum(units.values())
    while budget > 0:
        cands = [a for a in demand if units[a] <= budget]
        if not cands:
            break
        if mode == "hierarchical":
            best = max(cands, key=lambda a: (demand[a] / replicas[a], a))
        else:
            best = min(cands, key=lambda a: (replicas[a] * units[a], a))
        replicas[best] += 1
        budget -= units[best]
    return replicas


@dataclass(frozen=True)
class Allotment:
    """One step of `latency_allotments`: replicas per agent, the accelerators they take and
    the predicted critical path of one iteration's rollout with them."""

    replicas: dict[str, int]
    accelerators: int
    critical_path_s: float
    typical_path_s: float = 0.0  # the same path without any tail: a typical episode's length
    # when each agent's first node starts in a typical episode
    first_start_s: dict[str, float] = field(default_factory=dict)


class _PathModel:
    """The predicted critical path of one iteration's rollout for given replicas (see
    `latency_allotments`): every node at its agent's mean phase time, plus the largest tail
    of any agent. Phase times are memoised: a search asks for the same ones many times."""

    def __init__(self, nodes: Sequence[tuple[str, str, Sequence[str]]],
                 phase_time: Callable[[str, int], tuple[float, float]]) -> None:
        self.nodes = [(node, agent, tuple(inputs)) for node, agent, inputs in nodes]
        self.agents = list(dict.fromkeys(agent for _, agent, _ in nodes))
        self.calls = {a: sum(1 for _, agent, _ in nodes if agent == a) for a in self.agents}
        self.phase_time = phase_time
        self.memo: dict[tuple[str, int], tuple[float, float]] = {}

    def d(self, agent: str, r: int) -> tuple[float, float]:
        key = (agent, r)
        out = self.memo.get(key)
        if out is None:
            out = self.memo[key] = self.phase_time(agent, r)
        return out

    def mean(self, agent: str, r: int) -> float:
        return self.d(agent, r)[0]

    def typical_of(self, means: Mapping[str, float]) -> tuple[float, dict[str, float]]:
        """The longest path with every node at its agent's mean time, and when each agent's
        first node starts on it."""
        end: dict[str, float] = {}
        first: dict[str, float] = {}
        for node, agent, inputs in self.nodes:
            start = max((end[i] for i in inputs if i in end), default=0.0)
            first[agent] = min(first.get(agent, start), start)
            end[node] = start + means[agent]
        return max(end.values(), default=0.0), first

    def tail(self, replicas: Mapping[str, int]) -> float:
        return max(self.d(a, replicas[a])[1] - self.d(a, replicas[a])[0] for a in self.agents)

    def allotment(self, replicas: Mapping[str, int], used: int) -> Allotment:
        mean, first = self.typical_of({a: self.mean(a, replicas[a]) for a in self.agents})
        return Allotment(dict(replicas), used, mean + self.tail(replicas), mean, first)

    def objective(self, replicas: Mapping[str, int]) -> float:
        """What the search shortens: the predicted path, plus a small term for the mean node
        time (over every call) that breaks ties between parallel branches."""
        means = {a: self.mean(a, replicas[a]) for a in self.agents}
        calls = self.calls
        spread = sum(calls[a] * means[a] for a in self.agents) / max(1, sum(calls.values()))
        return self.typical_of(means)[0] + self.tail(replicas) + 0.1 * spread

    def near_critical(self, replicas: Mapping[str, int], band: float) -> tuple[str, ...]:
        """Agents with a node on a path within `band` of the longest (typical) one: the
        branches that only shorten the iteration when they all get replicas together."""
        end: dict[str, float] = {}
        dur: dict[str, float] = {}
        for node, agent, inputs in self.nodes:
            dur[node] = self.d(agent, replicas[agent])[0]
            end[node] = max((end[i] for i in inputs if i in end), default=0.0) + dur[node]
        after: dict[str, float] = dict.fromkeys(end, 0.0)  # longest path from a node's end
        for node, _, inputs in reversed(self.nodes):
            for i in inputs:
                if i in after:
                    after[i] = max(after[i], dur[node] + after[node])
        longest = max((end[n] + after[n] for n in end), default=0.0)
        return tuple(dict.fromkeys(agent for node, agent, _ in self.nodes
                                   if end[node] + after[node] >= (1 - band) * longest))

    def moves(self, replicas: Mapping[str, int],
              pairs: list[tuple[str, str]]) -> list[tuple[str, ...]]:
        """The search's moves: one replica to one agent, to two agents at once, or to every
        agent on a near-critical path. One agent at a time stalls on parallel branches that
        tie: a replica for either alone leaves the longest branch as long while its tail term
        grows, so no single move gains even though both together shorten the iteration. Three
        or more branches that nearly tie (measured lengths differ a little) stall pairs too:
        the agents within 1% and within 10% of the longest path, and every agent at once, are
        moves too."""
        moves: list[tuple[str, ...]] = [(a,) for a in self.agents]
        moves += pairs
        for band in (0.01, 0.1):
            group = self.near_critical(replicas, band)
            if len(group) > 2 and group not in moves:
                moves.append(group)
        if len(self.agents) > 2 and tuple(self.agents) not in moves:
            moves.append(tuple(self.agents))
        return moves


def path_allotment(
    nodes: Sequence[tuple[str, str, Sequence[str]]],
    phase_time: Callable[[str, int], tuple[float, float]],
    replicas: Mapping[str, int],
    units: Mapping[str, int] | None = None,
) -> Allotment:
    """Any allotment (e.g. the equal split, or the previous plan) predicted as
    `latency_allotments` predicts its own steps, so a planner can compare them."""
    units = dict(units or dict.fromkeys(replicas, 1))
    return _PathModel(nodes, phase_time).allotment(
        replicas, sum(units[a] * n for a, n in replicas.items()))


def latency_allotments(
    nodes: Sequence[tuple[str, str, Sequence[str]]],
    phase_time: Callable[[str, int], tuple[float, float]],
    capacity: int,
    units: Mapping[str, int] | None = None,
) -> list[Allotment]:
    """Replica allotments that shorten one iteration's critical path, a move at a time.

    Why: proportional-to-tokens allotment (`allot_replicas`) is right when rollout is
    throughput-bound. Multi-agent rollouts are often latency-bound instead: the graph chains
    agents, so an iteration lasts as long as its slowest episode's path through the graph, and
    a long-tailed agent's slowest sequence decodes at the speed of the batch it shares.

    `phase_time(agent, r)` gives, for one iteration's requests of that agent served on r
    replicas, the mean and the largest time from submission to completion (from a cost model
    or from measurements). The predicted path is the longest path through one episode's
    `nodes` (id, agent, input ids; topological) with every node taking its agent's mean
    time, plus the largest tail (largest - mean) of any agent on it: requests finish at
    different times, so one episode meets one agent's slowest request, not every agent's.
    Each step makes the move that shortens the path the most per accelerator: one more
    replica for one agent, for two agents together, for every agent on a near-critical
    path (within 1% or 10% of the longest), or for every agent (parallel branches that tie
    only shorten the iteration together; a small term for the mean node time breaks ties
    between branches). It stops when no move helps or the
    capacity is used. Every step is returned, so the caller can trade rollout capacity
    against training capacity.
    """
    model = _PathModel(nodes, phase_time)
    agents = model.agents
    units = dict(units or dict.fromkeys(agents, 1))
    replicas = dict.fromkeys(agents, 1)
    used = sum(units[a] for a in agents)
    if used > capacity:
        raise ValueError(f"rollout capacity {capacity} cannot hold one replica of every agent "
                         f"(needs {used})")
    steps = [model.allotment(replicas, used)]
    current = model.objective(replicas)
    pairs = list(itertools.combinations(agents, 2))
    while True:
        best, best_gain, best_value = None, 0.0, current
        for move in model.moves(replicas, pairs):
            cost = sum(units[a] for a in move)
            if used + cost > capacity:
                continue
            for a in move:
                replicas[a] += 1
            value = model.objective(replicas)
            for a in move:
                replicas[a] -= 1
            gain = (current - value) / cost
            if gain > best_gain:  # ties: the first move (single agents first, graph order)
                best, best_gain, best_value = move, gain, value
        if best is None or best_gain <= 1e-9 * max(current, 1.0):
            return steps
        for a in best:
            replicas[a] += 1
            used += units[a]
        current = best_value
        steps.append(model.allotment(replicas, used))


def share_replicas(demand: Mapping[str, float], n_replicas: int) -> dict[str, list[int]]:
    """Capacity in proportion to demand, in whole replicas and shares of one.

    Agent a's share is n_replicas x demand_a / total demand. Heaviest first, an agent takes a
    replica of its own for each whole unit of its share, and places the fraction left (or its
    whole share, when below one) on the replica with the most capacity still free, which it
    then shares with others. Every agent gets at least one replica.
    """
    total = sum(demand.values()) or 1.0
    free = [1.0] * n_replicas
    out: dict[str, list[int]] = {}
    for agent in sorted(demand, key=lambda a: (-demand[a], a)):
        share = n_replicas * demand[agent] / total
        mine: list[int] = []
        while share >= 1.0 - 1e-9:
            empty = [r for r in range(n_replicas) if free[r] >= 1.0 - 1e-9]
            if not empty:
                break
            mine.append(empty[0])
            free[empty[0]] = 0.0
            share -= 1.0
        if share > 1e-6 or not mine:
            r = max(range(n_replicas), key=lambda i: (free[i], -i))
            if r not in mine:
                mine.append(r)
            free[r] -= share
        out[agent] = sorted(mine)
    return out


def equal_split(agents: Sequence[str], n_replicas: int) -> dict[str, list[int]]:
    """The static baseline: replicas dealt out equally, agent by agent (shared when fewer)."""
    if n_replicas < len(agents):
        return {a: [i % n_replicas] for i, a in enumerate(agents)}
    per, extra = divmod(n_replicas, len(agents))
    out, nxt = {}, 0
    for i, a in enumerate(agents):
        n = per + (1 if i < extra else 0)
        out[a] = list(range(nxt, nxt + n))
        nxt += n
    return out


@dataclass
class RolloutPlan:
    """Which replicas serve which agent during one iteration, and the demand it came from."""

    iteration: int
    mode: BalanceMode
    replicas: dict[str, list[int]]
    demand: dict[str, float] = field(default_factory=dict)

    def share(self) -> dict[str, float]:
        """Replica capacity per agent (a shared replica counts 1/number of its agents)."""
        users: dict[int, int] = {}
        for reps in self.replicas.values():
            for r in reps:
                users[r] = users.get(r, 0) + 1
        return {a: sum(1 / users[r] for r in reps) for a, reps in self.replicas.items()}

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "mode": self.mode, "replicas": self.replicas,
                "demand": {a: round(d, 3) for a, d in self.demand.items()},
                "share": {a: round(s, 3) for a, s in self.share().items()}}


class Balancer:
    """Plans agents onto replicas and picks a replica for each request."""

    def __init__(
        self,
        agents: Sequence[str],
        n_replicas: int,
        mode: BalanceMode = "hierarchical",
        cost_per_token: Mapping[str, float] | None = None,
        affinity_slack_tokens: float = AFFINITY_SLACK_TOKENS,
        affinity_slack_ratio: float = AFFINITY_SLACK_RATIO,
    ) -> None:
        if n_replicas < 1:
            raise ValueError("a rollout pool needs at least one replica")
        self.agents = list(agents)
        self.n_replicas = n_replicas
        self.mode = mode
        self.cost_per_token = dict(cost_per_token or dict.fromkeys(agents, 1.0))
        self._round_robin = {a: itertools.count() for a in agents}
        self._out_tokens: dict[str, list[int]] = {a: [0, 0] for a in agents}  # sum, count
        # (agent, affinity key) -> the replica its group / episode went to
        self._home: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.affinity_slack_tokens = affinity_slack_tokens
        self.affinity_slack_ratio = affinity_slack_ratio
        self.plans: list[RolloutPlan] = []
        self.plan = self._make_plan(0, None)

    # --- inter-agent -------------------------------------------------------------------------
    def demand_from(self, stats: Mapping[str, object]) -> dict[str, float]:
        """Demand of each agent from the store's generation statistics of one iteration."""
        out = {}
        for a in self.agents:
            s = stats.get(a)
            tokens = 0.0 if s is None else (
                s.response_tokens + PREFILL_TOKEN_WEIGHT * s.prompt_tokens)  # type: ignore[attr-defined]
            out[a] = tokens * self.cost_per_token.get(a, 1.0)
        return out

    def _make_plan(self, iteration: int, demand: Mapping[str, float] | None) -> RolloutPlan:
        known = demand is not None and any(v > 0 for v in demand.values())
        if self.mode == "hierarchical" and known:
            assert demand is not None
            replicas = share_replicas({a: max(demand[a], 1e-9) for a in self.agents},
                                      self.n_replicas)
        elif self.mode == "shared":  # the whole pool is every agent's
            replicas = {a: list(range(self.n_replicas)) for a in self.agents}
        else:  # static, or nothing measured yet: every agent weighs the same
            replicas = equal_split(self.agents, self.n_replicas)
        plan = RolloutPlan(iteration, self.mode, replicas,
                           dict(demand) if demand is not None else {})
        self.plans.append(plan)
        return plan

    def replan(self, next_iteration: int, demand: Mapping[str, float]) -> RolloutPlan:
        """Between iterations: `hierarchical` follows the demand just measured."""
        self.plan = self._make_plan(next_iteration, demand if self.mode == "hierarchical"
                                    else None)
        return self.plan

    def follow(self, iteration: int, replicas: Mapping[str, list[int]] | None) -> None:
        """The planner's replicas per agent (`planning/planner.py`, along the critical path)
        replace the demand plan for `iteration`; None: it allotted none, the plan stays."""
        if replicas is None:
            return
        if set(replicas) != set(self.agents) or any(
                not r or not all(0 <= i < self.n_replicas for i in r) for r in replicas.values()):
            raise ValueError(f"a plan for iteration {iteration} allots replicas "
                             f"{dict(replicas)}, but the pool has {self.n_replicas} replicas "
                             f"for agents {self.agents}")
        self.plan = RolloutPlan(iteration, self.plan.mode, {a: list(r) for a, r in
                                                            replicas.items()}, self.plan.demand)
        self.plans.append(self.plan)

    def remove_replica(self, index: int) -> None:
        """Replica `index` left the pool (an elastic pool shrank): those above it move down by
        one, and the current iteration is planned again over the replicas left."""
        if self.n_replicas <= 1:
            raise ValueError("a rollout pool needs at least one replica")
        self.n_replicas -= 1
        self._home = OrderedDict((k, r if r < index else r - 1)
                                 for k, r in self._home.items() if r != index)
        demand = self.plan.demand if self.mode == "hierarchical" and self.plan.demand else None
        self.plan = self._make_plan(self.plan.iteration, demand)

    # --- intra-agent -------------------------------------------------------------------------
    def expected_cost(self, agent: str, prompt_len: int, max_new_tokens: int) -> int:
        """Outstanding work a request adds: its prompt plus the agent's mean output so far
        (its output limit until something was measured), in tokens."""
        total, n = self._out_tokens[agent]
        expected = max_new_tokens if n == 0 else min(max_new_tokens, round(total / n))
        return prompt_len + max(1, expected)

    def observe(self, agent: str, output_tokens: int) -> None:
        acc = self._out_tokens[agent]
        acc[0] += output_tokens
        acc[1] += 1

    def pick(self, agent: str, outstanding: Sequence[float], sample_id: str | None = None) -> int:
        """The replica for agent's next request, given every replica's outstanding tokens.

        `hierarchical`: the least loaded of the agent's replicas, unless the request's group or
        episode (`affinity_key(sample_id)`) already went to one of them that is not overloaded
        (within `affinity_slack_tokens` or `affinity_slack_ratio` of the least loaded): its
        prompt prefix is cached there. An overloaded home hands the key to the least loaded."""
        candidates = self.plan.replicas[agent]
        if self.mode in ("static", "shared"):
            return candidates[next(self._round_robin[agent]) % len(candidates)]
        best = min(candidates, key=lambda r: (outstanding[r], r))
        key = None if sample_id is None else affinity_key(sample_id)
        if key is None:
            return best
        home = self._home.get((agent, key))
        least = outstanding[best]
        if home is not None and home in candidates and outstanding[home] <= least + max(
                self.affinity_slack_tokens, self.affinity_slack_ratio * least):
            best = home
        self._home[(agent, key)] = best
        self._home.move_to_end((agent, key))
        if len(self._home) > AFFINITY_MEMORY:
            self._home.popitem(last=False)
        return best
