"""Placement and precision: which devices each pool owns, what each worker sees, which dtype.

Every piece of FlexMARL computes through these few functions, so the same code runs on the
CPU (CI, laptops) and on GPUs. A pool owns a list of GPU indices; its workers are spread over
them, one device per worker, and each worker process is started with `CUDA_VISIBLE_DEVICES`
set to its own device only, so a rollout replica cannot allocate on a training GPU and the
reverse (the separation is physical, not a convention). Inside a worker the model lives on
`cuda:0` (its only visible device) or on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from flexmarl.errors import UserError

CPU_MAX_BATCH_TOKENS = 65536  # a replica's KV budget on the CPU, where memory is not the limit
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlacementError(UserError, ValueError):
    """The configured devices do not exist or do not fit the pools; names the field."""


@dataclass(frozen=True)
class Placement:
    """Where one worker computes: `kind` cpu or cuda, and the GPU indices it may see."""

    kind: Literal["cpu", "cuda"] = "cpu"
    visible: tuple[int, ...] = ()
    cpus: tuple[int, ...] = ()  # CPU cores the process is pinned to (empty: anywhere)
    nice: int = 0  # added to the process's niceness (`runtime.rollout_nice`)

    @property
    def device(self) -> str:
        """The torch device inside the worker (its visible devices renumber from 0)."""
        return "cuda:0" if self.kind == "cuda" else "cpu"

    def env(self) -> dict[str, str]:
        """Environment for the worker process; on CPU, hides every GPU."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.visible))
                if self.kind == "cuda" else ""}

    def apply(self) -> None:
        """Set this process's visibility; call before the first CUDA call of the process.

        A cuda placement with no indices keeps what the host set (Ray assigns a GPU actor's
        devices itself)."""
        if self.cpus:  # before torch starts its threads: they inherit the affinity
            os.sched_setaffinity(0, self.cpus)
        if self.nice:
            os.nice(self.nice)
        if self.kind == "cuda" and not self.visible:
            return
        os.environ.update(self.env())


def mps_active() -> bool:
    """Whether an MPS control daemon is up for this process's user (its control pipe exists
    where CUDA clients look for it). Without one, processes sharing a GPU run their kernels by
    turns (time slices); under MPS at once."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def resolve_kind(devices: str, gpu_count: int | None = None) -> Literal["cpu", "cuda"]:
    """`runtime.devices` to cpu or cuda; asking for cuda on a machine without one is an error."""
    n = torch.cuda.device_count() if gpu_count is None else gpu_count
    if devices == "cpu":
        return "cpu"
    if devices == "cuda":
        if n == 0:
            raise PlacementError("runtime.devices is 'cuda' but no CUDA device is visible "
                                 "(use 'auto' to fall back to the CPU)")
        return "cuda"
    return "cuda" if n > 0 else "cpu"


def _pool_list(field: str, value: int | list[int] | None, start: int, gpu_count: int
               ) -> list[int]:
    if isinstance(value, list):
        bad = [d for d in value if d >= gpu_count]
        if bad:
            raise PlacementError(f"runtime.{field}: device(s) {bad} do not exist "
                                 f"({gpu_count} GPU(s) visible: 0..{gpu_count - 1})")
        return list(value)
    assert value is not None
    if start + value > gpu_count:
        raise PlacementError(f"runtime.{field}: {value} device(s) asked from index {start}, "
                             f"but only {gpu_count} GPU(s) are visible")
    return list(range(start, start + value))


def pool_devices(rollout: int | list[int] | None, train: int | list[int] | None,
                 gpu_count: int, share: bool = False) -> tuple[list[int], list[int]]:
    """The GPU indices of the rollout pool and of the training pool.

    Counts are taken in order, rollout first. Unset pools split the visible GPUs, rollout
    first (rollout gets the extra one of an odd count); with one GPU both pools share it."""
    if gpu_count <= 0:
        raise PlacementError("no CUDA device is visible")
    if rollout is None and train is None:
        if gpu_count == 1:
            return [0], [0]
        half = (gpu_count + 1) // 2
        return list(range(half)), list(range(half, gpu_count))
    r = _pool_list("rollout_devices", rollout, 0, gpu_count) if rollout is not None else None
    start = (max(r) + 1) if r else 0
    t = _pool_list("train_devices", train, start if isinstance(train, int) else 0, gpu_count) \
        if train is not None else None

    def rest(taken: list[int], field: str, other: str) -> list[int]:
        """The GPUs `taken` leaves for the other pool, or (nothing left) the same ones."""
        left = [d for d in range(gpu_count) if d not in taken]
        if not left and not share and gpu_count > 1:
            raise PlacementError(f"runtime.{field} takes every GPU; leave some for {other} "
                                 "or set runtime.share_devices: true")
        return left or list(taken)

    if r is None:  # train given: rollout takes what is left, or shares when nothing is
        assert t is not None
        r = rest(t, "train_devices", "rollout")
    if t is None:
        t = rest(r, "rollout_devices", "training")
    both = sorted(set(r) & set(t))
    if both and not share and gpu_count > 1:
        raise PlacementError(f"runtime.rollout_devices {r} and runtime.train_devices {t} share "
                             f"device(s) {both}; set runtime.share_devices: true to colocate")
    return r, t


def runtime_pools(runtime_cfg, gpu_count: int) -> tuple[list[int], list[int]]:
    """The GPU indices of both pools from `runtime.*`: `pool_devices`, or with
    `runtime.colocate` one list for both (the one given, else every visible GPU)."""
    if getattr(runtime_cfg, "colocate", False):
        given = runtime_cfg.rollout_devices if runtime_cfg.rollout_devices is not None \
            else runtime_cfg.train_devices
        field = "rollout_devices" if runtime_cfg.rollout_devices is not None else "train_devices"
        both = _pool_list(field, given, 0, gpu_count) if given is not None \
            else list(range(gpu_count))
        return both, list(both)
    return pool_devices(runtime_cfg.rollout_devices, runtime_cfg.train_devices, gpu_count,
                        runtime_cfg.share_devices)


def worker_placements(kind: str, devices: list[int], n_workers: int) -> list[Placement]:
    """One placement per worker of a pool: worker i on device devices[i % len(devices)]."""
    if kind != "cuda":
        return [Placement("cpu")] * n_workers
    return [Placement("cuda", (devices[i % len(devices)],)) for i in range(n_workers)]


def plan_placements(runtime_cfg, n_rollout: int, n_train: int, gpu_count: int | None = None
                    ) -> tuple[list[Placement], list[Placement]]:
    """Placements of every rollout and training worker from `runtime.*` settings."""
    n = torch.cuda.device_count() if gpu_count is None else gpu_count
    kind = resolve_kind(runtime_cfg.devices, n)
    if kind == "cpu":
        rollout, train = worker_placements("cpu", [], n_rollout), worker_placements(
            "cpu", [], n_train)
    else:
        r, t = runtime_pools(runtime_cfg, n)
        rollout, train = worker_placements("cuda", r, n_rollout), worker_placements(
            "cuda", t, n_train)
    colocated = runtime_cfg.colocated_cpus() if hasattr(runtime_cfg, "colocated_cpus") else None
    return (_pinned(rollout, colocated or getattr(runtime_cfg, "rollout_cpus", None)),
            _pinned(train, colocated or getattr(runtime_cfg, "train_cpus", None)))


def nice_weight(nice: int) -> float:
    """A process's CPU weight under Linux's CFS at `nice`, relative to nice 0 (each step
    about 1.25x: 10 is 110/1024)."""
    return 1.25 ** -nice


def rollout_nice(cfg: Any, kind: str, replicas: int, slot_ranks: int,
                 cores: int | None = None) -> int:
    """`runtime.rollout_nice`, resolved: the given value, or (None) 10 when a CPU run overlaps
    its pools (a pipelined mode, not colocated) and its processes' threads (the driver's, the
    `replicas`' and the `slot_ranks`', `runtime.torch_threads` each) outnumber the cores this
    process may use (`cores`: that many instead); else 0. Then the training slot gets a core
    first whenever both pools want one: in an on-policy pipeline a slot that waits for a core
    delays every version the replicas wait for, while rows a replica finishes later only wait
    in the store."""
    rt = cfg.runtime
    if rt.rollout_nice is not None:
        return int(rt.rollout_nice)
    pipelined = cfg.pipeline.mode != "sync" and not rt.colocate
    threads = (1 + replicas + slot_ranks) * rt.torch_threads
    usable = cores if cores is not None else len(os.sched_getaffinity(0))
    return 10 if kind == "cpu" and pipelined and threads > usable else 0


def _pinned(placements: list[Placement], cpus: list[int] | None) -> list[Placement]:
    """`runtime.rollout_cpus` / `train_cpus`: every worker of the pool on those cores."""
    return [dataclasses.replace(p, cpus=tuple(cpus)) for p in placements] if cpus else placements


def compute_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`model.dtype` on `device`: auto is bfloat16 on GPUs that support it, else float32."""
    dev = torch.device(device)
    if name != "auto":
        return DTYPES[name]
    if dev.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes in a transformers decoder (keys and values, all layers)."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def kv_token_budget(configured: int | None, model: torch.nn.Module, fraction: float) -> int:
    """A replica's `max_batch_tokens`: the configured value, or on a GPU what `fraction` of the
    device memory free after loading the weights holds (65536 on the CPU)."""
    if configured is not None:
        return configured
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return CPU_MAX_BATCH_TOKENS
    free, _total = torch.cuda.mem_get_info(param.device)
    per_token = kv_bytes_per_token(model.config, param.dtype)
    # the prefill's activations and logits need room too: hence only a fraction of what is free
    return max(1024, int(free * fraction) // max(per_token, 1))


def memory_stats(device: str | torch.device) -> dict[str, float]:
    """Allocated and peak memory of this process on `device`, in GB (empty on CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    return {"mem_allocated_gb": torch.cuda.memory_allocated(dev) / 1e9,
            "mem_peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9}


# --- the device of this process -------------------------------------------------------------
_PROCESS_DEVICE = "cpu"


def set_process_device(placement: Placement) -> None:
    """Pin this worker process to its placement; models built afterwards default to it."""
    global _PROCESS_DEVICE
    placement.apply()
    _PROCESS_DEVICE = placement.device


@contextlib.contextmanager
def computing_on(device: str) -> Iterator[None]:
    """Models and trainers built inside default to `device` (the simulator's profiler measures
    a run's agents in its own process on the device the run places them on), without
    changing what this process may see."""
    global _PROCESS_DEVICE
    before, _PROCESS_DEVICE = _PROCESS_DEVICE, device
    try:
        yield
    finally:
        _PROCESS_DEVICE = before


def process_device() -> str:
    """The device models of this process compute on (`cpu` unless a placement was set)."""
    return _PROCESS_DEVICE


def _slot_field(runtime_cfg) -> str:
    """How the config named its slot sizes (for the error messages)."""
    if runtime_cfg.slot_sizes is not None:
        return f"runtime.slot_sizes={runtime_cfg.slot_sizes}"
    return f"runtime.train_workers={runtime_cfg.train_workers} x " \
        f"runtime.slot_size={runtime_cfg.slot_size}"


def check_slots(runtime_cfg, sizes: list[int], gpu_count: int | None = None,
                cpu_count: int | None = None) -> None:
    """Whether training slots of `sizes` ranks can run here (before anything starts): a
    slot larger than the training pool's GPUs, on the CPU more training processes than 4x the
    CPU count, or no collective backend for a slot of K > 1 is an error naming the field."""

    n = torch.cuda.device_count() if gpu_count is None else gpu_count
    kind = resolve_kind(runtime_cfg.devices, n)
    field = _slot_field(runtime_cfg)
    if kind == "cuda":
        _, train = runtime_pools(runtime_cfg, n)
        if max(sizes) > len(train):
            raise PlacementError(f"{field}: a slot of {max(sizes)} ranks needs {max(sizes)} "
                                 f"GPUs, but the training pool has {len(train)} ({train})")
    else:
        cpus = os.cpu_count() if cpu_count is None else cpu_count
        cpus = cpus or 1
        if sum(sizes) > 4 * cpus:
            raise PlacementError(f"{field}: {sum(sizes)} CPU training processes, more than "
                                 f"4 x the {cpus} CPUs of this machine ({4 * cpus})")
    if max(sizes) > 1:
        backend = "nccl" if kind == "cuda" else "gloo"
        ok = dist.is_available() and (dist.is_nccl_available() if kind == "cuda"
                                      else dist.is_gloo_available())
        if not ok:
            raise PlacementError(f"{field}: a slot of {max(sizes)} ranks needs the "
                                 f"torch.distributed {backend} backend, which this torch "
                                 "build does not have")


def slot_placements(runtime_cfg, sizes: list[int], gpu_count: int | None = None
                    ) -> list[list[Placement]]:
    """The placement of every rank of every training slot: slot i's ranks take the training
    pool's GPUs in order from where slot i-1's ended (wrapping around: slots may share GPUs,
    as single-device slots do; the ranks of one slot never do), each rank seeing its own.
    Every rank is pinned to the training pool's cores (`train_cpus`, or with `colocate` the
    cores both pools share)."""
    n = torch.cuda.device_count() if gpu_count is None else gpu_count
    cpus = (runtime_cfg.colocated_cpus() if hasattr(runtime_cfg, "colocated_cpus") else None) \
        or getattr(runtime_cfg, "train_cpus", None)
    if resolve_kind(runtime_cfg.devices, n) == "cpu":
        return [_pinned([Placement("cpu")] * k, cpus) for k in sizes]
    _, train = runtime_pools(runtime_cfg, n)
    out: list[list[Placement]] = []
    start = 0
    for k in sizes:  # slots of 1: slot i on device i, as `worker_placements`
        out.append(_pinned([Placement("cuda", (train[(start + j) % len(train)],))
                            for j in range(k)], cpus))
        start += k
    return out
