"""Ray parity with the local runtime on a real Ray head (loopback, 2 CPUs): an `openai` agent is
served by its HTTP endpoint from the driver (a real `flexmarl serve-model` on loopback), next to
a bf16 agent that trains and publishes; a hung (SIGSTOPped) trainer or replica is found by the
heartbeats, killed and recovered exactly as a crashed one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from flexmarl.api.runtime import WorkerError
from flexmarl.config.schema import BackendConfig, config_from_dict
from flexmarl.orchestrator.run import train
from flexmarl.rollout.backends.openai import OpenAIBackend
from flexmarl.rollout.balancer import Balancer
from flexmarl.runtime.local.runtime import LocalRolloutPool
from tests.faults.conftest import (
    events,
    max_diff,
    reference,  # noqa: F401 - the local fault-free run
)
from tests.rollout.test_openai_backend import (
    _game_config,
    served,  # noqa: F401 - serve-model on loopback
)
from tests.runtime.ray.conftest import CHAOS_STALL
from tests.runtime.ray.test_ray_faults import (
    REQUESTS_PER_ITERATION,
    _check,
    _ray_config,
    fault_at_call,
)


def _frozen_listener_config(url: str, *runtime: str) -> dict:
    """The referential game with a bf16 speaker and the listener frozen behind `url`."""
    raw = _game_config(trainable=False, backend={"kind": "openai", "url": url})
    raw["agents"]["speaker"].setdefault("model", {})["dtype"] = "bfloat16"
    raw["runtime"] = {**raw.get("runtime", {}), "deterministic": True}
    for item in runtime:
        key, value = item.split("=", 1)
        raw["runtime"][key] = value
    return raw


@pytest.mark.slow  # make test budget: Ray == local stays in test_ray_runtime, test_ray_marl
def test_openai_agent_and_bf16_agent_on_ray_match_the_local_runtime(
        tmp_path, ray_head, served):  # noqa: F811
    url, _ = served
    seen: dict = {"answered": 0}

    def hook(runtime):
        endpoint = seen["endpoint"] = runtime.rollout.remote["listener"]
        original = endpoint.generate

        async def generate(request):
            result = await original(request)
            seen["answered"] += 1
            return result

        endpoint.generate = generate

    on_ray = train(config_from_dict(_frozen_listener_config(
        url, "kind=ray", f"address={ray_head}")), tmp_path / "ray", on_runtime=hook)
    assert not ray.is_initialized()
    local = train(config_from_dict(_frozen_listener_config(url)), tmp_path / "local")

    # the listener's requests went to the endpoint, from the driver: one per episode
    endpoint = seen["endpoint"]
    assert seen["answered"] == 2 * 8 * 4 and endpoint.attempts >= 2 * 8 * 4  # HTTP retries
    trace = (tmp_path / "ray" / "trace.json").read_text()
    assert "gen:speaker" in trace and "gen:listener" not in trace  # no replica hosts it
    placement = json.loads((tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()[0])
    assert placement["endpoints"] == {"listener": endpoint.url}
    assert f"agent listener served by the endpoint {endpoint.url}" in \
        (tmp_path / "ray" / "run.log").read_text()

    for result in (on_ray, local):
        assert all(r["episodes/failed"] == 0 for r in result.records)
        assert result.records[-1]["agent/listener/tokens_generated"] == 8 * 4
        assert result.records[-1]["agent/speaker/policy_version"] == 2  # bf16, published
        assert set(result.checkpoints) == {"speaker"}
    # bf16 replicas against the trainer's bf16 autocast recomputation: close, and measured
    assert 0 <= on_ray.records[-1]["rollout/logprob_diff_mean"] < 0.05
    # same sampling on both runtimes (the endpoint is keyed by the request's noise seed)
    assert [r["task/success_rate"] for r in on_ray.records] == \
        [r["task/success_rate"] for r in local.records]
    assert max_diff(on_ray.checkpoints["speaker"], local.checkpoints["speaker"]) <= 1e-5
    assert {str(t.dtype) for t in load_file(
        str(on_ray.checkpoints["speaker"] / "model.safetensors")).values()} == {"torch.float32"}


def test_publishing_to_an_endpoint_agent_is_refused():
    endpoint = OpenAIBackend("judge", BackendConfig(kind="openai", url="http://127.0.0.1:9"))
    pool = LocalRolloutPool([], Balancer(["speaker"], 1, "hierarchical", {"speaker": 1.0}),
                          {"judge": endpoint})
    with pytest.raises(WorkerError, match="agent 'judge' is served by an external endpoint"):
        asyncio.run(pool.publish("judge", 1, {}))
    endpoint.close()


# Heartbeats: a ping every 0.5 s, 6 unanswered intervals (3 s) make an actor hung.
HEARTBEAT = ["runtime.heartbeat_interval_s=0.5", "runtime.heartbeat_misses=6"]


def _freeze(pid: int) -> None:
    """SIGSTOP `pid`; SIGCONT it after 60 s should nothing have killed it, so a broken
    heartbeat fails the test (no `worker_failed`) instead of hanging it."""
    os.kill(pid, signal.SIGSTOP)

    def thaw() -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    asyncio.get_running_loop().call_later(60, thaw)


async def freeze_first_actor(pool, *_) -> int:
    pid = pool.workers[0].process.pid
    _freeze(pid)
    return pid


def _hung(out, pool: str) -> None:
    (failed,) = events(out, "worker_failed")
    assert failed["pool"] == pool and "missed 6 heartbeats" in failed["reason"]


@pytest.mark.slow  # make test budget: Ray recovery stays in make test through the node-loss test
def test_trainer_actor_hung_mid_iteration_is_killed_and_restored(tmp_path, ray_head,
                                                                 reference):  # noqa: F811
    """SIGSTOP: the process lives but never answers; the heartbeats find it, and it is
    recovered through the crash path: the run ends equal to the fault-free one."""
    cfg = _ray_config(ray_head, *HEARTBEAT)
    # iteration 1, after its first micro-batch was summed
    hook, state = fault_at_call("train", "accumulate", 4 + 1, freeze_first_actor)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "train", state["pid"])
    _hung(out, "train")


@pytest.mark.slow  # 23 s
def test_rollout_actor_hung_mid_iteration_is_killed_and_restarted(tmp_path, ray_head,
                                                                  reference):  # noqa: F811
    cfg = _ray_config(ray_head, *HEARTBEAT)
    hook, state = fault_at_call("rollout", "generate", REQUESTS_PER_ITERATION + 20,
                                freeze_first_actor, after=False)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "rollout", state["pid"])
    _hung(out, "rollout")


@pytest.mark.slow  # the progress timeout (5 s), a restart and two replays
def test_trainer_actor_with_a_stuck_compute_thread_is_killed_and_restored(
        tmp_path, ray_head, reference):  # noqa: F811
    """Its compute thread blocks in `accumulate` while its health group still answers pings:
    `runtime.progress_timeout_s` finds it (calls outstanding, none answered); it is recovered
    through the crash path and the run ends equal to the fault-free one."""
    stall = Path(CHAOS_STALL[ray_head])
    cfg = _ray_config(ray_head, "runtime.heartbeat_interval_s=0.5",
                      "runtime.progress_timeout_s=5")

    async def stall_next_accumulate(pool, *_) -> int:
        stall.write_text("train:accumulate")
        return pool.workers[0].process.pid

    # iteration 1, after its first micro-batch was summed: the next one blocks
    hook, state = fault_at_call("train", "accumulate", 4 + 1, stall_next_accumulate)
    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    _check(result, out, reference, cfg, "train", state["pid"])
    assert not stall.exists()
    (failed,) = events(out, "worker_failed")
    assert "no progress" in failed["reason"] and "progress_timeout_s=5" in failed["reason"]
