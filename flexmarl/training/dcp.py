"""A trainer's weights and AdamW state as a `torch.distributed.checkpoint` folder: written by
the K ranks of a sharded slot (each its shard) or by one process, and read at any K (resharded
on read). Restart points and checkpoints of sharded agents use it, so a state written at K=2
resumes at K=1 and the reverse."""

from __future__ import annotations

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


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`get_state_dict` of model and optimizer. An optimizer that has not stepped yet gets its
    state initialised by it through a step with zero gradients, which counts one step: the
    counters are set back to 0, so the first real step is the first (AdamW's bias correction),
    exactly as in an optimizer that was never touched."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:
        for slots in optimizer.state.values():
            step = slots.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
        model_sd, optim_sd = get_state_dict(model, optimizer)
    return model_sd, optim_sd


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, version: int,
         directory: str | Path, group: Any = None) -> None:
    """Write weights, optimizer state and the version (collective over `group` when there is
    a process group: each rank writes its shard)."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "version": torch.tensor(version)},
             checkpoint_id=str(directory),
             process_group=group if dist.is_initialized() else None)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
         group: Any = None) -> int:
    """Read what `save` wrote, at any number of ranks; returns the version."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "version": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(directory),
             process_group=group if dist.is_initialized() else None)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
    optimizer.zero_grad(set_to_none=True)
    return int(state["version"])
