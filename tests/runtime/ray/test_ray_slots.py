"""A sharded training slot on Ray: one slot of 2 ranks (a placement group of 2 train_bundles
packed on one node; rank 0 the slot's actor, rank 1 an actor in the other bundle) trains three
time-sharing agents and ends with exactly the weights of the same slot on the local runtime,
full-model agents and LoRA agents (on a shared base, and on a base of their own) alike."""

import json
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from tests.faults.conftest import assert_final_equal, assert_rows_exactly_once, config, events
from tests.training.test_shared_base import SHARED

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
COMMON = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=8",
          "train.group_size=4", "train.micro_batch_size=4", "runtime.train_workers=1",
          "runtime.slot_size=2"]


def _slot_on_ray(record) -> dict:
    """While the run trains: the slot's placement group and its rank actors."""
    (group,) = [g for g in placement_group_table().values()
                if g["name"].startswith("flexmarl-") and "-train0-" in g["name"]
                and g["state"] == "CREATED"]
    ranks = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("flexmarl-slot-rank")]
    return {"group": group, "ranks": ranks}


@pytest.mark.slow  # two runs, one on a Ray head: about a minute on two cores
def test_one_slot_of_two_on_ray_equals_the_local_slot(tmp_path, ray_head):
    seen: list[dict] = []
    on_ray = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *COMMON, "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.ray.train_bundle.cpus=0.5", "runtime.ray.rollout_bundle.cpus=0.5"]),
        tmp_path / "ray", on_iteration=lambda r: seen.append(_slot_on_ray(r)))
    assert not ray.is_initialized()
    # the slot: a placement group of 2 bundles packed on one node, rank 1 an actor in it
    group = seen[0]["group"]
    assert group["strategy"] == "STRICT_PACK" and len(group["bundles"]) == 2
    assert len(set(group["bundles_to_node_id"].values())) == 1
    assert all(len(s["ranks"]) == 1 and s["ranks"][0].startswith("flexmarl-slot-rank1-")
               for s in seen)
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


@pytest.mark.slow  # two runs, one on a Ray head: about a minute on two cores
def test_lora_agents_on_a_ray_slot_of_two_equal_the_local_slot(tmp_path, ray_head):
    """Two adapter agents on one shared base (the slot's one peft model, its base sharded
    once over the two rank actors) and an agent with its own base and adapter, time-sharing
    one Ray slot of 2: the merged weights and the adapters of the same local slot."""
    lora = [*SHARED, "agents.relay.lora={r: 2, target_modules: [q_proj, down_proj]}"]
    on_ray = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *COMMON, *lora, "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.ray.train_bundle.cpus=0.5", "runtime.ray.rollout_bundle.cpus=0.5"]),
        tmp_path / "ray")
    assert on_ray.placement["train_swaps"] >= 3  # three agents on one slot
    local = train(load_config(EXAMPLES / "relay_chain.yaml", [*COMMON, *lora]),
                  tmp_path / "local")
    for agent in ("speaker", "relay", "listener"):
        for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
            a = load_file(str(local.checkpoints[agent] / name))
            b = load_file(str(on_ray.checkpoints[agent] / name))
            assert a.keys() == b.keys(), (agent, name)
            assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, (agent, name)
    lines = (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]
    for agent in ("speaker", "relay", "listener"):
        assert [r[f"agent/{agent}/train_world_size"] for r in records] == [2.0, 2.0]


@pytest.mark.slow  # a local reference and a Ray run whose slot is re-formed: ~1.5 min here
def test_a_rank_actor_killed_mid_iteration_reforms_the_slot_and_resumes_exactly(tmp_path,
                                                                               ray_head):
    """`ray.kill` of the rank-1 actor after the first micro-batch of iteration 1: rank 0 sees
    it end and fails the slot, the supervisor restarts rank 0's actor, which starts a new
    rank-1 actor in its group; the agents are restored from their restart points and replay
    the journal: every row trained on once, the weights equal the uninterrupted local run."""
    extra = ("runtime.slot_size=2", "runtime.rollout_workers=1")
    reference = train(config(*extra), tmp_path / "reference")
    cfg = config(*extra, "runtime.kind=ray", f"runtime.address={ray_head}",
                 "runtime.ray.train_bundle.cpus=0.5", "runtime.ray.rollout_bundle.cpus=0.5")
    state: dict = {"n": 0, "killed": None}

    def hook(runtime):
        pool = runtime.train
        original = pool.accumulate

        async def accumulate(agent, samples):
            out = await original(agent, samples)
            state["n"] += 1
            if state["n"] == 4 + 1:
                (rank,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["name"].startswith("flexmarl-slot-rank1-")]
                state["killed"] = rank["name"]
                ray.kill(ray.get_actor(rank["name"], namespace=rank["namespace"]))
            return out

        pool.accumulate = accumulate

    out = tmp_path / "ray"
    result = train(cfg, out, on_runtime=hook)
    assert state["killed"] is not None
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert [e["pool"] for e in failed] == [e["pool"] for e in recovered] == ["train"]
    assert_final_equal(out, reference)
