"""Agent-centric binding of training slots (docs/design.md section 7), runtime-agnostic.

An agent asks for a slot only when it has work (a ready micro-batch, a step, a weight read).
It gets, in order of preference: a free slot where it is already resident (no swap); a free
empty slot; the free slot whose resident was used least recently (that resident is swapped
out, with its accumulated gradients, and swapped back in later, exactly). Waiting agents are
served in priority order, first come, first served within a priority. The pools pass
(iteration, kind), so in a pipelined run an older iteration's work, which the next versions
wait on, goes first; otherwise each agent's share of slot time follows its load (the number
and size of its micro-batches). With at least as many slots as agents, every agent stays
on its first slot and nothing is ever swapped.

Slots are sticky: a pool that holds a lease runs the agent's queued calls under it, one after
another, and asks `should_yield` between them; the holder yields only to an older iteration's
work that could run on its slot, so an agent drains its queue with one swap-in at most.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable
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


# Whether a waiting agent may evict another agent's state to get a slot, asked when it would
# (see `SlotAllocator.acquire`); None: always.
MaySwap = Callable[[], bool] | None


@dataclass
class _Waiter:
    priority: tuple
    order: int
    agent: str
    future: asyncio.Future
    may_swap: MaySwap = None


@dataclass
class SlotAllocator:
    n_slots: int
    slots: list[SlotInfo] = field(init=False)
    # kept sorted by (priority, arrival): served in this order
    waiting: list[_Waiter] = field(default_factory=list)
    swaps: int = 0
    # agent -> resolved once its evicted state has arrived where the runtime keeps it: a swap-in
    # of that agent on another slot must wait for it (runtime side: `state_arrived`)
    transit: dict[str, asyncio.Future] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)
    # slots of different sizes (devices): each slot's, and the size each agent is bound to
    # (`bind`): an agent's state, sharded over its slot's ranks, moves only between slots of
    # its size, so it is given no other
    sizes: list[int] | None = None
    size_of: dict[str, int] = field(default_factory=dict)
    # a fixed agent -> slot binding (`runtime.train_binding: fixed`, the static allocation
    # baseline): an agent runs on its own slot only, whatever the other slots' load
    fixed: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = [SlotInfo(i) for i in range(self.n_slots)]

    def bind(self, slot_of: dict[str, int]) -> None:
        """Bind each agent to the size of its slot in `slot_of` (the planner's `bind_slots`)."""
        assert self.sizes is not None
        self.size_of = {a: self.sizes[i] for a, i in slot_of.items()}

    def _fits(self, agent: str, slot: SlotInfo) -> bool:
        if agent in self.fixed:
            return slot.index == self.fixed[agent]
        return (self.sizes is None or agent not in self.size_of
                or self.sizes[slot.index] == self.size_of[agent])

    def _pick(self, agent: str, may_swap: MaySwap = None) -> Lease | None:
        free = [s for s in self.slots if not s.busy and self._fits(agent, s)]
        if not free:
            return None
        home = [s for s in self.slots if s.resident == agent]
        if home:  # resident somewhere: only that slot holds its live state
            return Lease(home[0].index, None, False) if not home[0].busy else None
        empty = [s for s in free if s.resident is None]
        if empty:
            return Lease(empty[0].index, None, True)
        if may_swap is not None and not may_swap():
            return None  # not worth a swap yet: it waits (`poke` asks again)
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
            else:  # a swap-in waiting for it fails too; nobody may be waiting: retrieved
                fut.set_exception(error)
                fut.exception()

    async def acquire(self, agent: str, priority: tuple = (), may_swap: MaySwap = None) -> Lease:
        """A slot for one call of `agent`; lower `priority` first (the pools pass
        (iteration, 0 for a step, 1 for a micro-batch)), arrival order within a priority.
        `may_swap`: asked whenever the agent could get a slot only by evicting another agent's
        state; while it says no, the agent waits (a free slot may then stay idle), until a
        `release` or `poke` finds it willing."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        bisect.insort(self.waiting, _Waiter(tuple(priority), next(self._clock), agent, fut,
                                            may_swap),
                      key=lambda w: (w.priority, w.order))
        self._dispatch()
        return await fut

    def release(self, lease: Lease) -> None:
        self.slots[lease.slot].busy = False
        self.slots[lease.slot].last_used = next(self._clock)
        self._dispatch()

    def poke(self) -> None:
        """Something a waiter's `may_swap` depends on changed: serve again."""
        self._dispatch()

    def _dispatch(self) -> None:
        """Serve waiters in priority order; one whose home slot is busy (or that does not want
        to swap yet) does not block others."""
        self.waiting = [w for w in self.waiting if not w.future.done()]  # cancelled meanwhile
        still = []
        for w in self.waiting:
            lease = self._pick(w.agent, w.may_swap)
            if lease is None:
                still.append(w)
                continue
            w.future.set_result(self._take(w.agent, lease))
        self.waiting = still

    def should_yield(self, lease: Lease, priority: tuple = ()) -> bool:
        """Whether the holder of `lease`, whose next queued call has `priority`, should give the
        slot up now: only when an older iteration's work waits that this slot could serve (its
        agent is resident nowhere, or here, and willing to swap). Calls without an iteration
        (`()`: state reads, weight reads, saves) count as the oldest."""
        mine = tuple(priority)[:1]
        home = {s.resident: s.index for s in self.slots if s.resident is not None}
        for w in self.waiting:
            if w.future.done():
                continue
            if w.priority[:1] >= mine:
                return False  # sorted: nobody older waits
            if home.get(w.agent, lease.slot) == lease.slot and self._fits(
                    w.agent, self.slots[lease.slot]) and (
                    w.may_swap is None or w.agent in home or w.may_swap()):
                return True
        return False

    def binding(self) -> dict[str, int]:
        return {s.resident: s.index for s in self.slots if s.resident is not None}
