"""Location-agnostic training states: one call, `move(handle, to)`, whatever the source and the
destination: device memory, host memory, another process (torch.distributed: gloo on CPUs,
NCCL on GPUs) or disk (safetensors).

A `TrainingState` is named tensors plus JSON-able metadata. `capture(trainer)` /
`restore(trainer, state)` turn an `AgentTrainer` into one and back *exactly*: weights (policy,
value head, critic), AdamW state, accumulated gradients, the step's bookkeeping (rows, sample
ids, metric sums) and the torch RNG. The training pool swaps agents in and out of its slots with
them; weight publication sends `weights` states the same way.

Moving to another process is a send on one side and, on the other, moving the handle that
`incoming(Process(src))` returns: both sides make the same `move` call.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flexmarl.types import Sample

if TYPE_CHECKING:
    from flexmarl.training.trainer import AgentTrainer


@dataclass
class TrainingState:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# --- locations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """Accelerator (or CPU) memory of this process: `cuda:0`, `cpu`."""

    device: str = "cpu"


@dataclass(frozen=True)
class Host:
    """Host memory of this process; `pin` uses page-locked memory (faster device copies)."""

    pin: bool = False


@dataclass(frozen=True)
class Disk:
    """A safetensors file (metadata in its header)."""

    path: str


@dataclass(frozen=True)
class Process:
    """Another process of the torch.distributed group: `rank` to send to / receive from; in
    `group` (a process group object, such as the local runtime's two-process publication
    groups) or, None, the default group. A state goes from and lands in device memory when the
    group's backend is NCCL (device to device, no host copy), host memory otherwise."""

    rank: int
    group: Any = field(default=None, compare=False)


Location = Device | Host | Disk | Process


@dataclass
class StateHandle:
    """Where a state is. In-memory handles hold it; disk handles hold a path; a handle at a
    `Process` location is the receiving end of a transfer that has not been taken yet."""

    location: Location
    state: TrainingState | None = None

    def load(self) -> TrainingState:
        """The state in this process's memory (reads the file / receives, where needed)."""
        if self.state is not None:
            return self.state
        if isinstance(self.location, Disk):
            return _read_disk(self.location.path)
        if isinstance(self.location, Process):
            return _recv(self.location.rank, self.location.group)
        raise ValueError(f"empty state handle at {self.location}")


def at(state: TrainingState, location: Location | None = None) -> StateHandle:
    """A handle to a state already in this process's memory."""
    return StateHandle(location or Host(), state)


def incoming(source: Process) -> StateHandle:
    """The receiving end of `move(..., Process(this rank))` on `source`'s side."""
    return StateHandle(source, None)


def move(handle: StateHandle | TrainingState, to: Location) -> StateHandle:
    """Move (copy) a state to `to` and return the handle there. Same call for every pair."""
    if isinstance(handle, TrainingState):
        handle = at(handle)
    state = handle.load()
    if isinstance(to, Device):
        return StateHandle(to, _to(state, torch.device(to.device)))
    if isinstance(to, Host):
        if to.pin and torch.cuda.is_available():
            return StateHandle(to, _to_pinned(state))
        return StateHandle(to, _to(state, torch.device("cpu")))
    if isinstance(to, Disk):
        _write_disk(state, to.path)
        return StateHandle(to, None)
    if isinstance(to, Process):
        _send(state, to.rank, to.group)
        return StateHandle(to, None)
    raise TypeError(f"unknown location {to!r}")


def _to(state: TrainingState, device: torch.device) -> TrainingState:
    return TrainingState(
        {k: v.detach().to(device, copy=True) for k, v in state.tensors.items()},
        json.loads(json.dumps(state.meta)),
    )


def _to_pinned(state: TrainingState) -> TrainingState:
    """Device -> page-locked host copies, queued asynchronously and awaited once (a pageable
    copy followed by `pin_memory()` would copy twice and lock pages on the critical path)."""
    out = {}
    for k, v in state.tensors.items():
        dst = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=True)
        out[k] = dst.copy_(v.detach(), non_blocking=True)
    torch.cuda.synchronize()
    return TrainingState(out, json.loads(json.dumps(state.meta)))


# --- disk -----------------------------------------------------------------------------------
def _write_disk(state: TrainingState, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.tensors.items()}
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata={"flexmarl": json.dumps(state.meta)})
    Path(tmp).replace(path)


def _read_disk(path: str) -> TrainingState:

    with safe_open(path, framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("flexmarl", "{}"))
    return TrainingState(load_file(path), meta)


# --- wire format: flat bytes + a JSON header (process transfers, pipes) ---------------------
def _header(state: TrainingState) -> dict[str, Any]:
    return {"meta": state.meta,
            "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)]
                        for k, v in state.tensors.items()]}


def _flat(state: TrainingState, device: torch.device | None = None) -> torch.Tensor:
    """One uint8 buffer of every tensor's bytes, on `device` (default: the CPU); tensors
    already there are not copied through the host."""
    dev = device or torch.device("cpu")
    parts = [v.detach().to(dev).contiguous().reshape(-1).view(torch.uint8)
             for v in state.tensors.values()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=dev)


def _unflat(header: dict[str, Any], buf: torch.Tensor) -> TrainingState:
    tensors, offset = {}, 0
    for name, dtype, shape in header["tensors"]:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        tensors[name] = buf[offset:offset + n].clone().view(dt).reshape(shape)
        offset += n
    return TrainingState(tensors, header["meta"])


def to_wire(state: TrainingState) -> tuple[bytes, np.ndarray]:
    """(JSON header, one uint8 array): picklable without shared memory, any dtype."""
    return json.dumps(_header(state)).encode(), _flat(state).numpy()


def from_wire(wire: tuple[bytes, np.ndarray]) -> TrainingState:
    header, buf = wire
    return _unflat(json.loads(header), torch.from_numpy(np.array(buf, copy=True)))


def swap_out(state: TrainingState, swap_dir: str | None, name: str) -> tuple[str, Any]:
    """A swapped-out state in the form a training slot hands back to the driver: a file in
    `swap_dir` (`("disk", path)`) or, without one, its wire bytes (`("host", wire)`)."""
    if swap_dir is not None:
        path = f"{swap_dir}/{name}.safetensors"
        move(state, Disk(path))
        return ("disk", path)
    return ("host", to_wire(state))


def swap_in(form: tuple[str, Any]) -> TrainingState:
    """The state of a `swap_out` form, wherever it was parked."""
    kind, payload = form
    handle = StateHandle(Disk(payload)) if kind == "disk" else at(from_wire(payload))
    return handle.load()


def comm_device(group: Any = None) -> torch.device:
    """Where a collective's or transfer's buffers live: the current GPU for NCCL, else host
    memory."""
    backend = group.name() if group is not None else dist.get_backend()
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _p2p(op: str, tensor: torch.Tensor, rank: int, group: Any) -> None:

    if group is None:
        (dist.send if op == "send" else dist.recv)(tensor, rank)
    else:
        (group.send if op == "send" else group.recv)([tensor], rank, 0).wait()


def _send(state: TrainingState, rank: int, group: Any = None) -> None:
    dev = comm_device(group)
    header = torch.frombuffer(bytearray(json.dumps(_header(state)).encode()), dtype=torch.uint8)
    flat = _flat(state, dev)  # on the device for NCCL: device to device, no host copy
    _p2p("send", torch.tensor([header.numel(), flat.numel()], dtype=torch.int64, device=dev),
         rank, group)
    _p2p("send", header.to(dev), rank, group)
    _p2p("send", flat, rank, group)


def _recv(rank: int, group: Any = None) -> TrainingState:
    dev = comm_device(group)
    sizes = torch.zeros(2, dtype=torch.int64, device=dev)
    _p2p("recv", sizes, rank, group)
    header = torch.empty(int(sizes[0]), dtype=torch.uint8, device=dev)
    _p2p("recv", header, rank, group)
    flat = torch.empty(int(sizes[1]), dtype=torch.uint8, device=dev)
    _p2p("recv", flat, rank, group)
    # the state stays where it arrived (a GPU for NCCL); `move(..., Host())` copies it out
    return _unflat(json.loads(bytes(header.cpu().numpy())), flat)


# --- trainer <-> state ----------------------------------------------------------------------
def _modules(trainer: AgentTrainer) -> dict[str, torch.nn.Module]:
    mods: dict[str, torch.nn.Module] = {"model": trainer.model}
    if trainer.value_head is not None:
        mods["value_head"] = trainer.value_head
    if trainer.critic_model is not None:
        mods["critic"] = trainer.critic_model
    return mods


def capture(trainer: AgentTrainer, frozen: bool = True) -> TrainingState:
    """Everything that makes the trainer's future exact: weights, AdamW, grads, RNG, counters.

    `frozen=False` leaves out parameters that never train (a LoRA base model): a trainer built
    from the same config has them bit for bit, so a swap need not move them."""
    tensors: dict[str, torch.Tensor] = {}
    for prefix, mod in _modules(trainer).items():
        # every name of a tied tensor (an embedding shared with the LM head) is frozen too
        fixed = {k for k, p in mod.named_parameters(remove_duplicate=False)
                 if not p.requires_grad}
        for k, v in mod.state_dict().items():
            if frozen or k not in fixed:
                tensors[f"w/{prefix}/{k}"] = v.detach().clone()
        for k, p in mod.named_parameters():
            if p.grad is not None:
                tensors[f"g/{prefix}/{k}"] = p.grad.detach().clone()
    opt_tensors, groups = optimizer_tensors(trainer.optimizer)
    tensors.update(opt_tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {
        "agent": trainer.agent, "version": trainer.version, "rows": trainer._rows,
        "seen": sorted(trainer._seen), "sums": trainer._sums, "param_groups": groups,
        "nonfinite": getattr(trainer, "_nonfinite", None),
        # algorithm.epochs > 1: the rows the later passes will run over
        "kept": [dataclasses.asdict(s) for s in getattr(trainer, "_kept", [])],
    }
    return TrainingState(tensors, meta)


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str = "o/"
                      ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer's exact state: its tensors as `{prefix}{param index}/{slot}`, copied, and
    its param groups."""
    sd = opt.state_dict()
    tensors = {f"{prefix}{idx}/{key}": torch.as_tensor(value).detach().clone()
               for idx, slots in sd["state"].items() for key, value in slots.items()}
    return tensors, [dict(g) for g in sd["param_groups"]]


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                   groups: list[dict[str, Any]], prefix: str = "o/") -> None:
    """Load `optimizer_tensors`' output (the groups may have been through JSON)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(prefix):
            idx, key = k[len(prefix):].split("/", 1)
            state.setdefault(int(idx), {})[key] = v.clone()
    opt.load_state_dict({"state": state, "param_groups": [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]})


def pending_tensors(rows: list[Any]) -> dict[str, torch.Tensor]:
    """The arrays of rows a learner holds but has not trained on, copied, as
    `p/{row}/{name}` (what a capture carries)."""
    return {f"p/{i}/{name}": torch.from_numpy(np.array(arr, copy=True))
            for i, row in enumerate(rows) for name, arr in row.arrays.items()}


def restore(trainer: AgentTrainer, state: TrainingState) -> None:
    """Put a captured state into a trainer built from the same config (exactly)."""
    if state.meta.get("agent") != trainer.agent:
        raise ValueError(f"state of agent {state.meta.get('agent')!r} offered to "
                         f"trainer {trainer.agent!r}")
    for prefix, mod in _modules(trainer).items():
        weights = {k[len(prefix) + 3:]: v for k, v in state.tensors.items()
                   if k.startswith(f"w/{prefix}/")}
        result = mod.load_state_dict(weights, strict=False)
        trainable = {k for k, p in mod.named_parameters() if p.requires_grad}
        missing = trainable & set(result.missing_keys)
        if missing or result.unexpected_keys:
            raise ValueError(f"agent {trainer.agent!r}: state does not fit the trainer "
                             f"(missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(result.unexpected_keys)[:3]})")
        for k, p in mod.named_parameters():
            g = state.tensors.get(f"g/{prefix}/{k}")
            p.grad = None if g is None else g.clone().to(p.device)
    load_optimizer(trainer.optimizer, state.tensors, state.meta["param_groups"])
    torch.set_rng_state(state.tensors["rng/torch"])
    trainer.version = state.meta["version"]
    trainer._rows = state.meta["rows"]
    trainer._seen = set(state.meta["seen"])
    trainer._sums = dict(state.meta["sums"])
    trainer._nonfinite = state.meta.get("nonfinite")  # a poisoned step stays poisoned
    trainer._kept = [Sample(**d) for d in state.meta.get("kept", [])]


# --- the wire forms of weights between processes -----------------------------------------------
def state_to_numpy(state: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict, dict]:
    """A trainer's `get_state()` with its arrays as numpy (what a pipe or an actor carries)."""
    arrays, meta = state
    return {k: np.asarray(v) for k, v in arrays.items()}, meta


def from_numpy(weights: Any) -> dict[str, Any]:
    """Tensors from a numpy dict, from the wire form (`publish_form`), or of a `TrainingState`
    received by a collective publication."""
    if isinstance(weights, TrainingState):
        return weights.tensors
    if isinstance(weights, tuple):
        return from_wire(weights).tensors
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}


def publish_form(weights: dict[str, Any], agent: str, version: int) -> Any:
    """Published weights travel as a `TrainingState` in wire form: one flat buffer, any dtype."""
    return to_wire(TrainingState(weights, {"agent": agent, "version": version}))
