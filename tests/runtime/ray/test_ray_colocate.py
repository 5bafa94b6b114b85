"""Colocated pools on a real Ray head (loopback, 2 CPUs): the `marti` and `mas-rl-like`
presets run on Ray with replica i and training slot i in one bundle, the replica actors
really release their KV cache while the trainers compute (asked of the actors themselves),
and each run ends with the same weights, bit for bit, as the local colocated run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from flexmarl.config.schema import load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import train
from tests.runtime.test_colocate import (
    _instrument,
    _same_checkpoints,
    assert_asleep_while_training,
)

RELAY = Path(__file__).resolve().parents[3] / "examples" / "relay_chain.yaml"
# two short deterministic sync iterations (test_colocate.py's, the cores left to Ray)
COMMON = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=4",
          "train.group_size=2", "train.micro_batch_size=4"]


@pytest.mark.slow  # a Ray and a local run each; the placement: test_ray_runtime.py (fast)
@pytest.mark.parametrize("system", ["marti", "mas-rl-like"])
def test_colocated_presets_on_ray_sleep_and_equal_the_local_run(system, tmp_path, ray_head):
    seen: dict[str, list] = {"training": [], "turns": []}
    on_ray = train(load_config(RELAY, [*system_overrides(system), *COMMON, "runtime.kind=ray",
                                       f"runtime.address={ray_head}"]),
                   tmp_path / "ray", on_runtime=_instrument(seen))
    assert not ray.is_initialized()
    local = train(load_config(RELAY, [*system_overrides(system), *COMMON]), tmp_path / "local")
    # replica 0 and slot 0 in bundle 0 of one placement group, half of it each
    placement = json.loads((tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()[0])
    (replica,), (slot,) = placement["rollout"], placement["train"]
    assert replica["placement_group"] == slot["placement_group"]
    assert replica["bundle"] == slot["bundle"] == 0
    assert replica["resources"] == slot["resources"] == {"CPU": 0.5}
    # asked of the replica actors while each training call runs: no engine holds a KV pool
    assert_asleep_while_training(seen)
    first, second = on_ray.records
    assert first["pool/rollout/sleep_kv_bytes"] > 0 and first["pool/rollout/sleep_s"] > 0
    if system == "marti":  # all engines wake before the next rollout
        assert "pool/rollout/wake_s" not in first and second["pool/rollout/wake_s"] > 0
    if system == "mas-rl-like":  # one agent's engines awake at a time, before each request
        assert all({a for a, e in engines.items() if not e["asleep"]} == {agent}
                   for agent, replicas in seen["turns"] for engines in replicas)
        assert [r["pool/rollout/switches"] for r in on_ray.records] == [3, 3]
    _same_checkpoints(on_ray, local)
    for x, y in zip(on_ray.records, local.records, strict=True):
        assert x["task/success_rate"] == y["task/success_rate"]
        assert x["agent/relay/reward_mean"] == y["agent/relay/reward_mean"]
