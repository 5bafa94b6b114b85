"""The spine's orchestrator on a real Ray head (loopback, 2 CPUs): it learns, it matches the
local runtime bit for bit in deterministic mode, placement is logged, the session always ends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from flexmarl.api.runtime import WorkerError
from flexmarl.config.schema import load_config
from flexmarl.config.systems import system_overrides
from flexmarl.orchestrator.run import train
from flexmarl.runtime.ray.placement import RayPools
from flexmarl.runtime.ray.session import RayRuntimeError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _head_up(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.slow  # 17 s; Ray == local stays in make test (shared-base LoRA run, test_ray_marl)
def test_referential_game_learns_on_ray(tmp_path, ray_head):
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address={ray_head}", "train.iterations=30",
    ])
    result = train(cfg, tmp_path / "run")
    assert not ray.is_initialized(), "the driver must disconnect when the run ends"
    assert _head_up(ray_head), "a cluster FlexMARL did not start must stay up"
    first = sum(r["task/success_rate"] for r in result.records[:5]) / 5
    last = sum(r["task/success_rate"] for r in result.records[-5:]) / 5
    assert first < 0.25 + 0.15
    assert last >= 0.5 and last > first + 0.2, f"success {first:.3f} -> {last:.3f}"
    # Placement is visible: which actor ran where, in metrics.jsonl and run.log.
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    placement = lines[0]
    assert placement["event"] == "placement" and placement["runtime"] == "ray"
    assert placement["ray"]["address"].endswith(ray_head.rsplit(":", 1)[1])
    assert not placement["ray"]["started_cluster"]
    for pool in ("rollout", "train"):
        (worker,) = placement[pool]
        assert worker["node_id"] and worker["pid"] > 0 and worker["placement_group"]
        assert worker["resources"] == {"CPU": 1.0}
    # one slot, two agents: bound on demand (the restart points taken at start bind each in
    # turn), so the slot holds one of them when the run starts
    assert placement["train"][0]["agents"] in (["speaker"], ["listener"])
    assert placement["rollout"][0]["placement_group"] != placement["train"][0]["placement_group"]
    assert "rollout[0] actor" in (tmp_path / "run" / "run.log").read_text()
    records = lines[1:]
    assert len(records) == 30
    assert all(0 < r["pool/rollout/busy_frac"] <= 1 for r in records)
    assert all(0 < r["pool/train/busy_frac"] <= 1 for r in records)
    for agent, path in result.checkpoints.items():
        meta = json.loads((path / "flexmarl.json").read_text())
        assert meta["agent"] == agent and meta["policy_version"] == 30


def test_bf16_agents_train_and_publish_on_ray(tmp_path, ray_head):
    """bf16 weights have no numpy dtype: publication travels in the wire form (a numpy conversion
    crashed on them); replicas compute in bf16, trainers keep fp32 masters under autocast."""
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address={ray_head}", "train.iterations=3",
        "agents.speaker.model.dtype=bfloat16", "agents.listener.model.dtype=bfloat16",
    ])
    result = train(cfg, tmp_path / "run")
    last = result.records[-1]
    assert last["agent/speaker/policy_version"] == 3 and last["episodes/failed"] == 0
    # bf16 rollout against bf16 autocast recomputation: close, and measured
    assert 0 <= last["rollout/logprob_diff_mean"] < 0.05
    for path in result.checkpoints.values():  # the checkpoint holds the fp32 masters
        assert {str(t.dtype) for t in load_file(str(path / "model.safetensors")).values()} == {
            "torch.float32"}


def test_colocated_pools_share_one_placement_group_bundle_by_bundle(ray_head):
    """`runtime.colocate` on Ray: one placement group for both pools, replica i and training
    slot i in bundle i, each asking half of it, so two replicas and two slots fit the 2-CPU
    head (apart they would need 4 CPUs). The colocated runs: test_ray_colocate.py (slow)."""
    rt = load_config(EXAMPLES / "relay_chain.yaml", [
        *system_overrides("marti"), "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.rollout_workers=2", "runtime.train_workers=2"]).runtime
    pools = RayPools("colocate", rt, {"rollout": 2, "train": 2})
    try:
        asyncio.run(pools.place())
        group = pools.groups["rollout"]
        assert pools.groups["train"] is group
        assert list(ray.util.placement_group_table(group)["bundles"].values()) == \
            [{"CPU": 1.0}] * 2
        for i in range(2):
            asks = [pools.options(pool, i) for pool in ("rollout", "train")]
            assert [a["num_cpus"] for a in asks] == [0.5, 0.5]
            assert all(a["scheduling_strategy"].placement_group is group
                       and a["scheduling_strategy"].placement_group_bundle_index == i
                       for a in asks)
    finally:
        pools.release()
    assert not ray.is_initialized()


@pytest.mark.slow  # make test budget: the shared-base LoRA test below checks Ray == local
def test_deterministic_local_and_ray_give_equal_checkpoints(tmp_path, ray_head):
    common = ["runtime.deterministic=true", "train.iterations=3", "train.group_size=4",
              "train.inputs_per_iteration=4", "train.micro_batch_size=8"]
    local = train(load_config(EXAMPLES / "referential_game.yaml", common), tmp_path / "local")
    on_ray = train(load_config(EXAMPLES / "referential_game.yaml", [
        *common, "runtime.kind=ray", f"runtime.address={ray_head}"]), tmp_path / "ray")
    assert not ray.is_initialized()
    for agent, path in local.checkpoints.items():
        assert _max_diff(path, on_ray.checkpoints[agent]) <= 1e-5
    assert [r["task/success_rate"] for r in local.records] == \
        [r["task/success_rate"] for r in on_ray.records]
    assert all(r["agent/speaker/grad_norm"] > 0 for r in on_ray.records)


def test_shared_base_lora_agents_and_collective_publication_on_ray_equal_local(tmp_path,
                                                                              ray_head):
    """Adapter agents on one shared base (refused on Ray before it hosted the local workers)
    with weights published straight from the training slot to the replicas over
    torch.distributed: the same checkpoints as the local runtime publishing by pipe."""
    common = ["runtime.deterministic=true", "train.iterations=2", "train.group_size=4",
              "train.inputs_per_iteration=4", "train.micro_batch_size=8"]
    local = train(load_config(EXAMPLES / "shared_base.yaml", [
        *common, "runtime.publication=pipe"]), tmp_path / "local")
    on_ray = train(load_config(EXAMPLES / "shared_base.yaml", [
        *common, "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.publication=collective"]), tmp_path / "ray")
    assert not ray.is_initialized()
    assert set(on_ray.checkpoints) == {"speaker", "relay", "listener"}
    for agent, path in local.checkpoints.items():
        assert _max_diff(path, on_ray.checkpoints[agent]) <= 1e-5, agent
    assert [r["task/success_rate"] for r in local.records] == \
        [r["task/success_rate"] for r in on_ray.records]
    assert on_ray.records[-1]["agent/listener/policy_version"] == 2


@pytest.mark.slow  # 30 s; shared slots are checked locally (tests/training/test_slots.py)
def test_three_agents_share_one_training_slot_on_ray_sticky_and_exact(tmp_path, ray_head):
    """The shared training host on Ray: 3 agents time-share 1 trainer actor (states swapped
    through the object store), each swapped in at most twice per iteration (sticky slots), the
    swaps printed per iteration; deterministic mode ends bit-identical to the local runtime
    with one slot per agent."""
    common = ["runtime.deterministic=true", "pipeline.mode=async", "train.iterations=4",
              "train.inputs_per_iteration=16", "train.group_size=4",
              "train.micro_batch_size=8"]
    on_ray = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *common, "runtime.kind=ray", f"runtime.address={ray_head}",
        "runtime.train_workers=1"]), tmp_path / "ray")
    local = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *common, "runtime.train_workers=3"]), tmp_path / "local")
    agents = ("speaker", "relay", "listener")
    lines = (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]
    assert len(records) == 4
    for record in records[1:]:  # iteration 0 also holds the first bindings
        per_agent = {a: record[f"agent/{a}/swaps"] for a in agents}
        assert all(n <= 2 for n in per_agent.values()), (record["iteration"], per_agent)
        assert record["pool/train/swaps"] == sum(per_agent.values()) > 0
        assert record["pool/train/swap_s"] > 0.0
    assert on_ray.placement["train_swaps"] >= 3 * 3  # they did time-share the slot
    assert local.placement["train_swaps"] == 0
    for agent in agents:
        assert _max_diff(local.checkpoints[agent], on_ray.checkpoints[agent]) <= 1e-5, agent


def test_unplaceable_pool_fails_clearly_and_shuts_down(tmp_path, ray_head):
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address={ray_head}", "runtime.ray.rollout_bundle.cpus=3",
        "runtime.ray.placement_timeout_s=2",
    ])
    with pytest.raises(RayRuntimeError, match=r"runtime\.ray\.rollout_bundle.*not placed"):
        train(cfg, tmp_path / "run")
    assert not ray.is_initialized()
    # Nothing of the failed run holds the cluster's CPUs: the next run can place its pools.
    ray.init(address=ray_head, log_to_driver=False)
    try:
        assert ray.available_resources().get("CPU") == 2.0
    finally:
        ray.shutdown()


def test_unreachable_address_fails_fast_with_the_setting_named(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address=127.0.0.1:{port}"])
    with pytest.raises(RayRuntimeError,
                       match=rf"runtime\.address=127\.0\.0\.1:{port}: no Ray head"):
        train(cfg, tmp_path / "run")
    assert not ray.is_initialized()


@pytest.mark.slow
def test_trainer_actor_killed_mid_run_fails_the_run_and_shuts_down(tmp_path, ray_head):
    """A real fault with restarts off: the train actor's process is SIGKILLed after
    iteration 0 and the run fails, naming the actor (restarts: test_ray_faults.py)."""
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", f"runtime.address={ray_head}", "train.iterations=20",
        "train.inputs_per_iteration=8", "pipeline.mode=sync", "runtime.max_worker_restarts=0",
    ])
    metrics = tmp_path / "run" / "metrics.jsonl"

    def kill_trainer(record):
        if record["iteration"] == 0:
            placement = json.loads(metrics.read_text().splitlines()[0])
            os.kill(placement["train"][0]["pid"], signal.SIGKILL)

    with pytest.raises(WorkerError, match="train worker 0"):
        train(cfg, tmp_path / "run", on_iteration=kill_trainer)
    assert not ray.is_initialized()
    assert _head_up(ray_head)


@pytest.mark.slow
def test_local_cluster_started_for_the_run_is_stopped(tmp_path):
    """No runtime.address: FlexMARL starts a private cluster and shuts it down again."""
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "runtime.kind=ray", "train.iterations=1", "train.inputs_per_iteration=4",
        "runtime.ray.num_cpus=2",
    ])
    result = train(cfg, tmp_path / "run")
    assert result.placement["ray"]["started_cluster"]
    assert not ray.is_initialized()
    assert not _head_up(result.placement["ray"]["address"])


def _gen_agents_after_each_plan(run_dir: Path) -> list[tuple[dict, dict[int, set[str]]]]:
    """From the run's trace: each planner plan with replicas, and per rollout replica the
    agents it generated for between that plan and the next."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    pools = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    plans = sorted((e["ts"], e["args"]) for e in events
                   if e["ph"] == "i" and e["name"] == "rollout_plan")
    out = []
    for i, (t0, plan) in enumerate(plans):
        t1 = plans[i + 1][0] if i + 1 < len(plans) else float("inf")
        seen: dict[int, set[str]] = {}
        for e in events:
            if e["ph"] == "X" and pools.get(e["pid"]) == "rollout" \
                    and e["name"].startswith("gen:") and t0 < e["ts"] < t1:
                seen.setdefault(e["tid"], set()).update(e["name"][4:].split("+"))
        out.append((plan, seen))
    return out


@pytest.mark.slow
def test_ray_pools_follow_the_plan_and_match_local_bit_for_bit(tmp_path, ray_head):
    """The one planner on Ray: with more replicas than agents (4 for 3) the rollout pool
    serves each agent from the replicas the plan allots it (every replica hosts every model),
    and the training slot is handed out in the plan's order; placement changes nothing that
    is computed: the checkpoints equal the local runtime's with one replica."""
    common = ["runtime.deterministic=true", "pipeline.mode=async", "train.iterations=3",
              "train.inputs_per_iteration=16", "train.group_size=4",
              "train.micro_batch_size=8", "runtime.train_workers=1"]
    on_ray = train(load_config(EXAMPLES / "relay_chain.yaml", [
        *common, "runtime.kind=ray", f"runtime.address={ray_head}", "runtime.rollout_workers=4",
        "runtime.ray.rollout_bundle.cpus=0.25"]), tmp_path / "ray")
    local = train(load_config(EXAMPLES / "relay_chain.yaml", common), tmp_path / "local")
    planned = _gen_agents_after_each_plan(tmp_path / "ray")
    assert len(planned) == 3
    for plan, seen in planned[:-1]:  # the last plan is for an iteration that never runs
        assert plan["train_order"] == ["speaker", "relay", "listener"]  # a chain: upstream first
        assert "predicted_s" in plan  # the planner allotted the replicas (not the pool)
        replicas = plan["replicas"]
        assert sorted(i for r in replicas.values() for i in r) == [0, 1, 2, 3], plan
        serves = {i: {a for a, r in replicas.items() if i in r} for i in range(4)}
        assert seen and all(agents <= serves[i] for i, agents in seen.items()), (plan, seen)
    for agent in ("speaker", "relay", "listener"):
        assert _max_diff(local.checkpoints[agent], on_ray.checkpoints[agent]) <= 1e-5, agent
