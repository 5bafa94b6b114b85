"""The slot allocator's binding decisions (pure asyncio, no processes)."""

import asyncio

from flexmarl.training.allocator import SlotAllocator


def test_fewer_slots_than_agents_time_share_with_swaps():
    async def run():
        alloc = SlotAllocator(1)
        a = await alloc.acquire("a")
        assert (a.slot, a.evict, a.swap_in) == (0, None, True)
        waiting_b = asyncio.ensure_future(alloc.acquire("b"))
        await asyncio.sleep(0)
        assert not waiting_b.done()  # the only slot is busy
        alloc.release(a)
        b = await waiting_b
        assert (b.slot, b.evict, b.swap_in) == (0, "a", True)
        alloc.release(b)
        b2 = await alloc.acquire("b")  # still resident: no swap
        assert (b2.evict, b2.swap_in) == (None, False)
        alloc.release(b2)
        a2 = await alloc.acquire("a")
        assert a2.evict == "b"
        alloc.release(a2)
        return alloc.swaps

    assert asyncio.run(run()) == 2


def test_enough_slots_never_swap_and_agents_keep_their_slot():
    async def run():
        alloc = SlotAllocator(3)
        seen = {}
        for _ in range(3):
            leases = [await alloc.acquire(x) for x in "abc"]
            for x, lease in zip("abc", leases, strict=True):
                assert seen.setdefault(x, lease.slot) == lease.slot
            for lease in leases:
                alloc.release(lease)
        return alloc.swaps, alloc.binding()

    swaps, binding = asyncio.run(run())
    assert swaps == 0 and sorted(binding.values()) == [0, 1, 2]


def test_an_agent_waiting_for_its_busy_home_slot_does_not_block_others():
    async def run():
        alloc = SlotAllocator(2)
        a = await alloc.acquire("a")
        b = await alloc.acquire("b")
        alloc.release(b)
        a_again = asyncio.ensure_future(alloc.acquire("a"))  # home slot 0 is busy
        await asyncio.sleep(0)
        c = await asyncio.wait_for(alloc.acquire("c"), 1)  # takes slot 1, evicting idle b
        assert c.slot == 1 and c.evict == "b"
        alloc.release(a)
        assert (await a_again).slot == 0
    asyncio.run(run())


def test_a_swap_in_waits_for_the_state_still_being_swapped_out():
    async def run():
        alloc = SlotAllocator(2)
        a, b = await alloc.acquire("a"), await alloc.acquire("b")
        alloc.release(a)
        c = await alloc.acquire("c")  # evicts a from slot 0
        assert c.evict == "a"
        alloc.release(b)
        a2 = await alloc.acquire("a")  # slot 1, while a's state is still in transit
        assert a2.swap_in and a2.evict == "b"
        waiter = asyncio.ensure_future(alloc.wait_state("a"))
        await asyncio.sleep(0)
        assert not waiter.done()
        alloc.state_arrived("a")
        await asyncio.wait_for(waiter, 1)
    asyncio.run(run())


def test_waiters_are_served_by_priority_then_arrival():
    """An older iteration's work goes first: pipelined agents a step apart share slots."""
    async def run():
        alloc = SlotAllocator(1)
        first = await alloc.acquire("x", (0, 1))
        order = []

        async def want(agent, priority):
            lease = await alloc.acquire(agent, priority)
            order.append(agent)
            alloc.release(lease)

        tasks = [asyncio.ensure_future(want(a, p)) for a, p in
                 [("new_mb", (1, 1)), ("old_mb", (0, 1)), ("new_step", (1, 0)),
                  ("old_mb_later", (0, 1))]]
        await asyncio.sleep(0)
        alloc.release(first)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["old_mb", "old_mb_later", "new_step", "new_mb"]



def test_a_waiter_evicts_another_agent_only_once_it_wants_to_swap():
    """`may_swap` says whether a swap is worth it yet: until then the agent waits (the free slot
    stays with its resident), and `poke` serves it once it is."""
    async def run():
        alloc = SlotAllocator(1)
        a = await alloc.acquire("a", (0, 1))
        alloc.release(a)
        ready = {"b": False}
        waiting_b = asyncio.ensure_future(alloc.acquire("b", (0, 1), lambda: ready["b"]))
        await asyncio.sleep(0)
        assert not waiting_b.done()  # free, but b does not want to evict a yet
        a2 = await asyncio.wait_for(alloc.acquire("a", (0, 1)), 1)  # resident: no swap
        assert (a2.evict, a2.swap_in) == (None, False)
        alloc.release(a2)
        ready["b"] = True
        alloc.poke()
        b = await asyncio.wait_for(waiting_b, 1)
        assert (b.slot, b.evict) == (0, "a")
        alloc.release(b)
        return alloc.swaps

    assert asyncio.run(run()) == 1


def test_the_holder_yields_only_to_older_work_that_this_slot_can_serve():
    async def run():
        alloc = SlotAllocator(1)
        lease = await alloc.acquire("a", (1, 1))
        same = asyncio.ensure_future(alloc.acquire("b", (1, 1)))
        await asyncio.sleep(0)
        assert not alloc.should_yield(lease, (1, 1))  # same iteration: a drains its queue
        unwilling = asyncio.ensure_future(alloc.acquire("c", (0, 1), lambda: False))
        await asyncio.sleep(0)
        assert not alloc.should_yield(lease, (1, 1))  # older, but not worth a swap yet
        older = asyncio.ensure_future(alloc.acquire("d", (0, 0)))
        await asyncio.sleep(0)
        assert alloc.should_yield(lease, (1, 1))  # an older iteration's step waits
        assert not alloc.should_yield(lease, ())  # a state read of a's own goes first
        alloc.release(lease)
        d = await asyncio.wait_for(older, 1)
        assert d.evict == "a"
        for fut in (same, unwilling):
            fut.cancel()
    asyncio.run(run())


def test_an_agent_bound_to_a_slot_size_gets_only_slots_of_that_size():
    """Slots of different sizes: an agent's state is sharded over its slot's ranks, so it is
    only ever given slots of the size it is bound to (waiting rather than taking another)."""
    async def run():
        alloc = SlotAllocator(3, sizes=[2, 1, 1])
        alloc.bind({"big": 0, "x": 1, "y": 2})
        big = await alloc.acquire("big")
        x = await alloc.acquire("x")
        assert (big.slot, x.slot) == (0, 1)
        alloc.release(big)
        y = await alloc.acquire("y")  # slot 0 is free, but of size 2
        assert y.slot == 2
        z = await alloc.acquire("z")  # unbound: any free slot
        assert z.slot == 0
        alloc.release(x)
        waiting_big = asyncio.ensure_future(alloc.acquire("big"))
        await asyncio.sleep(0)
        assert not waiting_big.done()  # slot 1 is free, but of size 1: it waits for slot 0
        alloc.release(z)
        lease = await waiting_big
        assert (lease.slot, lease.evict) == (0, "z")

    asyncio.run(run())
