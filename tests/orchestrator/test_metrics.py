"""The iteration record's common part (`IterationMetrics.common`): its span scans start after
the spans that ended before the window, and give what a scan of every span gives (the pools'
busy fractions, the swaps of the pool and of each trainable agent)."""

from __future__ import annotations

import random

from flexmarl.orchestrator.episodes import IterationState
from flexmarl.orchestrator.metrics import IterationMetrics
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.testing.fakes import FakeRolloutPool, FakeTrainPool


def full_scan(t: Telemetry, n_rollout: int, n_train: int, t0: float, t1: float) -> tuple:
    swaps = t.labelled("train", "swap:", t0, t1)
    return (t.busy_frac("rollout", n_rollout, t0, t1),
            sum(t.busy_by_worker("train", n_train, t0, t1)) / ((t1 - t0) * n_train),
            sum(n for n, _ in swaps.values()), sum(s for _, s in swaps.values()),
            {a: swaps.get(a, (0, 0.0))[0] for a in ("a", "b")})


def test_common_record_equals_a_full_scan_over_successive_windows() -> None:
    rng = random.Random(0)
    telemetry = Telemetry()
    rollout, train = FakeRolloutPool(), FakeTrainPool(["a", "b"])
    metrics = IterationMetrics(telemetry, rollout, train, ["a", "b"], ["a", "b"])
    t0, skipped = 0.0, []
    for k in range(30):
        now = t0 + 1.0
        for _ in range(12):  # spans ending in this window, some started windows earlier
            end = rng.uniform(t0, now)
            start = end - rng.uniform(0.0, 2.5)
            pool = rng.choice(["rollout", "train"])
            label = rng.choice(["step:a", "swap:b:in", "swap:a:in", "rollout"])
            telemetry.span(pool, rng.randrange(2), start, end, label)
        rec = metrics.common(k, t0, now, 0.0)
        want = full_scan(telemetry, rollout.n_workers, train.n_workers, t0, now)
        got = (rec["pool/rollout/busy_frac"], rec["pool/train/busy_frac"],
               rec["pool/train/swaps"], rec["pool/train/swap_s"],
               {a: rec[f"agent/{a}/swaps"] for a in ("a", "b")})
        assert got == want, k
        skipped.append(metrics._first)
        t0 = now
    assert skipped[-1] > 250  # the scans start near the window, not at the run's first span


def test_rollout_windows_equal_a_full_scan_when_they_overlap_the_last_record() -> None:
    """`rollout_metrics`' window starts at the iteration's rollout start, before the previous
    record's end in a pipelined run: its scan skips only spans that ended before it."""
    rng = random.Random(1)
    telemetry = Telemetry()
    rollout, train = FakeRolloutPool(), FakeTrainPool(["a"])
    metrics = IterationMetrics(telemetry, rollout, train, ["a"], ["a"])
    start, skipped = 0.0, []
    for k in range(30):
        end_rollout = start + 1.0
        for _ in range(10):
            end = rng.uniform(start - 0.5, end_rollout + 0.5)
            telemetry.span("rollout", rng.randrange(rollout.n_workers),
                           end - rng.uniform(0.0, 0.8), end, "gen:a")
        it = IterationState(k, 1, started_at=start, rollout_finished_at=end_rollout)
        got = metrics.rollout_metrics(it)
        want = telemetry.busy_by_worker("rollout", rollout.n_workers, start, end_rollout)
        assert [got[f"rollout/replica/{i}/busy_frac"] for i in range(rollout.n_workers)] == [
            b / (end_rollout - start) for b in want], k
        skipped.append(metrics._rollout_first)
        start += 0.6  # the next rollout starts while this one's tail is generated
    assert skipped[-1] > 150
