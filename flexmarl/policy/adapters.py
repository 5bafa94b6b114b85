"""Agents that share one base model, each with its own LoRA adapter (`models:` + `model.base`).

A rollout replica holds the base once with every agent's adapter in one peft model, and one
continuous batch mixes requests of different agents (peft's per-row `adapter_names`); a
training slot holds the base once and gives each agent's trainer a module tree whose frozen
tensors *are* the base's (no copy), so a swap moves only the adapter and its optimizer state.
Weight publication of such an agent is its adapter alone (`adapter_tensors` /
`load_adapter`), under names that do not depend on the adapter's name in either model.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.nn.functional as F

from flexmarl.config.schema import LoraConfig, RunConfig
from flexmarl.policy.model import build_model, stable_seed
from flexmarl.policy.quiet import quiet_peft_wrap

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch (a frozen base agent)
_PEFT_DEFAULT = "default"


def adapter_name(agent: str) -> str:
    """The agent's adapter in a replica's peft model (never a substring of peft's `lora_`)."""
    return f"agent_{agent}"


def engine_groups(cfg: RunConfig, agents: list[str]) -> dict[str, list[str]]:
    """Which agents share one model: `base:NAME` for agents on a shared base (served by one
    engine), the agent's own name for every other agent. Order follows `agents`."""
    groups: dict[str, list[str]] = {}
    for agent in agents:
        base = cfg.agents[agent].model.base
        groups.setdefault(f"base:{base}" if base else agent, []).append(agent)
    return groups


def peft_config(cfg: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig  # optional: peft (the lora extra)

    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha,  # type: ignore[arg-type]
                          lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                          bias="none")


def add_adapter(model: torch.nn.Module, name: str, cfg: LoraConfig, seed: int) -> Any:
    """Wrap `model` in peft with adapter `name` (or add `name` to a peft model already). The
    adapter's initial values are drawn from `seed` alone, so a replica and every training slot
    start each agent with the same adapter whatever the order agents were built in."""
    from peft import PeftModel, get_peft_model  # optional: peft (the lora extra)

    with torch.random.fork_rng(devices=[]), quiet_peft_wrap():
        torch.manual_seed(seed)
        if isinstance(model, PeftModel):
            model.add_adapter(name, peft_config(cfg))
            return model
        return get_peft_model(model, peft_config(cfg), adapter_name=name)  # type: ignore[arg-type]


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer  # optional: peft (the lora extra)

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def adapter_tensors(model: torch.nn.Module, adapter: str = _PEFT_DEFAULT
                    ) -> dict[str, torch.Tensor]:
    """An adapter's weights (A and B of every adapted layer), as detached CPU copies named
    `<layer>.lora_A` / `<layer>.lora_B`: what an adapter agent publishes."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(model):
        if adapter in layer.lora_A:
            out[f"{name}.lora_A"] = layer.lora_A[adapter].weight.detach().to("cpu", copy=True)
            out[f"{name}.lora_B"] = layer.lora_B[adapter].weight.detach().to("cpu", copy=True)
    return out


def load_adapter(model: torch.nn.Module, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
    """Copy published adapter weights into `adapter` of `model`, in place (cast to the layer's
    dtype and device). Every adapted layer must be given, and nothing else."""
    expected = set()
    with torch.no_grad():
        for name, layer in _lora_layers(model):
            if adapter not in layer.lora_A:
                continue
            for part, modules in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                key = f"{name}.{part}"
                expected.add(key)
                if key not in tensors:
                    raise ValueError(f"adapter {adapter!r}: published weights lack {key!r}")
                weight = modules[adapter].weight
                weight.copy_(tensors[key].to(device=weight.device, dtype=weight.dtype))
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ValueError(f"adapter {adapter!r}: published weights name layers the adapter "
                         f"does not have: {extra[:3]}")


def share_base(model: torch.nn.Module) -> torch.nn.Module:
    """A new module tree over the *same* parameter and buffer tensors as `model` (no copy):
    each adapter agent's trainer wraps its own tree in peft, all of them one base in memory."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def resident_bytes(*objects: Any) -> int:
    """Bytes of the distinct tensor storages reachable from modules, optimizers and tensors
    (a tensor shared by two modules counts once): what a replica or slot really holds."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for t in itertools.chain(obj.parameters(), obj.buffers()):
                add(t)
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    add(t.grad)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        add(v)
        elif isinstance(obj, torch.Tensor):
            add(obj)
    return total


def build_replica_model(cfg: RunConfig, agents: list[str], vocab_size: int, max_seq_len: int,
                        device: str | torch.device, dtype: torch.dtype
                        ) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """One base (the agents' shared `model.base`) with an adapter per agent that has `lora`,
    for a rollout replica; the adapter of each agent (`BASE_ADAPTER` for none); its memory:
    the base's bytes and the bytes each agent added."""

    first = cfg.agents[agents[0]].model
    base = build_model(f"models.{first.base}", first, vocab_size, max_seq_len, cfg.seed,
                       device, dtype)
    base_bytes = resident_bytes(base)
    model: Any = base
    added: dict[str, int] = {}
    names: dict[str, str] = {}
    for agent in agents:
        lcfg = cfg.agents[agent].lora
        before = resident_bytes(model)
        names[agent] = BASE_ADAPTER
        if lcfg is not None:
            names[agent] = adapter_name(agent)
            model = add_adapter(model, names[agent], lcfg, stable_seed(cfg.seed, agent, "lora"))
            model.to(device=device, dtype=dtype)
        added[agent] = resident_bytes(model) - before
    model.eval()
    return model, names, {"base_bytes": base_bytes, "agent_bytes": added}


class StackedLoRA:
    """Batched LoRA over many adapters for a replica's mixed batches (S-LoRA's / punica's
    gathered matmuls): per adapted layer, every adapter's A and scaled B are stacked
    ([K+1, r, in], [K+1, out, r], slot 0 all zeros: the bare base), and each forward gathers
    the rows' adapters and adds `(x @ A_row^T) @ (scale B_row)^T` with two batched matmuls,
    whatever the number of adapters in the batch (peft's mixed forward loops over them: 0.33x
    a single-agent batch with 8 adapters on a small model). A batch of one adapter's rows
    takes two plain matmuls.

    Adapters of lower rank, or that do not adapt a layer, are zero-padded there, which adds
    exact zeros. peft's own weights stay the storage; `refresh(name)` re-reads one adapter."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.slot = {name: i + 1 for i, name in enumerate(names)}
        self.rows: torch.Tensor | None = None  # the slot of each row of the current forward
        self.only: int | None = None  # the one slot of every row, when they share it
        self.layers: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for _, layer in _lora_layers(model):
            present = [n for n in names if n in layer.lora_A]
            if not present:
                continue
            weight = layer.get_base_layer().weight
            rank = max(layer.r[n] for n in present)
            k = len(names) + 1
            a = torch.zeros(k, rank, layer.in_features, dtype=weight.dtype, device=weight.device)
            b = torch.zeros(k, layer.out_features, rank, dtype=weight.dtype, device=weight.device)
            self.layers.append((layer, a, b))
            layer.forward = self._forward_of(layer, a, b)  # this replica's model only
        for name in names:
            self.refresh(name)

    def use_rows(self, rows: torch.Tensor | None, only: int | None) -> None:
        """`rows`: the slot of each row, already on the device (an engine keeps it with its
        batch, so a decode step copies nothing from the host); `only`: their one slot, if
        they share it."""
        if rows is None:
            raise RuntimeError("a stacked-LoRA forward needs the slots of its rows")
        self.rows, self.only = rows, only

    def clear(self) -> None:
        self.rows, self.only = None, None

    def refresh(self, name: str) -> None:
        i = self.slot[name]
        with torch.no_grad():
            for layer, a, b in self.layers:
                if name not in layer.lora_A:
                    continue
                r = layer.r[name]
                a[i, :r].copy_(layer.lora_A[name].weight)
                b[i, :, :r].copy_(layer.lora_B[name].weight * layer.scaling[name])

    def _forward_of(self, layer: Any, a: torch.Tensor, b: torch.Tensor):
        base = layer.get_base_layer()

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = base(x, *args, **kwargs)
            rows, only = self.rows, self.only
            if rows is None:
                raise RuntimeError("a stacked-LoRA layer called outside a batch's forward")
            if only == 0:  # bare-base rows only
                return result
            x = x.to(a.dtype)
            if only is not None:
                delta = F.linear(F.linear(x, a[only]), b[only])
            else:
                h = torch.bmm(x, a[rows].transpose(1, 2))  # [B, T, r]
                delta = torch.bmm(h, b[rows].transpose(1, 2))
            return result + delta.to(result.dtype)

        return forward
