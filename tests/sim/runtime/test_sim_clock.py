"""The virtual-time event loop: asyncio semantics unchanged, time free and exact."""

from __future__ import annotations

import asyncio
import time

import pytest

from flexmarl.sim.runtime import SimDeadlockError, VirtualTimeEventLoop, run_virtual


def test_hour_long_sleep_takes_no_real_time() -> None:
    async def main() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        return loop.time(), isinstance(loop, VirtualTimeEventLoop)

    t0 = time.perf_counter()
    now, virtual = run_virtual(main())
    assert time.perf_counter() - t0 < 1.0
    assert virtual
    assert now == 3600.0


def test_events_are_ordered_exactly() -> None:
    log: list[tuple[str, float]] = []

    async def worker(name: str, sleeps: list[float]) -> None:
        loop = asyncio.get_running_loop()
        for s in sleeps:
            await asyncio.sleep(s)
            log.append((name, loop.time()))

    async def main() -> None:
        await asyncio.gather(
            worker("a", [3.0, 1.0]),  # 3, 4
            worker("b", [1.0, 1.0, 1.0]),  # 1, 2, 3
            worker("c", [0.5, 2.0]),  # 0.5, 2.5
            worker("d", [10.0]),  # 10
        )

    run_virtual(main())
    # Equal deadlines (a and b at t=3) fire in scheduling order: a's timer was set at t=0.
    assert log == [
        ("c", 0.5),
        ("b", 1.0),
        ("b", 2.0),
        ("c", 2.5),
        ("a", 3.0),
        ("b", 3.0),
        ("a", 4.0),
        ("d", 10.0),
    ]


def test_clock_lands_exactly_on_each_deadline() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen: list[float] = []
        await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # deadline 0.1 + 0.2, i.e. 0.30000000000000004 in floats
        seen.append(loop.time())
        loop.call_at(0.7, lambda: seen.append(loop.time()))
        loop.call_later(1 / 3, lambda: seen.append(loop.time()))
        await asyncio.sleep(1.0)
        return seen

    # No drift from adding (deadline - now) back onto now: each reading is the deadline itself.
    assert run_virtual(main()) == [0.1 + 0.2, (0.1 + 0.2) + 1 / 3, 0.7]


def test_start_time_and_virtual_time_property() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeEventLoop)
        start = loop.virtual_time
        await asyncio.sleep(5)
        return start, loop.virtual_time

    assert run_virtual(main(), start=100.0) == (100.0, 105.0)


def test_far_from_zero_the_clock_still_reaches_deadlines() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        for _ in range(10):
            await asyncio.sleep(0.5)
        return loop.time()

    # At 1e9 s a float's spacing (~1.2e-7) is coarser than asyncio's 1 ns timer tolerance.
    assert run_virtual(main(), start=1e9) == pytest.approx(1e9 + 5.0)


def test_wait_for_times_out_at_the_virtual_deadline() -> None:
    async def main() -> tuple[float, float, str]:
        loop = asyncio.get_running_loop()
        never = asyncio.Event()
        try:
            await asyncio.wait_for(never.wait(), timeout=5.0)
        except TimeoutError:
            timed_out_at = loop.time()
        soon = asyncio.Event()
        loop.call_later(2.0, soon.set)
        await asyncio.wait_for(soon.wait(), timeout=5.0)
        set_at = loop.time()
        async with asyncio.timeout(1.5):
            await asyncio.sleep(1.0)
        return timed_out_at, set_at, "ok"

    assert run_virtual(main()) == (5.0, 7.0, "ok")


def test_queues_futures_and_tasks() -> None:
    async def main() -> tuple[list[tuple[int, float]], float, float]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=2)
        got: list[tuple[int, float]] = []

        async def producer() -> None:
            for i in range(4):
                await asyncio.sleep(1.0)
                await queue.put(i)

        async def consumer() -> None:
            for _ in range(4):
                item = await queue.get()
                await asyncio.sleep(2.5)  # slower than the producer: the queue backs up
                got.append((item, loop.time()))

        future: asyncio.Future[float] = loop.create_future()
        loop.call_later(0.25, future.set_result, 42.0)
        await asyncio.gather(producer(), consumer())
        return got, await future, loop.time()

    got, value, end = run_virtual(main())
    assert got == [(0, 3.5), (1, 6.0), (2, 8.5), (3, 11.0)]
    assert value == 42.0
    assert end == 11.0


def test_exceptions_propagate() -> None:
    async def main() -> None:
        await asyncio.sleep(1)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_virtual(main())


def test_deadlock_is_detected_and_names_the_waiting_task() -> None:
    async def stuck_forever() -> None:
        await asyncio.sleep(10)
        await asyncio.Event().wait()

    with pytest.raises(SimDeadlockError, match=r"t=10\.0+s") as info:
        run_virtual(stuck_forever())
    assert "stuck_forever" in str(info.value)


def test_deadlock_between_tasks_waiting_on_each_other() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a: asyncio.Future[None] = loop.create_future()
        b: asyncio.Future[None] = loop.create_future()

        async def wait_then_set(mine: asyncio.Future[None], other: asyncio.Future[None]) -> None:
            await mine
            other.set_result(None)

        await asyncio.gather(wait_then_set(a, b), wait_then_set(b, a))

    with pytest.raises(SimDeadlockError, match="waiting task"):
        run_virtual(main())


def test_threads_take_no_virtual_time() -> None:
    async def main() -> tuple[str, float, list[str]]:
        loop = asyncio.get_running_loop()
        order: list[str] = []

        async def timer() -> None:
            await asyncio.sleep(0.001)
            order.append("timer")

        async def threaded() -> str:
            result = await asyncio.to_thread(lambda: time.sleep(0.05) or "done")
            order.append("thread")
            return result

        # The thread needs 50 ms of real time but no virtual time: the clock waits for it
        # instead of jumping to the timer, so the thread finishes first, at t=0.
        result, _ = await asyncio.gather(threaded(), timer())
        return result, loop.time(), order

    result, now, order = run_virtual(main())
    assert result == "done"
    assert now == 0.001
    assert order == ["thread", "timer"]


def test_loop_can_be_driven_directly() -> None:
    loop = VirtualTimeEventLoop(start=2.0)
    try:
        assert loop.run_until_complete(asyncio.sleep(3.0, result="x")) == "x"
        assert loop.time() == 5.0
    finally:
        loop.close()
