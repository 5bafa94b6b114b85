"""Agent-centric slots: with 1 slot three agents time-share it (states swapped out and in,
mid-iteration, accumulated gradients included) and the run ends with exactly the weights of a
run with one slot per agent (deterministic mode; real worker processes)."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"


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
