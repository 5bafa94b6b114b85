"""A saved agent folder loads as it is with transformers and peft: weights (LoRA merged), the
tokenizer and chat template, and a LoRA agent's adapter alone in PEFT's format."""

import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexmarl.config.schema import AgentConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.tokenizer import BYTE_CHAT_TEMPLATE, BYTE_VOCAB, byte_tokenizer
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Sample
from tests.smollm import requires_smollm

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
         "init_std": 0.2}


def _trained(vocab: int, lora: bool) -> AgentTrainer:
    raw = {"model": MODEL, "optim": {"lr": 0.05}}
    if lora:
        raw["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    trainer = AgentTrainer("a", AgentConfig.model_validate(raw), vocab, 32, run_seed=0)
    trainer.accumulate([Sample(f"0-{i}_0_0", [1, 5 + i, 9], [20 + i, 7], [-3.0, -3.0],
                               1.0 - 2 * (i % 2), None, 1.0, 0) for i in range(8)])
    trainer.step()
    return trainer


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def test_a_lora_agent_folder_loads_with_transformers_and_peft(tmp_path):
    trainer = _trained(BYTE_VOCAB, lora=True)
    folder = trainer.save(tmp_path / "a")
    meta = json.loads((folder / "flexmarl.json").read_text())
    assert meta == {"agent": "a", "policy_version": 1, "base_model": "flexmarl-random:a",
                    "lora": True, "tokenizer": True}
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == BYTE_CHAT_TEMPLATE
    assert tok.encode("hi there") == byte_tokenizer().encode("hi there")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text)])
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.allclose(_logits(merged, ids), _logits(trainer.model, ids), atol=1e-5)
    adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "flexmarl-random:a"
    assert not (folder / "adapter" / "model.safetensors").exists()  # the adapter alone
    base = build_model("a", trainer.cfg.model, BYTE_VOCAB, 32, run_seed=0)
    before = _logits(base, ids)
    peft = PeftModel.from_pretrained(base, folder / "adapter")
    after = _logits(peft, ids)
    assert torch.allclose(after, _logits(merged, ids), atol=1e-5)
    assert float((after - before).abs().max()) > 1e-4  # the adapter was trained


def test_a_token_level_agent_folder_has_no_tokenizer(tmp_path):
    folder = _trained(32, lora=False).save(tmp_path / "a")
    assert json.loads((folder / "flexmarl.json").read_text())["tokenizer"] is False
    assert not (folder / "tokenizer.json").exists() and not (folder / "adapter").exists()
    assert AutoModelForCausalLM.from_pretrained(folder).config.vocab_size == 32


@requires_smollm
def test_a_smollm2_lora_folder_loads_with_its_tokenizer(tmp_path):
    from flexmarl.policy.smollm import ensure_cache

    raw = {"model": {"kind": "smollm2"}, "lora": {"r": 4, "alpha": 8,
                                                  "target_modules": ["q_proj", "v_proj"]}}
    trainer = AgentTrainer("a", AgentConfig.model_validate(raw), 49152, 64, run_seed=0)
    folder = trainer.save(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and len(tok) == 49152
    base = AutoModelForCausalLM.from_pretrained(str(ensure_cache()))
    peft = PeftModel.from_pretrained(base, folder / "adapter")
    ids = torch.tensor([tok.encode("Compute 2 + 3.")])
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.allclose(_logits(peft, ids), _logits(merged, ids), atol=1e-4)


def test_loading_a_model_folder_draws_no_progress_bar(tmp_path, capfd):
    from flexmarl.config.schema import ModelConfig

    folder = _trained(32, lora=False).save(tmp_path / "a")
    capfd.readouterr()
    AutoModelForCausalLM.from_pretrained(folder)  # transformers on its own draws one
    assert "Loading weights" in capfd.readouterr().err
    build_model("a", ModelConfig(kind="path", path=str(folder)), 32, 32, run_seed=0)
    assert "Loading weights" not in capfd.readouterr().err
