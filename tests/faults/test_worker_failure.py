"""Real worker processes killed (SIGKILL) or frozen (SIGSTOP) in the middle of an iteration:
the run finishes, every row is trained on exactly once, failures and recoveries are events in
metrics.jsonl, and in deterministic mode the result equals the fault-free run's."""

import os
import signal

import pytest

from flexmarl.orchestrator.run import train
from tests.faults.conftest import (
    assert_final_equal,
    assert_rows_exactly_once,
    config,
    events,
)

REQUESTS_PER_ITERATION = 4 * 8 * 2  # inputs x group x nodes


def _kill_rollout_at(n_request: int, sig: int, index: int = 0):
    """Hook: when the orchestrator issues request n, signal rollout replica `index`."""
    state = {"n": 0, "pid": None}

    def hook(runtime):
        pool = runtime.rollout
        original = pool.generate

        async def generate(request, priority):
            state["n"] += 1
            if state["n"] == n_request:
                state["pid"] = pool.workers[index].process.pid
                os.kill(state["pid"], sig)
            return await original(request, priority)

        pool.generate = generate

    return hook, state


def _check(result, out, reference, cfg, pool):
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed and failed[0]["pool"] == pool
    assert recovered and recovered[0]["pool"] == pool and recovered[0]["recovery_s"] > 0
    assert '"worker_recovered"' in (out / "trace.json").read_text()
    assert_final_equal(out, reference)
    return failed, recovered


def test_rollout_worker_killed_mid_iteration(tmp_path, reference):
    cfg = config()
    hook, state = _kill_rollout_at(REQUESTS_PER_ITERATION + 20, signal.SIGKILL)
    result = train(cfg, tmp_path / "run", on_runtime=hook)
    failed, _ = _check(result, tmp_path / "run", reference, cfg, "rollout")
    assert failed[0]["pid"] == state["pid"] and "code -9" in failed[0]["reason"]
    # a SIGKILL nobody here sent reads as what it most often is, naming agents and estimates
    assert "out-of-memory killer" in failed[0]["reason"]
    assert "this rollout replica holds agents speaker" in failed[0]["reason"]


@pytest.mark.slow  # ~40 s, most of it the restarted worker importing torch
def test_trainer_killed_mid_accumulation(tmp_path, reference):
    cfg = config()
    state = {"n": 0}

    def hook(runtime):
        pool = runtime.train
        original = pool.accumulate

        async def accumulate(agent, samples):
            out = await original(agent, samples)
            state["n"] += 1
            if state["n"] == 4 + 1:  # iteration 1, after its first micro-batch was summed
                os.kill(pool.workers[0].process.pid, signal.SIGKILL)
            return out

        pool.accumulate = accumulate

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    _check(result, tmp_path / "run", reference, cfg, "train")


@pytest.mark.slow
def test_frozen_rollout_worker_is_found_by_missed_heartbeats(tmp_path, reference):
    cfg = config("runtime.heartbeat_interval_s=0.5", "runtime.heartbeat_misses=3")
    hook, _ = _kill_rollout_at(REQUESTS_PER_ITERATION + 10, signal.SIGSTOP, index=1)
    result = train(cfg, tmp_path / "run", on_runtime=hook)
    failed, _ = _check(result, tmp_path / "run", reference, cfg, "rollout")
    assert any("missed 3 heartbeats" in f["reason"] for f in failed)


@pytest.mark.slow  # the progress timeout (5 s) and a restart
def test_a_stuck_compute_thread_is_found_by_the_progress_timeout(tmp_path, reference,
                                                                  monkeypatch):
    """The worker's main thread blocks for good while its heartbeat thread still beats: the
    heartbeats cannot see it; `runtime.progress_timeout_s` does (calls outstanding, none
    answered), and it is recovered as a crash."""
    stall = tmp_path / "stall"
    monkeypatch.setenv("FLEXMARL_CHAOS_STALL", str(stall))  # the workers inherit it
    cfg = config("runtime.heartbeat_interval_s=0.5", "runtime.progress_timeout_s=5")
    state = {"n": 0}

    def hook(runtime):
        pool = runtime.rollout
        original = pool.generate

        async def generate(request, priority):
            state["n"] += 1
            if state["n"] == REQUESTS_PER_ITERATION + 10:
                stall.write_text("rollout:generate")  # the next worker to take one stalls
            return await original(request, priority)

        pool.generate = generate

    result = train(cfg, tmp_path / "run", on_runtime=hook)
    failed, _ = _check(result, tmp_path / "run", reference, cfg, "rollout")
    assert not stall.exists()  # a worker claimed it
    assert len(failed) == 1 and "no progress" in failed[0]["reason"]
    assert "progress_timeout_s=5" in failed[0]["reason"]
