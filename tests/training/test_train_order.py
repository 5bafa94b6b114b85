"""The local training pool follows the planner's order: on a time-shared slot, a more
critical agent of the same iteration (with enough queued to be worth a swap) takes the slot
at the holder's next call boundary, instead of waiting until the holder's queue is empty.
One process: the slot is a fake worker that records the calls it serves."""

from __future__ import annotations

import asyncio
from typing import Any

from flexmarl.planning.planner import Plan
from flexmarl.runtime.local.runtime import LocalTrainPool
from flexmarl.types import Bound


class RecordingSlot:
    """A training slot's parent side: each call takes a few loop ticks, bind swaps."""

    index = 0
    alive = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.resident: str | None = None

    async def call(self, command: str, payload: Any) -> Any:
        agent = payload if isinstance(payload, str) else payload[0]
        for _ in range(3):
            await asyncio.sleep(0)
        self.calls.append((command, agent))
        if command == "bind":
            out, self.resident = self.resident, agent
            return Bound(out, None if out is None else f"state:{out}", None, {})
        if command == "step":
            return {"loss": 0.0}, {}
        return {}


def serve(order: list[str]) -> list[tuple[str, str]]:
    """`late` holds the slot with four micro-batches queued; `early` then queues two and
    its step (all of its iteration). Returns the calls in the order the slot served them."""

    async def main() -> list[tuple[str, str]]:
        slot = RecordingSlot()
        pool = LocalTrainPool([slot])  # type: ignore[list-item]
        pool.follow_plan(Plan(1, None, 1, 1, {}, train_order=order))
        late = [asyncio.ensure_future(pool.accumulate("late", [])) for _ in range(4)]
        while not slot.calls:  # late is on the slot
            await asyncio.sleep(0)
        early = [asyncio.ensure_future(pool.accumulate("early", [])) for _ in range(2)]
        early.append(asyncio.ensure_future(pool.step("early")))
        late.append(asyncio.ensure_future(pool.step("late")))
        await asyncio.gather(*late, *early)
        return [c for c in slot.calls if c[0] != "bind"]

    return asyncio.run(main())


def test_a_more_critical_agent_takes_the_slot_at_the_next_call_boundary() -> None:
    calls = serve(["early", "late"])
    first_early = calls.index(("accumulate", "early"))
    assert calls[first_early:first_early + 3] == [
        ("accumulate", "early"), ("accumulate", "early"), ("step", "early")]
    assert first_early < calls.index(("step", "late"))
    assert calls.count(("accumulate", "late")) == 4  # nothing lost or run twice
    assert [c for c in calls if c[1] == "late"][-1] == ("step", "late")


def test_a_less_critical_agent_waits_until_the_holder_is_done() -> None:
    calls = serve(["late", "early"])
    assert calls == [("accumulate", "late")] * 4 + [("step", "late")] + [
        ("accumulate", "early")] * 2 + [("step", "early")]


class Row:
    def __init__(self, sample_id: str) -> None:
        self.sample_id = sample_id


def test_before_any_plan_the_agent_earlier_in_the_graph_goes_first() -> None:
    """No plan yet (the first iteration): the slot's order is the rows' turn in the episode
    graph. `mid` (turn 1) holds the slot; `last` (turn 2), then `first` (turn 0) queue their
    whole iteration: `first` takes the slot at mid's next call boundary, `last` waits for both
    (the next iteration's episodes need the first nodes' versions first)."""

    async def main() -> list[tuple[str, str]]:
        slot = RecordingSlot()
        pool = LocalTrainPool([slot])  # type: ignore[list-item]

        def batch(agent: str, turn: int) -> list[Row]:
            return [Row(f"0-{agent}{i}_{turn}_0") for i in range(2)]

        calls = [asyncio.ensure_future(pool.accumulate("mid", batch("mid", 1)))
                 for _ in range(4)]
        while not slot.calls:
            await asyncio.sleep(0)
        for agent, turn in (("last", 2), ("first", 0)):
            calls += [asyncio.ensure_future(pool.accumulate(agent, batch(agent, turn)))
                      for _ in range(2)]
            calls.append(asyncio.ensure_future(pool.step(agent)))
        calls.append(asyncio.ensure_future(pool.step("mid")))
        await asyncio.gather(*calls)
        return [c for c in slot.calls if c[0] != "bind"]

    calls = asyncio.run(main())
    steps = [agent for command, agent in calls if command == "step"]
    assert steps == ["first", "mid", "last"]
    mid = [i for i, call in enumerate(calls) if call == ("accumulate", "mid")]
    assert mid[0] < calls.index(("step", "first")) < mid[-1]  # at mid's next call boundary
    assert calls.count(("accumulate", "mid")) == 4 and calls.count(("accumulate", "last")) == 2
