"""Build an agent's causal LM: a small random Llama from config, or a model from a local path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from flexmarl.config.schema import ModelConfig
from flexmarl.errors import UserError


class ModelLoadError(UserError, ValueError):
    """The agent's model could not be built or loaded; names the agent and the field."""


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, stable across processes and Python hash seeds."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def build_model(
    agent: str, cfg: ModelConfig, vocab_size: int, max_seq_len: int, run_seed: int
) -> PreTrainedModel:
    """Same agent, config and seed give the same initial weights in every process."""
    if cfg.kind == "path":
        path = Path(cfg.path or "")
        if not path.exists():
            raise ModelLoadError(f"agent {agent!r}: model.path {str(path)!r} does not exist")
        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"agent {agent!r}: cannot load model.path {path}: {exc}") from exc
    else:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_heads,
            max_position_embeddings=max(max_seq_len, 16),
            attention_dropout=0.0,
            tie_word_embeddings=False,
            initializer_range=cfg.init_std,
        )
        seed = cfg.init_seed if cfg.init_seed is not None else stable_seed(run_seed, agent)
        fork = torch.random.fork_rng(devices=[])
        with fork:
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    model.eval()
    return model


def approx_params(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of a Llama-shaped model, from the config alone (no weights loaded): the
    per-token cost the rollout balancer weighs demand by (about 2 FLOPs per parameter)."""
    hidden, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, vocab_size
    if cfg.kind == "path" and cfg.path:
        config_file = Path(cfg.path) / "config.json"
        if config_file.exists():
            import json

            c = json.loads(config_file.read_text())
            hidden = c.get("hidden_size", hidden)
            inter = c.get("intermediate_size", inter)
            layers = c.get("num_hidden_layers", layers)
            vocab = c.get("vocab_size", vocab)
    return layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the trainable weights, the unit of weight publication."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
