"""A virtual-time asyncio event loop for the ``sim`` runtime.

Why: the orchestrator is written once against asyncio. In simulation, workers ``await`` the
durations a cost model predicts (``asyncio.sleep(predicted_s)``). On this loop such waits cost no
real time: whenever no callback is ready, the clock jumps straight to the next timer. A run that
spans hours of cluster time therefore finishes in seconds, while the real scheduling code runs
unchanged, in an exact and reproducible order.

Rules of the virtual clock:

* Callbacks take zero virtual time; time moves only when the loop would otherwise block.
* Work handed to threads (``loop.run_in_executor``, ``asyncio.to_thread``) also takes zero
  virtual time: while such work is pending the loop blocks for real until it reports back,
  instead of moving the clock. (Threads that call into the loop some other way, e.g. with a bare
  ``call_soon_threadsafe``, are not tracked.)
* Real sockets and pipes are polled but never waited for: this loop is for simulated work.
* If nothing is ready, no timer is scheduled and no thread is pending, nothing can ever wake the
  waiting tasks; instead of hanging, the loop raises :class:`SimDeadlockError` naming them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar, TypeVarTuple

__all__ = ["SimDeadlockError", "VirtualTimeEventLoop", "run_virtual"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# How many waiting tasks a deadlock report lists, and how much of each task's repr it keeps:
# enough to see who waits on what, short enough to read in a test failure.
_DEADLOCK_MAX_TASKS = 20
_DEADLOCK_MAX_REPR = 300

# asyncio's own timer tolerance (time.get_clock_info("monotonic").resolution on Linux).
_BASE_CLOCK_RESOLUTION = 1e-9


class SimDeadlockError(RuntimeError):
    """Raised when simulated tasks wait for something that can never happen."""


class _VirtualSelector(selectors.BaseSelector):
    """Keeps the loop's file descriptors in a real selector, but turns blocking into time jumps.

    asyncio's loop computes how long it may block (until the next timer, or forever) and calls
    ``select(timeout)``; here that call advances the virtual clock by ``timeout`` instead.
    """

    def __init__(self, loop: VirtualTimeEventLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop: VirtualTimeEventLoop | None = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()
        self._loop = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)  # wake-ups from threads arrive through the self-pipe
        if ready or (timeout is not None and timeout <= 0):
            return ready
        loop = self._loop
        if loop is None:  # closed: behave like a plain selector
            return self._real.select(timeout)
        if loop._pending_threads > 0:
            # Thread work takes no virtual time: wait for it for real before moving the clock.
            return self._real.select(None)
        if timeout is None:
            raise SimDeadlockError(loop._deadlock_report())
        loop._advance(timeout)
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop whose ``time()`` is a virtual clock that jumps to the next timer.

    Everything built on ``loop.time()`` and timers -- ``asyncio.sleep``, ``call_later``,
    ``call_at``, ``wait_for``, ``asyncio.timeout``, futures, events, queues, tasks, ``gather``
    -- works unchanged and sees simulated seconds.
    """

    _scheduled: list[asyncio.TimerHandle]  # BaseEventLoop's timer heap (not in its stub)

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start must be a finite number of seconds, got {start!r}")
        self._virtual_time = float(start)
        self._pending_threads = 0
        super().__init__(selector=_VirtualSelector(self))
        self._clock_resolution = _BASE_CLOCK_RESOLUTION

    @property
    def virtual_time(self) -> float:
        """Simulated seconds on this loop's clock (the same value as ``time()``)."""
        return self._virtual_time

    def time(self) -> float:
        """Return the virtual clock; asyncio schedules every timer against this."""
        return self._virtual_time

    def _advance(self, timeout: float) -> None:
        """Move the clock forward by ``timeout``, landing exactly on the next timer's deadline.

        Snapping to the deadline (rather than adding ``when - now`` back onto ``now``) keeps times
        free of float drift, so a callback scheduled for t=0.3 sees ``loop.time() == 0.3``.
        """
        target = self._virtual_time + timeout
        if self._scheduled:
            head = self._scheduled[0].when()
            if abs(head - target) <= 1e-9 * max(1.0, abs(head)):
                target = head
        self._virtual_time = max(self._virtual_time, target)
        # asyncio fires timers due before time() + resolution. Far from zero a float's spacing
        # can exceed 1 ns, and a deadline equal to the clock would then never count as due.
        self._clock_resolution = max(_BASE_CLOCK_RESOLUTION, 2.0 * math.ulp(self._virtual_time))

    def run_in_executor(
        self, executor: concurrent.futures.Executor | None, func: Callable[[*Ts], T],
        *args: *Ts,
    ) -> asyncio.Future[T]:
        """Run ``func`` in a thread; the clock stands still until it reports back."""
        future = super().run_in_executor(executor, func, *args)
        self._pending_threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _future: asyncio.Future[Any]) -> None:
        self._pending_threads -= 1

    async def shutdown_default_executor(self, *args: Any) -> None:
        """Shut the default executor down; its joining thread counts as pending thread work."""
        self._pending_threads += 1
        try:
            await super().shutdown_default_executor(*args)
        finally:
            self._pending_threads -= 1

    def _deadlock_report(self) -> str:
        """Say what is stuck, so a deadlocked simulation names its waiting tasks."""
        tasks = [task for task in asyncio.all_tasks(self) if not task.done()]
        lines = [
            f"simulated deadlock at t={self._virtual_time:.6f}s: no callback is ready, no timer "
            f"is scheduled and no thread is pending, so nothing can wake the {len(tasks)} "
            "waiting task(s):"
        ]
        for task in tasks[:_DEADLOCK_MAX_TASKS]:
            text = repr(task)
            if len(text) > _DEADLOCK_MAX_REPR:
                text = text[: _DEADLOCK_MAX_REPR - 3] + "..."
            lines.append(f"  {text}")
        if len(tasks) > _DEADLOCK_MAX_TASKS:
            lines.append(f"  ... and {len(tasks) - _DEADLOCK_MAX_TASKS} more")
        return "\n".join(lines)


def run_virtual(
    coro: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool | None = None
) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeEventLoop`, like ``asyncio.run``.

    The clock starts at ``start`` simulated seconds. Raises :class:`SimDeadlockError` if the
    coroutine waits for something nothing can ever deliver.
    """
    with asyncio.Runner(debug=debug, loop_factory=lambda: VirtualTimeEventLoop(start=start)) as r:
        return r.run(coro)
