"""A sharded training slot on Ray: one slot of 2 ranks (its bundle is 2 x train_bundle on one
node; rank 0 the actor, rank 1 its child process) trains three time-sharing agents and ends
with exactly the weights of the same slot on the local runtime."""

import json
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
COMMON = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=8",
          "train.group_size=4", "train.micro_batch_size=4", "runtime.train_workers=1",
          "runtime.slot_size=2"]


@pytest.mark.slow  # two runs, one on a Ray head: about a minute on two cores
def test_one_slot_of_two_on_ray_equals_the_local_slot(tmp_path, ray_head):
    on_ray = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *COMMON, "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.ray.train_bundle.cpus=0.5", "runtime.ray.rollout_bundle.cpus=0.5"]),
        tmp_path / "ray")
    assert not ray.is_initialized()
    local = train(load_config(EXAMPLES / "relay_chain.yaml", COMMON), tmp_path / "local")
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(local.checkpoints[agent] / "model.safetensors"))
        b = load_file(str(on_ray.checkpoints[agent] / "model.safetensors"))
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, agent
    (slot,) = on_ray.placement["train"]
    assert slot["resources"] == {"CPU": 1.0}  # 2 ranks x 0.5
    lines = (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]
    assert [r["agent/relay/train_world_size"] for r in records] == [2.0, 2.0]
