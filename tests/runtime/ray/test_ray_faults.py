"""Checkpoints, resume and actor restarts on a real Ray head (loopback, 2 CPUs): a run stopped
at a boundary and resumed, or one whose trainer or rollout actor is SIGKILLed mid-iteration,
ends equal to the local fault-free reference, every row trained on exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import ray

from flexmarl.orchestrator.joint import RunInterrupted
from flexmarl.orchestrator.run import train
from tests.faults.conftest import (
    assert_final_equal,
    assert_rows_exactly_once,
    config,
    events,
    reference,  # noqa: F401 - the session fixture: the local fault-free run
)

# Two replicas and a trainer on the 2-CPU head: replicas take half a CPU each.
RAY = ["runtime.kind=ray", "runtime.ray.rollout_bundle.cpus=0.5"]
REQUESTS_PER_ITERATION = 4 * 8 * 2  # inputs x group x nodes


def _ray_config(address: str, *extra: str):
    return config(*RAY, f"runtime.address={address}", *extra)


Action = Callable[..., Awaitable[int]]


def fault_at_call(pool_name: str, method: str, n: int, action: Action, *,
                  after: bool = True) -> tuple[Callable[[Any], None], dict[str, Any]]:
    """An `on_runtime` hook wrapping `runtime.<pool_name>.<method>`: its n-th call runs
    `action(pool, *args)` once the call returned (`after`) or before it is made; the action
    returns the pid it hit, kept in the returned state with the call count."""
    state: dict[str, Any] = {"n": 0, "pid": None}

    def hook(runtime: Any) -> None:
        pool = getattr(runtime, pool_name)
        original = getattr(pool, method)

        async def count(args: tuple) -> None:
            state["n"] += 1
            if state["n"] == n:
                state["pid"] = await action(pool, *args)

        async def wrapped(*args: Any) -> Any:
            if not after:
                await count(args)
            out = await original(*args)
            if after:
                await count(args)
            return out

        setattr(pool, method, wrapped)

    return hook, state


async def kill_first_actor(pool: Any, *_: Any) -> int:
    pid = pool.workers[0].process.pid
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow  # two Ray runs: ~30 s on the shared 2-core machine
def test_stop_at_a_boundary_then_resume_on_ray_equals_uninterrupted(tmp_path, ray_head,
                                                                    reference):  # noqa: F811
    out = tmp_path / "run"
    cfg = _ray_config(ray_head)

    def stop_after_first(record):
        if record["iteration"] == 0:  # as SIGTERM does: checkpoint at this boundary, stop
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(RunInterrupted) as stopped:
        train(cfg, out, on_iteration=stop_after_first)
    assert stopped.value.checkpoint and stopped.value.checkpoint.endswith("gen-000001")
    assert not ray.is_initialized()
    result = train(cfg, out, resume=out)
    assert events(out, "resumed")[0]["completed"] == 1
    assert len(result.records) == cfg.train.iterations
    assert_final_equal(out, reference)
    assert_rows_exactly_once(result.audit, result.consumed, cfg)


@pytest.mark.slow  # make test budget: Ray recovery stays in make test through the node-loss test
def test_trainer_actor_sigkilled_mid_iteration_is_restarted_and_restored(tmp_path, ray_head,
                                                                         reference):  # noqa: F811
    cfg = _ray_config(ray_head)
    # iteration 1, after its first micro-batch was summed
    hook, state = fault_at_call("train", "accumulate", 4 + 1, kill_first_actor)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "train", state["pid"])


# both slow (25 s each): trainer restarts on Ray stay in `make test` through the mid-iteration kill
@pytest.mark.parametrize("slots", [pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow)])
def test_trainer_actor_sigkilled_between_step_and_publication(tmp_path, ray_head, slots,
                                                               reference):  # noqa: F811
    """The new weights are held by the slot for their collective publication: the slot is
    restored and the same version is published from its successor (one slot per agent, or
    agents time-sharing one slot). Either way the run ends equal."""
    # half-CPU trainer bundles: two trainers and two replicas fit the 2-CPU head
    cfg = _ray_config(ray_head, f"runtime.train_workers={slots}",
                      "runtime.ray.train_bundle.cpus=0.5")

    async def kill_the_stepping_slot(pool: Any, agent: str) -> int:
        # the slot that stepped it (one slot: the agent may be swapped out by now)
        pid = pool.workers[pool.binding.get(agent, 0)].process.pid
        os.kill(pid, signal.SIGKILL)
        while os.path.exists(f"/proc/{pid}"):  # gone, and Ray knows it
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        return pid

    # iteration 1's first step, before it is published
    hook, state = fault_at_call("train", "step", 3, kill_the_stepping_slot)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "train", state["pid"])
    (event,) = events(out, "weights_refetched")  # the 3rd step: iteration 1's first
    assert event["version"] == 2 and event["agent"] in ("speaker", "listener")


@pytest.mark.slow  # make test budget: Ray recovery stays in make test through the node-loss test
def test_rollout_actor_sigkilled_mid_iteration_is_restarted(tmp_path, ray_head,
                                                            reference):  # noqa: F811
    cfg = _ray_config(ray_head)
    hook, state = fault_at_call("rollout", "generate", REQUESTS_PER_ITERATION + 20,
                                kill_first_actor, after=False)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "rollout", state["pid"])


def _check(result, out, reference, cfg, pool: str, pid: int) -> None:  # noqa: F811
    assert not ray.is_initialized()
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    assert all(r["episodes/failed"] == 0 for r in result.records)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert len(failed) == 1 and failed[0]["pool"] == pool and failed[0]["pid"] == pid
    assert len(recovered) == 1 and recovered[0]["pool"] == pool
    assert recovered[0]["recovery_s"] > 0 and recovered[0]["pid"] != pid
    assert [f["pool"] for f in result.faults["failures"]] == [pool]
    assert len(result.faults["recoveries"]) == 1
    assert '"worker_recovered"' in (out / "trace.json").read_text()
    assert_final_equal(out, reference)
