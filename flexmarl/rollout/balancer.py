"""Hierarchical load balancing of rollout (DESIGN.md section 6), shared by every runtime.

Two levels, as in the paper:
- inter-agent: rollout capacity (replicas, or shares of one) is allotted to agents in
  proportion to their measured demand, tokens generated x per-token model cost, read from the
  experience store's statistics and re-planned between iterations;
- intra-agent: a request goes to the replica of its agent with the least outstanding work,
  counted in tokens (prompt + expected output), not in requests.
`static` is the peers' behaviour (MARTI-like): replicas split equally between agents, requests
dealt round robin whatever their length.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

BalanceMode = Literal["hierarchical", "static"]

# Prefill processes a prompt in one batched forward pass, decode one token per pass over the
# weights: on memory-bound engines a prompt token costs roughly a tenth of a generated one.
PREFILL_TOKEN_WEIGHT = 0.1


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
    ) -> None:
        if n_replicas < 1:
            raise ValueError("a rollout pool needs at least one replica")
        self.agents = list(agents)
        self.n_replicas = n_replicas
        self.mode = mode
        self.cost_per_token = dict(cost_per_token or dict.fromkeys(agents, 1.0))
        self._round_robin = {a: itertools.count() for a in agents}
        self._out_tokens: dict[str, list[int]] = {a: [0, 0] for a in agents}  # sum, count
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

    def pick(self, agent: str, outstanding: Sequence[float]) -> int:
        """The replica for agent's next request, given every replica's outstanding tokens."""
        candidates = self.plan.replicas[agent]
        if self.mode == "static":
            return candidates[next(self._round_robin[agent]) % len(candidates)]
        return min(candidates, key=lambda r: (outstanding[r], r))
