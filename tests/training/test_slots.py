"""Agent-centric slots: with 1 slot three agents time-share it (states swapped out and in,
mid-iteration, accumulated gradients included) and the run ends with exactly the weights of a
run with one slot per agent (deterministic mode; real worker processes)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"


@pytest.mark.slow  # 26 s; test_shared_base.py checks the same on one shared base
def test_one_slot_and_three_slots_end_with_equal_weights(tmp_path):
    common = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=8",
              "train.group_size=4", "train.micro_batch_size=8",
              "agents.relay.algorithm={name: ppo, critic: head, kl_coef: 0.05}",
              "agents.listener.algorithm={name: reinforce_pp, kl_coef: 0.05}"]
    runs = {}
    for slots, swap in ((3, "host"), (1, "disk")):
        cfg = load_config(RELAY, common + [f"runtime.train_workers={slots}",
                                           f"runtime.swap_to={swap}"])
        runs[slots] = train(cfg, tmp_path / f"slots{slots}")
    assert runs[3].placement["train_swaps"] == 0
    # 3 agents x 2 iterations x (2 micro-batches + step) on one slot: many swaps
    assert runs[1].placement["train_swaps"] >= 4
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(runs[1].checkpoints[agent] / "model.safetensors"))
        b = load_file(str(runs[3].checkpoints[agent] / "model.safetensors"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), agent
    rec1, rec3 = runs[1].records[-1], runs[3].records[-1]
    for key in ("agent/relay/loss/value", "agent/listener/kl", "agent/speaker/grad_norm"):
        assert rec1[key] == rec3[key] and rec1[key] != 0.0


def test_sync_mode_with_one_slot_swaps_once_per_agent_and_iteration(tmp_path):
    """Sync mode trains agent after agent on time-shared slots, instead of interleaving
    micro-batches of all agents (a swap on nearly every micro-batch)."""
    cfg = load_config(RELAY, ["pipeline.mode=sync", "train.iterations=2",
                              "train.inputs_per_iteration=8", "train.group_size=4",
                              "train.micro_batch_size=8", "runtime.train_workers=1"])
    result = train(cfg, tmp_path / "run")
    # 3 agents x 2 iterations: about two swaps per agent and iteration (its micro-batches and
    # step, then the restart-point state read) plus the first weight reads; interleaving all
    # agents' micro-batches did 44 swaps in this run
    assert 2 <= result.placement["train_swaps"] <= 2 * 3 * 2 + 3


def test_async_mode_with_one_slot_swaps_at_most_twice_per_agent_and_iteration(tmp_path):
    """Sticky slots: an agent drains its queued micro-batches (and its step) in one go and is
    swapped in only with enough queued, so async with one slot swaps each agent in at most
    twice per iteration (it swapped on nearly every micro-batch before). Read from the metrics
    the run writes; iteration 0 also holds the first bindings (weight reads at start)."""
    import json

    cfg = load_config(RELAY, ["pipeline.mode=async", "train.iterations=5",
                              "train.inputs_per_iteration=16", "train.group_size=4",
                              "train.micro_batch_size=8", "runtime.train_workers=1"])
    result = train(cfg, tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]
    assert len(records) == 5
    for record in records[1:]:
        per_agent = {a: record[f"agent/{a}/swaps"] for a in ("speaker", "relay", "listener")}
        assert all(n <= 2 for n in per_agent.values()), (record["iteration"], per_agent)
        assert record["pool/train/swaps"] == sum(per_agent.values())
        assert record["pool/train/swap_s"] > 0.0
    # 8 micro-batches per agent and iteration: one swap per micro-batch would be 8
    assert result.placement["train_swaps_in"]["relay"] <= 2 * 5 + 2
