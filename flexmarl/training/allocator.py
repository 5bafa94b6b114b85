"""Agent-centric binding of training slots (DESIGN.md section 7), runtime-agnostic.

An agent asks for a slot only when it has work (a ready micro-batch, a step, a weight read).
It gets, in order of preference: a free slot where it is already resident (no swap); a free
empty slot; the free slot whose resident was used least recently (that resident is swapped
out, with its accumulated gradients, and swapped back in later, exactly). Waiting agents are
served first come, first served, so each agent's share of slot time follows its load (the
number and size of its micro-batches). With at least as many slots as agents, every agent stays
on its first slot and nothing is ever swapped.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SlotInfo:
    index: int
    resident: str | None = None
    busy: bool = False
    last_used: int = 0


@dataclass
class Lease:
    slot: int
    evict: str | None  # the resident to swap out before running (None: no swap)
    swap_in: bool  # the agent is not resident on the slot yet


@dataclass
class SlotAllocator:
    n_slots: int
    slots: list[SlotInfo] = field(init=False)
    waiting: deque = field(default_factory=deque)
    swaps: int = 0
    # agent -> resolved once its evicted state has arrived where the runtime keeps it: a swap-in
    # of that agent on another slot must wait for it (runtime side: `state_arrived`)
    transit: dict[str, asyncio.Future] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.slots = [SlotInfo(i) for i in range(self.n_slots)]

    def _pick(self, agent: str) -> Lease | None:
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        home = [s for s in self.slots if s.resident == agent]
        if home:  # resident somewhere: only that slot holds its live state
            return Lease(home[0].index, None, False) if not home[0].busy else None
        empty = [s for s in free if s.resident is None]
        if empty:
            return Lease(empty[0].index, None, True)
        victim = min(free, key=lambda s: s.last_used)
        return Lease(victim.index, victim.resident, True)

    def _take(self, agent: str, lease: Lease) -> Lease:
        slot = self.slots[lease.slot]
        slot.busy = True
        slot.resident = agent
        slot.last_used = next(self._clock)
        if lease.evict is not None:
            self.swaps += 1
            self.transit[lease.evict] = asyncio.get_running_loop().create_future()
        return lease

    async def wait_state(self, agent: str) -> None:
        """Until the state of `agent`, if it is being swapped out, has arrived."""
        fut = self.transit.get(agent)
        if fut is not None:
            await asyncio.shield(fut)

    def state_arrived(self, agent: str, error: BaseException | None = None) -> None:
        fut = self.transit.pop(agent, None)
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    async def acquire(self, agent: str) -> Lease:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting.append((agent, fut))
        self._dispatch()
        return await fut

    def release(self, lease: Lease) -> None:
        self.slots[lease.slot].busy = False
        self.slots[lease.slot].last_used = next(self._clock)
        self._dispatch()

    def _dispatch(self) -> None:
        """Serve waiters in arrival order; one whose home slot is busy does not block others."""
        still: deque = deque()
        while self.waiting:
            agent, fut = self.waiting.popleft()
            if fut.done():
                continue
            lease = self._pick(agent)
            if lease is None:
                still.append((agent, fut))
                continue
            fut.set_result(self._take(agent, lease))
        self.waiting = still

    def binding(self) -> dict[str, int]:
        return {s.resident: s.index for s in self.slots if s.resident is not None}
