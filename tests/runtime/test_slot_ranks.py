"""Sharded training slots on the local runtime (real worker processes, real gloo groups): a
run with one slot of 2 ranks, three agents time-sharing it (per-rank shard swaps, accumulated
gradients included), ends with the weights of a run on one-device slots within 1e-4 and
records the ranks each agent trained on."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

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
