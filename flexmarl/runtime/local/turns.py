"""The rollout pool time-shared by one agent at a time (MAS-RL as the FlexMARL paper describes
it; `runtime.colocate` with `rollout.balance: shared`, the `mas-rl-like` preset).

One agent holds the whole pool: its requests go to every replica, and only its engines are
awake. Another agent's requests wait until the holder has none in flight; then the pool
switches: every replica puts the holder's engines to sleep and wakes the next agent's
(`ReplicaScheduler.sleep` / `wake` with the agents named), and the waiting agent holds the
pool. Waiting agents get the pool in the order they first asked. The simulator's
`mas-rl-like` (`sim/runtime/runtime.py`, `time_shared`) switches the same way.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any


def time_shared(cfg: Any) -> bool:
    """Whether a run's rollout pool takes turns: colocated, every agent on every replica."""
    return bool(cfg.runtime.colocate and cfg.rollout.balance == "shared")


class AgentTurns:
    """Who holds the pool, who waits for it, and the switches between them. `switch(sleep,
    wake)` puts the engines of agents `sleep` to sleep and wakes those of `wake` on every
    replica, returning the seconds it took."""

    def __init__(self, agents: list[str],
                 switch: Callable[[list[str], list[str]], Awaitable[float]]) -> None:
        self.switch = switch
        self.agents = list(agents)
        self.awake: set[str] = set(agents)  # replicas start with every engine awake
        self.holder: str | None = None
        self.pending: dict[str, int] = defaultdict(int)  # requests in flight per agent
        self.queue: list[str] = []  # agents waiting for the pool, first asked first
        self.turn: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, int] = defaultdict(int)  # requests waiting per agent
        self.switching = False
        self.error: Exception | None = None  # a switch that failed fails every request after
        self.switches = 0
        self.switch_s = 0.0

    async def enter(self, agent: str) -> None:
        """Return once `agent` holds the pool (its engines awake); counts its request in
        flight from then on."""
        if self.holder == agent and not self.switching:
            self.pending[agent] += 1
            return
        if agent not in self.turn:
            self.queue.append(agent)
            self.turn[agent] = asyncio.Event()
        event = self.turn[agent]
        self.waiting[agent] += 1
        self._maybe_switch()
        try:
            await event.wait()  # the switch counted this request in `pending`
        except asyncio.CancelledError:
            if event.is_set():
                self.leave(agent)
            else:
                self.waiting[agent] -= 1
                if not self.waiting[agent] and agent in self.queue:
                    self.queue.remove(agent)
                    del self.turn[agent], self.waiting[agent]
            raise
        if self.error is not None:
            self.leave(agent)
            raise self.error

    def leave(self, agent: str) -> None:
        """One of `agent`'s requests is answered."""
        self.pending[agent] -= 1
        self._maybe_switch()

    def asleep(self) -> None:
        """The whole pool went to sleep (training runs): nobody holds it, nothing is awake."""
        self.awake.clear()
        self.holder = None

    def _maybe_switch(self) -> None:
        if self.switching or not self.queue:
            return
        if self.holder is not None and self.pending[self.holder] > 0:
            return
        self.switching = True
        asyncio.ensure_future(self._switch(self.queue.pop(0)))

    async def _switch(self, nxt: str) -> None:
        try:
            sleep = sorted(self.awake - {nxt})
            wake = [] if nxt in self.awake else [nxt]
            if sleep or wake:
                self.switch_s += await self.switch(sleep, wake)
                self.switches += 1
            self.awake = {nxt}
            self.holder = nxt
        except Exception as exc:  # noqa: BLE001 - every waiter's request fails with it
            self.error = exc
        finally:
            self.switching = False
            # the requests that waited are in flight from now on: the holder keeps the pool
            # until they are answered, even if they resume after others asked for it
            self.pending[nxt] += self.waiting.pop(nxt, 0)
            self.turn.pop(nxt).set()
        self._maybe_switch()

    def take_counts(self) -> dict[str, float]:
        """Switches and their seconds since the last call."""
        out = {"switches": float(self.switches), "switch_s": self.switch_s}
        self.switches, self.switch_s = 0, 0.0
        return out
