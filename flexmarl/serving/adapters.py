"""Served LoRA adapters: an agent with `lora` is served unmerged, as its base model (held once)
plus adapters, through the rollout engine's stacked adapters (`policy.adapters.StackedLoRA`,
the path a training replica's shared base takes), so a new version is a new adapter (a few
hundred kilobytes) and a swap costs milliseconds instead of a copy of the whole model.

The served model of such an agent is one peft model with the shadow's adapter (`agent_<name>`)
and, with tenants that train, one adapter per training tenant (`tenant_<i>`): each tenant's
requests decode through its own adapter in the same continuous batch as everyone else's.
Versions are built with `light_copy`: a new module tree whose base tensors *are* the served
model's (no copy) and whose adapter tensors are its own.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flexmarl.policy.adapters import adapter_tensors, load_adapter
from flexmarl.serving.compress import is_packed, unpack

ADAPTER_FILE = "adapter.safetensors"  # a served (or published) adapter, our tensor names
PEFT_ADAPTER_FILE = "adapter_model.safetensors"  # what `AgentTrainer.save` writes (PEFT's)


def tenant_adapter(index: int) -> str:
    """The adapter name of the `index`-th training tenant (tenant names may hold characters a
    module name cannot)."""
    return f"tenant_{index}"


def is_lora_tensor(name: str) -> bool:
    return ".lora_A" in name or ".lora_B" in name


def light_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A new module tree over the same base tensors as `model`, with copies of its LoRA
    tensors: a version that differs only in its adapters costs the adapters' bytes.

    Module by module, shallow (`copy.copy`, new child, parameter and buffer tables): a deep
    copy of a 30-layer model's tree with a memo of its tensors takes ~100x longer."""
    copies: dict[int, torch.nn.Module] = {}

    def copy_of(module: torch.nn.Module, lora: bool) -> torch.nn.Module:
        if id(module) in copies:  # a module reachable twice stays one module
            return copies[id(module)]
        new = copy.copy(module)
        copies[id(module)] = new
        new._modules = {k: None if c is None else copy_of(c, lora or k in _LORA_DICTS)
                        for k, c in module._modules.items()}
        new._parameters = {k: None if p is None else (
            torch.nn.Parameter(p.detach().clone(), p.requires_grad) if lora else p)
            for k, p in module._parameters.items()}
        new._buffers = dict(module._buffers)
        return new

    return copy_of(model, False)


_LORA_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def with_adapter(model: torch.nn.Module, adapter: str, tensors: dict[str, torch.Tensor]
                 ) -> torch.nn.Module:
    """A light copy of `model` whose adapter `adapter` holds `tensors`."""
    out = light_copy(model)
    load_adapter(out, adapter, tensors)
    return out.eval()


def view(model: torch.nn.Module, adapter: str) -> torch.nn.Module:
    """A light copy of `model` that computes with `adapter` active (a tenant's policy), for
    scoring and as a KL reference; `model` itself is left as it is."""
    out: Any = light_copy(model)
    out.set_adapter(adapter)
    return out.eval()


def read_adapter_file(path: Path) -> dict[str, torch.Tensor]:
    """Adapter tensors from a published file: packed (`compress.pack`), ours (`<layer>.lora_A`)
    or PEFT's (`<layer>.lora_A.weight`, adapter name left out)."""
    tensors = unpack(path.read_bytes()) if is_packed(path) else load_file(str(path))
    out = {k.removesuffix(".weight"): v for k, v in tensors.items()}
    if not out or not all(is_lora_tensor(k) for k in out):
        other = next((k for k in out if not is_lora_tensor(k)), None)
        raise ValueError(f"{path}: not an adapter (it holds {other!r}, not only LoRA A and B "
                         "tensors)")
    return out


def is_adapter_file(path: Path) -> bool:
    """Does the published weights file hold an adapter alone (rather than full weights)?"""
    try:
        if is_packed(path):
            names = list(unpack(path.read_bytes()))
        else:
            with safe_open(str(path), "pt") as f:
                names = list(f.keys())
    except Exception:  # noqa: BLE001 - unreadable: the full-weights loader says why
        return False
    return bool(names) and all(is_lora_tensor(k) for k in names)


def save_adapter(folder: Path, model: torch.nn.Module, adapter: str) -> Path:
    """Write `adapter` of `model` to `folder/adapter.safetensors` (atomically: aside, then
    renamed); returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in adapter_tensors(model, adapter).items()}
    tmp = folder / (ADAPTER_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / ADAPTER_FILE)
    return folder / ADAPTER_FILE
