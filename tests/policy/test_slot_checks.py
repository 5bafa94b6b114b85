"""Training slots of K ranks that cannot run here are refused before anything starts, with one
line naming the field and the numbers (runtime.slot_size / slot_sizes): more GPUs than the
training pool has, more CPU processes than 4x the CPUs. Every LLM algorithm and LoRA shard."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from flexmarl.config.schema import RuntimeConfig, load_config
from flexmarl.policy.device import Placement, PlacementError, check_slots, slot_placements

ROOT = Path(__file__).resolve().parents[2]
RELAY = ROOT / "examples" / "relay_chain.yaml"


def test_slot_sizes_replace_train_workers_largest_first():
    rt = RuntimeConfig(slot_sizes=[2, 4, 2])
    assert rt.train_workers == 3
    assert rt.train_slot_sizes() == [4, 2, 2]
    assert rt.train_slot_sizes(2) == [4, 2]  # no more slots than trainable agents
    assert RuntimeConfig(train_workers=3, slot_size=2).train_slot_sizes() == [2, 2, 2]
    with pytest.raises(ValueError, match="slot_sizes .* replaces runtime.slot_size"):
        RuntimeConfig(slot_sizes=[2], slot_size=2)
    with pytest.raises(ValueError, match=r"slot_sizes\.1\n.*greater than 0"):
        RuntimeConfig(slot_sizes=[2, 0])
    with pytest.raises(ValueError, match=r"slot_sizes\n.*at least 1 item"):
        RuntimeConfig(slot_sizes=[])


def test_a_slot_larger_than_the_training_gpus_is_refused():
    rt = RuntimeConfig(devices="cuda", train_devices=[2, 3], rollout_devices=[0, 1],
                       slot_size=3)
    with pytest.raises(PlacementError, match=r"runtime.train_workers=1 x runtime.slot_size=3: "
                       r"a slot of 3 ranks needs 3 GPUs, but the training pool has 2 \(\[2, 3\]\)"):
        check_slots(rt, [3], gpu_count=4)
    fits = RuntimeConfig(devices="cuda", slot_sizes=[2, 1])
    if dist.is_nccl_available():
        check_slots(fits, [2, 1], gpu_count=4)
    else:  # a CPU build of torch: the devices fit, the collective backend is missing
        with pytest.raises(PlacementError, match=r"runtime.slot_sizes=\[2, 1\]: a slot of 2 "
                           "ranks needs the torch.distributed nccl backend"):
            check_slots(fits, [2, 1], gpu_count=4)


def test_more_cpu_processes_than_four_per_cpu_are_refused():
    rt = RuntimeConfig(devices="cpu", train_workers=3, slot_size=3)
    with pytest.raises(PlacementError, match=r"9 CPU training processes, more than 4 x the 2 "
                       r"CPUs of this machine \(8\)"):
        check_slots(rt, [3, 3, 3], cpu_count=2)
    check_slots(rt, [3, 3, 3], cpu_count=3)


def test_each_rank_of_a_slot_sees_its_own_gpu():
    rt = RuntimeConfig(devices="cuda", train_devices=[1, 2, 3], rollout_devices=[0],
                       slot_sizes=[2, 2])
    at = slot_placements(rt, [2, 2], gpu_count=4)
    assert at == [[Placement("cuda", (1,)), Placement("cuda", (2,))],
                  [Placement("cuda", (3,)), Placement("cuda", (1,))]]
    assert slot_placements(RuntimeConfig(devices="cpu"), [2], gpu_count=0) == [
        [Placement("cpu"), Placement("cpu")]]


def test_every_llm_algorithm_and_lora_is_accepted_on_sharded_slots():
    """PPO (a critic), a KL reference, several passes and LoRA adapters all shard (tests in
    tests/training/test_sharded_algorithms.py and test_sharded_lora.py)."""
    cfg = load_config(RELAY, ["runtime.slot_size=2", "agents.relay.algorithm={name: ppo, "
                              "critic: separate, epochs: 2}",
                              "agents.speaker.algorithm.kl_coef=0.1",
                              "agents.listener.lora={r: 2}"])
    assert cfg.runtime.train_slot_sizes() == [2] * cfg.runtime.train_workers


def test_the_cli_refuses_too_many_cpu_processes_and_writes_nothing(tmp_path):
    k = 4 * (os.cpu_count() or 1) + 1
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flexmarl", "train", str(RELAY), "--set",
                           "runtime.devices=cpu", "--set", f"runtime.slot_size={k}",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"runtime.train_workers=1 x runtime.slot_size={k}: {k} CPU training processes" \
        in proc.stderr
    assert not out.exists()
