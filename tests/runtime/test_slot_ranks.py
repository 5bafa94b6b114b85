"""Sharded training slots on the local runtime (real worker processes, real gloo groups): a
run with one slot of 2 ranks, three agents time-sharing it (per-rank shard swaps, accumulated
gradients included), ends with the weights of a run on one-device slots within 1e-4 and
records the ranks each agent trained on."""

import json
import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from tests.faults.conftest import assert_final_equal, assert_rows_exactly_once, config, events

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"
COMMON = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=8",
          "train.group_size=4", "train.micro_batch_size=4", "runtime.train_workers=1"]


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]


@pytest.mark.slow  # two short runs: about a minute on two cores
def test_a_slot_of_two_ranks_ends_with_the_weights_of_one_device(tmp_path):
    runs = {k: train(load_config(RELAY, [*COMMON, f"runtime.slot_size={k}"]),
                     tmp_path / f"k{k}") for k in (1, 2)}
    assert runs[2].placement["train_swaps"] >= 3  # three agents on one slot
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(runs[1].checkpoints[agent] / "model.safetensors"))
        b = load_file(str(runs[2].checkpoints[agent] / "model.safetensors"))
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 1e-4, (agent, worst)
    for k in (1, 2):
        records = _records(tmp_path / f"k{k}")
        assert len(records) == 2
        for record in records:
            for agent in ("speaker", "relay", "listener"):
                assert record[f"agent/{agent}/train_world_size"] == float(k)
            assert 0.0 < record["pool/train/busy_frac"] <= 1.0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.slow  # two runs and a re-formed slot: about a minute on two cores
def test_a_rank_killed_mid_step_reforms_the_slot_and_resumes_exactly(tmp_path):
    """SIGKILL of rank 1 after the first micro-batch of iteration 1 was summed: rank 0 sees it
    and fails the slot, the supervisor re-forms it, the agents are restored from their restart
    points (DCP, per rank) and replay the journal: every row trained on once, and the weights
    equal an uninterrupted run with the same slots (checkpoints every iteration, sharded)."""
    cfg = config("runtime.slot_size=2", "runtime.rollout_workers=1")
    reference = train(cfg, tmp_path / "reference")
    state = {"n": 0, "pid": None}

    def hook(runtime):
        pool = runtime.train
        original = pool.accumulate

        async def accumulate(agent, samples):
            out = await original(agent, samples)
            state["n"] += 1
            if state["n"] == 4 + 1:
                (follower,) = _children(pool.workers[0].process.pid)
                state["pid"] = follower
                os.kill(follower, signal.SIGKILL)
            return out

        pool.accumulate = accumulate

    out = tmp_path / "run"
    result = train(cfg, out, on_runtime=hook)
    assert state["pid"] is not None
    assert_rows_exactly_once(result.audit, result.consumed, cfg)
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed and failed[0]["pool"] == "train"
    assert recovered and recovered[0]["pool"] == "train"
    assert_final_equal(out, reference)
    gen = out / "checkpoints" / (out / "checkpoints" / "LATEST").read_text().strip()
    assert any((gen / "agents").glob("*/dcp/.metadata"))  # sharded checkpoints, in the layout


@pytest.mark.slow  # one short run: about 30 s on two cores
def test_slots_of_different_sizes_train_the_heaviest_agent_on_the_largest(tmp_path):
    """runtime.slot_sizes [1, 2]: the relay (the largest model) trains on the slot of 2, the
    other two time-share the slot of 1; the plan records the sizes."""
    cfg = load_config(RELAY, [*COMMON[:-1], "runtime.slot_sizes=[1, 2]",
                              "agents.relay.model.hidden_size=192"])
    seen = {}
    result = train(cfg, tmp_path / "run", on_runtime=lambda rt: seen.update(rt=rt))
    assert seen["rt"].slot_sizes == [2, 1] and seen["rt"].slot_of == {
        "relay": 0, "speaker": 1, "listener": 1}
    records = _records(tmp_path / "run")
    for record in records:
        assert record["agent/relay/train_world_size"] == 2.0
        assert record["agent/speaker/train_world_size"] == 1.0
        assert record["agent/listener/train_world_size"] == 1.0
    assert result.placement["train_swaps"] >= 2  # speaker and listener share their slot
    assert records[-1]["rollout/plan"]["slot_sizes"] == [2, 1]


@pytest.mark.slow  # five short runs: about two minutes on two cores
def test_a_checkpoint_taken_at_one_slot_size_resumes_at_another(tmp_path):
    """Checkpoints of a slot of 2 hold each agent's DCP folder; resumed on one-device slots
    (and a one-device checkpoint resumed on a slot of 2) the run ends within 1e-4 of the
    uninterrupted one-device run (deterministic, sync: summation order only)."""
    base = ["runtime.deterministic=true", "pipeline.mode=sync", "train.inputs_per_iteration=8",
            "train.group_size=4", "train.micro_batch_size=4", "runtime.train_workers=1",
            "train.checkpoint_every=1"]

    def run(k: int, iterations: int, out: str, resume: str | None = None):
        cfg = load_config(RELAY, [*base, f"runtime.slot_size={k}",
                                  f"train.iterations={iterations}"])
        return train(cfg, tmp_path / out, resume=tmp_path / resume if resume else None)

    reference = run(1, 3, "reference")
    run(2, 2, "k2")
    assert (tmp_path / "k2" / "checkpoints" / "gen-000002" / "agents" / "relay" / "dcp"
            / ".metadata").is_file()
    runs = {"k2->k1": run(1, 3, "k2", "k2")}
    run(1, 2, "k1")
    runs["k1->k2"] = run(2, 3, "k1", "k1")
    for name, result in runs.items():
        for agent in ("speaker", "relay", "listener"):
            a = load_file(str(reference.checkpoints[agent] / "model.safetensors"))
            b = load_file(str(result.checkpoints[agent] / "model.safetensors"))
            worst = max(float((a[k] - b[k]).abs().max()) for k in a)
            assert worst <= 1e-4, (name, agent, worst)


@pytest.mark.slow  # two short runs: about a minute on two cores
def test_lora_agents_on_a_slot_of_two_end_with_the_weights_of_one_device(tmp_path):
    """Two adapter agents on one shared base (the base sharded once per slot, adapters with
    it) and an agent with its own base and adapter, time-sharing one slot of 2 ranks."""
    from tests.training.test_shared_base import SHARED

    lora = [*SHARED, "agents.relay.lora={r: 2, target_modules: [q_proj, down_proj]}"]
    runs = {k: train(load_config(RELAY, [*COMMON, *lora, f"runtime.slot_size={k}"]),
                     tmp_path / f"k{k}") for k in (1, 2)}
    assert runs[2].placement["train_swaps"] >= 3
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(runs[1].checkpoints[agent] / "model.safetensors"))
        b = load_file(str(runs[2].checkpoints[agent] / "model.safetensors"))
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 1e-4, (agent, worst)
        adapter_a = load_file(str(runs[1].checkpoints[agent] / "adapter" /
                                  "adapter_model.safetensors"))
        adapter_b = load_file(str(runs[2].checkpoints[agent] / "adapter" /
                                  "adapter_model.safetensors"))
        assert adapter_a.keys() == adapter_b.keys()
        assert max((adapter_a[k] - adapter_b[k]).abs().max().item() for k in adapter_a) <= 1e-4
    for record in _records(tmp_path / "k2"):
        for agent in ("speaker", "relay", "listener"):
            assert record[f"agent/{agent}/train_world_size"] == 2.0


@pytest.mark.slow  # two short runs: about a minute on two cores
def test_ppo_kl_and_several_passes_on_a_slot_of_two_end_with_the_weights_of_one_device(
        tmp_path):
    """PPO with a separate critic, a KL reference and two passes per iteration, time-sharing
    one slot of 2 ranks (restart points and swaps carry the critic)."""
    algos = ["agents.relay.algorithm={name: ppo, critic: separate, epochs: 2}",
             "agents.speaker.algorithm.kl_coef=0.1", "agents.listener.algorithm.epochs=2"]
    runs = {k: train(load_config(RELAY, [*COMMON, *algos, f"runtime.slot_size={k}"]),
                     tmp_path / f"k{k}") for k in (1, 2)}
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(runs[1].checkpoints[agent] / "model.safetensors"))
        b = load_file(str(runs[2].checkpoints[agent] / "model.safetensors"))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 1e-4, (agent, worst)
    for record in _records(tmp_path / "k2"):
        assert record["agent/relay/train_world_size"] == 2.0
        assert record["agent/relay/epochs"] == 2.0
