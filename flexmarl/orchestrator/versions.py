"""Policy versions and weight publication: the version vector of each iteration, the gates
that hold an agent's nodes until its version is published, and the one_step_off hold.

Split out of the joint orchestrator so that the consistency contract's version side (which
weights a node may be generated with) is one small object the episode runner and the
training driver share.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flexmarl.api.runtime import RolloutPool


class Versions:
    """Each agent's published policy version and the gates waiting on them.

    `staleness` is `pipeline.max_staleness`: 0 on-policy, 1 in one_step_off, where iteration k
    is generated with version max(0, k-1) and step k's weights are held until iteration k+1 is
    rolled out (a replica serves one version per agent)."""

    def __init__(self, agents: list[str], trainable: list[str], staleness: int,
                 rollout: RolloutPool) -> None:
        self.agents = agents
        self.trainable = trainable
        self.staleness = staleness
        self.rollout = rollout
        self.current = dict.fromkeys(agents, 0)
        self._gates: dict[tuple[str, int], asyncio.Event] = {}
        # one_step_off: per agent the weights of its last step, held until the iteration
        # generated with the previous version is rolled out
        self.held: dict[str, tuple[int, Any]] = {}

    def vector(self, iteration: int) -> dict[str, int]:
        """The version vector of iteration k: every trainable agent at k (at max(0, k-1) in
        one_step_off), frozen ones at 0."""
        v = max(0, iteration - self.staleness)
        return {a: (v if a in self.trainable else 0) for a in self.agents}

    def gate(self, agent: str, version: int) -> asyncio.Event:
        """Set once `agent`'s `version` is published (at once if it already is)."""
        key = (agent, version)
        if key not in self._gates:
            self._gates[key] = asyncio.Event()
            if self.current[agent] >= version:
                self._gates[key].set()
        return self._gates[key]

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        """Weights to the replicas, then the version opens its gate."""
        await self.rollout.publish(agent, version, weights)
        self.current[agent] = version
        self.gate(agent, version).set()
