"""LoRA through peft: target validation (one clear error), wrapping, and merged publication.

An agent with its own model: the rollout replicas keep plain models, and after each step the
trainer publishes only the tensors LoRA changes, merged (W + scale * B @ A) under the base
model's names. An agent on a shared base (`model.base`) publishes its adapter alone
(`policy.adapters`): the replica holds the base once and every agent's adapter.
"""

from __future__ import annotations

from typing import Any

import torch

from flexmarl.config.schema import LoraConfig
from flexmarl.errors import UserError
from flexmarl.policy.adapters import add_adapter


class LoraTargetError(UserError, ValueError):
    """A LoRA target module that the agent's model does not have."""


def check_targets(agent: str, model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Each target must name linear layers of the model (by their last name component)."""
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    for target in cfg.target_modules:
        if target not in linear:
            raise LoraTargetError(
                f"agent {agent!r}: lora.target_modules: {target!r} matches no linear layer of "
                f"the model (it has: {', '.join(linear)})"
            )


def apply(agent: str, model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """`model` wrapped in peft with one adapter, initialised from `seed` alone (the same adapter
    in every process, whatever was built before it)."""

    check_targets(agent, model, cfg)
    return add_adapter(model, "default", cfg, seed)


def merged_weights(model: torch.nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
    """Base-model-named weights with the adapters merged in, without touching `model`.

    `full=False`: only the adapted layers' weights (what changes between versions)."""
    from peft.tuners.lora import LoraLayer  # optional: peft (the lora extra)

    out: dict[str, torch.Tensor] = {}
    prefix = "base_model.model."
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
            layer: Any = module  # a peft LoRA Linear: base_layer and get_delta_weight
            base = layer.base_layer.weight.detach()
            delta = layer.get_delta_weight(layer.active_adapters[0]).detach()
            key = name[len(prefix):] if name.startswith(prefix) else name
            out[f"{key}.weight"] = (base + delta).to("cpu", copy=True).contiguous()
    if full:
        for key, value in model.state_dict().items():
            if "lora_" in key:
                continue
            key = key[len(prefix):] if key.startswith(prefix) else key
            key = key.replace(".base_layer.", ".")
            out.setdefault(key, value.detach().to("cpu", copy=True).contiguous())
    return out
