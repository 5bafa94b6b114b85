"""The shared training host in one process: `TrainHost` (a real trainer swapped out and back in
is exact and is never rebuilt) and `SlotPool`'s logic over fake slots (sticky leases, swap
accounting, the recovery journal)."""

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from flexmarl.api.runtime import WorkerLost
from flexmarl.config.schema import load_config
from flexmarl.testing.fakes import FakeSlotPool
from flexmarl.training import state as st
from flexmarl.training.host import SlotError, TrainHost
from flexmarl.training.trainer import Sample

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"
VOCAB, SEQ = 32, 16


def _samples(tag: str, n: int = 4, version: int = 0) -> list[Sample]:
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    return [Sample(f"{version}-{tag}{i}_0_0", rng.integers(3, VOCAB, size=4).tolist(),
                   rng.integers(3, VOCAB, size=3).tolist(), [-1.0] * 3,
                   float(rng.normal()), None, 1.0, version) for i in range(n)]


def test_a_swapped_out_and_back_trainer_is_exact_and_never_rebuilt():
    """Through its wire form, then (`kept`) from its own process's kept trainer."""
    cfg = load_config(RELAY, ["runtime.deterministic=true"])
    swapped, plain = TrainHost(cfg, VOCAB, SEQ), TrainHost(cfg, VOCAB, SEQ)
    plain.bind("speaker", None)
    swapped.bind("speaker", None)
    speaker = swapped.kept["speaker"]
    for host in (swapped, plain):
        host.handle("accumulate", ("speaker", _samples("a")))
    # relay takes the slot mid-iteration: speaker's state (gradients included) leaves it
    out_agent, out_state, _, timings = swapped.bind("relay", None)
    assert out_agent == "speaker" and out_state[0] == "host" and timings["swap_out_s"] >= 0
    swapped.handle("accumulate", ("relay", _samples("r")))
    with pytest.raises(SlotError, match="'speaker' is not resident"):
        swapped.handle("accumulate", ("speaker", _samples("b")))
    back, relay_state, _, _ = swapped.bind("speaker", out_state)
    assert back == "relay"
    assert swapped.kept["speaker"] is speaker and swapped.builds == 2  # loaded, not rebuilt
    for host in (swapped, plain):
        host.handle("accumulate", ("speaker", _samples("b")))
    # back into the process it left, `("kept", token)`: nothing moves; the kept trainer holds
    # the state, torch's RNG (moved by other work here) is put back. Another process, or a
    # stale token, is refused before anything moves (the driver then sends the state).
    rng_out = torch.get_rng_state()
    bound = swapped.bind("relay", relay_state)
    torch.rand(7)
    token = bound.parked
    assert isinstance(token, int) and "parked" not in bound.timings  # a token, not a timing
    with pytest.raises(SlotError, match="no state kept on this slot"):
        TrainHost(cfg, VOCAB, SEQ).bind("speaker", ("kept", token))
    with pytest.raises(SlotError, match="no state kept on this slot"):
        swapped.bind("speaker", ("kept", token + 1))
    assert swapped.trainers.keys() == {"relay"}
    out_agent, _, _, timings = swapped.bind("speaker", ("kept", token))
    assert out_agent == "relay" and timings["kept_in"] == 1.0 and swapped.builds == 2
    assert torch.equal(torch.get_rng_state(), rng_out)
    (_, a), _ = swapped.handle("step", "speaker")
    (_, b), _ = plain.handle("step", "speaker")
    wa, wb = st.from_wire(a).tensors, st.from_wire(b).tensors
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(SlotError, match="'ghost' is not in the run's config"):
        swapped.bind("ghost", None)


def test_a_restart_point_through_a_file_continues_bit_for_bit(tmp_path):
    """`keep_restart` / `restore_restart` (the local slots' restart points): a fresh host
    restored from the file steps to the same weights as the host that wrote it."""
    cfg = load_config(RELAY, ["runtime.deterministic=true"])
    kept, fresh = TrainHost(cfg, VOCAB, SEQ), TrainHost(cfg, VOCAB, SEQ)
    kept.bind("speaker", None)
    kept.handle("accumulate", ("speaker", _samples("a")))
    kept.handle("step", "speaker")
    path = str(tmp_path / "0.safetensors")
    assert kept.handle("keep_restart", ("speaker", path)) == (path, "state:speaker")
    fresh.bind("speaker", None)
    assert fresh.handle("restore_restart", ("speaker", path)) == (1, "restore:speaker")
    steps = []  # the second step reads the optimizer's moments of the first
    for host in (kept, fresh):
        host.handle("accumulate", ("speaker", _samples("b", version=1)))
        (_, w), _ = host.handle("step", "speaker")
        steps.append(st.from_wire(w).tensors)
    a, b = steps
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Row:
    sample_id: str


def _batch(k: int, agent: str, j: int, rows: int = 2) -> list[Row]:
    return [Row(f"{k}-{agent}.{j * rows + i}_0_0") for i in range(rows)]


async def _iterations(pool, agents: list[str], iterations: int, batches: int,
                      per_iteration: list[dict[str, int]] | None = None) -> dict[str, str]:
    """Micro-batches arrive interleaved across agents (as episodes finish), each agent's step
    queued right behind its last one (as `MicroBatchTrainer` does); returns each agent's final
    weights digest."""
    weights: dict[str, str] = {}
    for k in range(iterations):
        before = dict(pool.swaps_in)
        calls = []
        steps = []
        for j in range(batches):
            for agent in agents:
                calls.append(asyncio.ensure_future(pool.accumulate(agent, _batch(k, agent, j))))
                if j == batches - 1:
                    steps.append(asyncio.ensure_future(pool.step(agent)))
            for _ in range(12):  # longer than a command: the slot's holder runs out of work
                await asyncio.sleep(0)
        await asyncio.gather(*calls)
        for agent, (_, w) in zip(agents, await asyncio.gather(*steps), strict=True):
            weights[agent] = bytes(w["digest"]).hex()
        if per_iteration is not None:
            per_iteration.append({a: pool.swaps_in[a] - before.get(a, 0) for a in agents})
    return weights


AGENTS = ["speaker", "relay", "listener"]


@pytest.mark.parametrize("parks", [False, True])
def test_one_slot_is_sticky_and_ends_with_the_weights_of_one_slot_per_agent(parks):
    async def run(slots: int):
        pool = FakeSlotPool(slots, parks=parks)
        swaps: list[dict[str, int]] = []
        weights = await _iterations(pool, AGENTS, iterations=4, batches=6, per_iteration=swaps)
        return pool, swaps, weights

    shared, swaps, weights = asyncio.run(run(1))
    own, own_swaps, own_weights = asyncio.run(run(3))
    assert weights == own_weights  # each agent's micro-batches in its own order
    # sticky: an agent drains its queue once it holds the slot (at most 2 swap-ins per agent
    # and iteration), instead of one per micro-batch (6 per iteration)
    assert all(n <= 2 for it in swaps for n in it.values()), swaps
    assert all(sum(it.values()) >= 2 for it in swaps)  # 3 agents did time-share 1 slot
    # accounting: the pool's per-agent counters are its swap-ins, evictions the allocator's
    assert {a: shared.slot_stats[a]["swaps"] for a in AGENTS} == dict(shared.swaps_in)
    assert shared.allocator.swaps == sum(shared.swaps_in.values()) - 1  # the first was empty
    assert all(h.builds[a] == 1 for h in shared.hosts for a in AGENTS)  # states moved, kept
    assert own.allocator.swaps == 0 and all(n == 1 for n in own.swaps_in.values())
    assert all(n == 0 for it in own_swaps[1:] for n in it.values())


@pytest.mark.parametrize("parks", [False, True])
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("after", [0, 1, 3, 9, 17])
def test_a_lost_slot_is_restored_from_the_journal_exactly(after, slots, parks):
    """Other agents' calls that reach the lost slot meanwhile wait for its restart (and may
    bind it while it is restored); every agent ends as without the loss. `parks`: states
    swapped out stay on the slot (lost with it: the parked agents come back from their
    restart points) and, one slot and restart point current, never leave it."""
    async def run(lose: bool):
        pool = FakeSlotPool(slots, recover=True, parks=parks)
        for agent in AGENTS:  # restart points at the start, as the supervisors keep them
            await pool.keep_restart_point(agent)
        await _iterations(pool, AGENTS, iterations=1, batches=3)
        if lose:
            pool.lose(0, after)
        weights = await _iterations(pool, AGENTS, iterations=2, batches=3)
        return pool, weights

    lost, weights = asyncio.run(run(True))
    plain, expected = asyncio.run(run(False))
    assert lost.restarts == 1
    assert weights == expected  # no micro-batch lost, none counted twice
    if parks:  # swapped back in from the slot's own copy; one slot: some never left it
        assert plain.hosts[0].kept_in > 0 and (plain.hosts[0].kept_out > 0) == (slots == 1)


def test_without_recovery_a_lost_slot_fails_the_call_naming_it():
    async def run():
        pool = FakeSlotPool(1)
        pool.lose(0)
        with pytest.raises(WorkerLost, match="fake slot 0 lost"):
            await pool.accumulate("speaker", _batch(0, "speaker", 0))
        assert not pool.journal["speaker"]  # no journal without recovery

    asyncio.run(run())


class _WatchedPool(FakeSlotPool):
    """Fake slots that count the commands in flight at once and can fail one accumulate."""

    def __init__(self, *args, fail: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = self.most_in_flight = 0
        self.fail = fail  # the sample id of a micro-batch whose accumulate fails
        self.order: list[str] = []

    async def _run(self, slot, command, payload):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if command == "accumulate":
                self.order.append(payload[1][0].sample_id)
                if payload[1][0].sample_id == self.fail:
                    await asyncio.sleep(0)
                    raise ValueError("bad micro-batch")
            return await super()._run(slot, command, payload)
        finally:
            self.in_flight -= 1


def test_the_next_micro_batch_is_sent_ahead_in_order_and_a_failed_one_fails_alone():
    """`SlotPool._send_ahead`: the slot finds an agent's next micro-batch waiting when one is
    done (two in flight, never more), in the order queued; the weights are those of one at a
    time. A micro-batch that fails answers its own caller; the one sent behind it still
    answers its caller, from the same slot."""
    async def run(fail: str | None):
        pool = _WatchedPool(1, fail=fail)
        calls = [asyncio.ensure_future(pool.accumulate("relay", _batch(0, "relay", j)))
                 for j in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        _, weights = await pool.step("relay")
        return pool, results, bytes(weights["digest"]).hex()

    pool, results, weights = asyncio.run(run(None))
    assert pool.most_in_flight == 2  # the head and one sent ahead
    assert pool.order == [_batch(0, "relay", j)[0].sample_id for j in range(5)]
    assert not any(isinstance(r, BaseException) for r in results)
    one_at_a_time = FakeSlotPool(1)

    async def serial():
        for j in range(5):
            await one_at_a_time.accumulate("relay", _batch(0, "relay", j))
        return bytes((await one_at_a_time.step("relay"))[1]["digest"]).hex()

    assert asyncio.run(serial()) == weights

    bad = _batch(0, "relay", 2)[0].sample_id
    pool, results, _ = asyncio.run(run(bad))
    assert isinstance(results[2], Exception) and "bad micro-batch" in str(results[2])
    assert [isinstance(r, BaseException) for r in results] == [False, False, True, False,
                                                               False]
    assert pool.order.count(_batch(0, "relay", 3)[0].sample_id) == 1  # not sent twice
