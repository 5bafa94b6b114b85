"""Slot-wait metrics from the train pool's declared counters (`TrainPool.slot_counters`)."""

from flexmarl.telemetry.train_stats import SlotStatsSource
from flexmarl.testing.fakes import FakeTrainPool


class _Counting(FakeTrainPool):
    def __init__(self) -> None:
        super().__init__(["a", "b"], slots=1)
        self.counters: dict[str, dict[str, float]] = {"a": {"slot_wait_s": 1.0}}

    def slot_counters(self) -> dict[str, dict[str, float]]:
        return self.counters


def test_slot_wait_is_what_accrued_since_the_previous_record():
    pool = _Counting()
    source = SlotStatsSource.for_pool(pool, ["a", "b"])
    assert source is not None
    assert source.collect() == {"agent/a/slot_wait_s": 1.0, "agent/b/slot_wait_s": 0.0,
                                "pool/train/slot_wait_s": 1.0}
    pool.counters["a"]["slot_wait_s"] = 1.5
    pool.counters["b"] = {"slot_wait_s": 2.0}
    assert source.collect() == {"agent/a/slot_wait_s": 0.5, "agent/b/slot_wait_s": 2.0,
                                "pool/train/slot_wait_s": 2.5}


def test_a_pool_without_slots_has_no_slot_metrics():
    assert SlotStatsSource.for_pool(FakeTrainPool(["a"]), ["a"]) is None
