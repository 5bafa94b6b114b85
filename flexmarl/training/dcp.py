"""A trainer's weights and AdamW state as a `torch.distributed.checkpoint` folder: written by
the K ranks of a sharded slot (each its shard) or by one process, and read at any K (resharded
on read). Restart points and checkpoints of sharded agents use it, so a state written at K=2
resumes at K=1 and the reverse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

Names = Callable[[str], str | None]


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`get_state_dict` of model and optimizer, trained parameters only (a LoRA agent's
    frozen base is rebuilt from its config, not saved). An optimizer that has not stepped yet
    gets its state initialised by it through a step with zero gradients, which counts one
    step: the counters are set back to 0, so the first real step is the first (AdamW's bias
    correction), exactly as in an optimizer that was never touched."""
    fresh = not optimizer.state
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if fresh:
        for slots in optimizer.state.values():
            step = slots.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return model_sd, optim_sd


def _renamed(model_sd: dict[str, Any], optim_sd: dict[str, Any], names: Names
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts under `names(key)` (None: left out), optimizer entries included."""
    model_out = {n: v for k, v in model_sd.items() if (n := names(k)) is not None}
    state = {n: v for k, v in optim_sd["state"].items() if (n := names(k)) is not None}
    groups = [{**g, "params": [n for k in g["params"] if (n := names(k)) is not None]}
              for g in optim_sd["param_groups"]]
    return model_out, {"state": state, "param_groups": groups}


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int,
         directory: str | Path, group: Any = None, names: Names | None = None) -> None:
    """Write weights, optimizer state and the version (collective over `group` when there is
    a process group: each rank writes its shard). `names`: the key each entry is saved under
    (None: not saved), e.g. one agent's adapter of a shared policy under one-device names."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    if names is not None:
        model_sd, optim_sd = _renamed(model_sd, optim_sd, names)
    dcp.save({"model": model_sd, "optim": optim_sd, "version": torch.tensor(version)},
             checkpoint_id=str(directory),
             process_group=group if dist.is_initialized() else None)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
         group: Any = None, names: Names | None = None) -> int:
    """Read what `save` wrote, at any number of ranks (with the same `names`); returns the
    version."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    back: dict[str, str] = {}
    if names is not None:
        back = {n: k for k in [*model_sd, *optim_sd["state"]] if (n := names(k)) is not None}
        model_sd, optim_sd = _renamed(model_sd, optim_sd, names)
    # a parameter that never had a gradient (a separate critic's unused lm_head) has no AdamW
    # state in the checkpoint: it gets none here either
    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    optim_sd["state"] = {
        fqn: kept for fqn, slots in optim_sd["state"].items()
        if (kept := {k: v for k, v in slots.items() if f"optim.state.{fqn}.{k}" in stored})}
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "version": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(directory),
             process_group=group if dist.is_initialized() else None)
    model_sd, optim_sd = state["model"], state["optim"]
    if names is not None:
        model_sd, optim_sd = _renamed(model_sd, optim_sd, back.__getitem__)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False, ignore_frozen_params=True))
    optimizer.zero_grad(set_to_none=True)
    return int(state["version"])
