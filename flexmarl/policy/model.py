"""Build an agent's causal LM: a small random Llama from config, or a model from a local path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from flexmarl.config.schema import ModelConfig
from flexmarl.errors import UserError
from flexmarl.policy.quiet import quiet_loading
from flexmarl.policy.smollm import ensure_cache


class ModelLoadError(UserError, ValueError):
    """The agent's model could not be built or loaded; names the agent and the field."""


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, stable across processes and Python hash seeds."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _resolve(cfg: ModelConfig) -> ModelConfig:
    """`smollm2` is a `path` model whose path is the converted cache."""
    if cfg.kind != "smollm2":
        return cfg

    return cfg.model_copy(update={"kind": "path", "path": str(ensure_cache()), "gguf_file": None})


def _llama_config(cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> LlamaConfig:
    return LlamaConfig(
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


def _from_path(agent: str, cfg: ModelConfig, loader: Any) -> Any:
    """`loader(model.path, gguf_file=...)` (a model or its config), or a ModelLoadError naming
    the agent and the field."""
    path = Path(cfg.path or "")
    if not path.exists():
        raise ModelLoadError(f"agent {agent!r}: model.path {str(path)!r} does not exist")
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    try:
        with quiet_loading():
            return loader(str(path), **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"agent {agent!r}: cannot load model.path {path}: {exc}") from exc
    except StrictDataclassError as exc:  # a field of the folder's config.json (transformers)
        raise ModelLoadError(f"agent {agent!r}: model.path {path / 'config.json'}: "
                             f"{' '.join(str(exc).split())}") from exc


def build_model(
    agent: str, cfg: ModelConfig, vocab_size: int, max_seq_len: int, run_seed: int,
    device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Same agent, config and seed give the same initial weights in every process, on every
    device: random weights are drawn on the CPU in float32, then moved and cast.

    `dtype` None keeps float32 (a trainer's master weights); replicas pass the compute dtype."""
    cfg = _resolve(cfg)
    if cfg.kind == "path":
        # loaded as float32 whatever the checkpoint holds (bf16, fp16); cast below
        model = _from_path(agent, cfg, lambda path, **kw: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **kw))
    else:
        config = _llama_config(cfg, vocab_size, max_seq_len)
        # a shared base (`model.base`) is one model whichever agent builds it
        owner = f"models.{cfg.base}" if cfg.base else agent
        seed = cfg.init_seed if cfg.init_seed is not None else stable_seed(run_seed, owner)
        fork = torch.random.fork_rng(devices=[])
        with fork:
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    if cfg.checkpoint:
        tensors = load_file(str(_checkpoint_file(agent, cfg.checkpoint)))
        check_shapes(agent, cfg.checkpoint, {k: tuple(v.shape) for k, v in tensors.items()}, model)
        model.load_state_dict(tensors, strict=False)
    model.to(device=torch.device(device), dtype=dtype or torch.float32)
    model.eval()
    return model


def approx_params(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of a Llama-shaped model, from the config alone (no weights loaded): the
    per-token cost the rollout balancer weighs demand by (about 2 FLOPs per parameter)."""
    if cfg.kind == "smollm2":  # SmolLM2-135M, without converting the GGUF just to count
        return 30 * (4 * 576 * 576 + 3 * 576 * 1536) + 49152 * 576
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    vocab = vocab_size
    if cfg.kind == "path" and cfg.path:
        config_file = Path(cfg.path) / "config.json"
        if config_file.exists():
            c = json.loads(config_file.read_text())
            hidden = c.get("hidden_size", hidden)
            inter = c.get("intermediate_size", inter)
            layers = c.get("num_hidden_layers", layers)
            vocab = c.get("vocab_size", vocab)
    return layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden


def skeleton(agent: str, cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> PreTrainedModel:
    """The agent's model on the meta device: module names and shapes, no memory, no weights.

    Used to check a config (LoRA targets, checkpoint shapes) before any worker starts."""
    cfg = _resolve(cfg)
    if cfg.kind == "path":
        config = _from_path(agent, cfg, AutoConfig.from_pretrained)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        return LlamaForCausalLM(_llama_config(cfg, vocab_size, max_seq_len))


def _checkpoint_file(agent: str, checkpoint: str) -> Path:
    path = Path(checkpoint)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"agent {agent!r}: model.checkpoint {checkpoint!r}: no such file")
    return path


def checkpoint_shapes(agent: str, checkpoint: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a safetensors checkpoint, read from its header only."""
    path = _checkpoint_file(agent, checkpoint)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's
        raise ModelLoadError(
            f"agent {agent!r}: model.checkpoint {checkpoint!r} is not a safetensors file: {exc}"
        ) from exc


def check_shapes(
    agent: str, checkpoint: str, shapes: dict[str, tuple[int, ...]], model: torch.nn.Module
) -> None:
    """Every model tensor must be in the checkpoint with the same shape; name the first that
    is not, with both shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelLoadError(
                f"agent {agent!r}: model.checkpoint {checkpoint!r} has no tensor {name!r} "
                f"that the configured model needs"
            )
        if shapes[name] != shape:
            raise ModelLoadError(
                f"agent {agent!r}: model.checkpoint {checkpoint!r}: tensor {name!r} has shape "
                f"{list(shapes[name])}, the configured model (agents.{agent}.model) expects "
                f"{list(shape)}"
            )


def weights_of(model: torch.nn.Module, dtype: torch.dtype | None = None
               ) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the weights, the unit of weight publication; `dtype` casts
    floating-point tensors (a replica computing in bf16 needs half the bytes of fp32 masters)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.to("cpu", copy=True).contiguous()
    return out
