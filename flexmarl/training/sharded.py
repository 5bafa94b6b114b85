"""An agent's trainer sharded over the K ranks of one torch.distributed group (FSDP2).

Every rank of the group builds the same `AgentTrainer` (same seed, same weights), then each
transformer block and the root model are wrapped with PyTorch's `fully_shard` on a 1-D
`DeviceMesh`: parameters, gradients and AdamW moments become `DTensor`s sharded on dim 0, so a
rank holds about 1/K of them. The loss path is `AgentTrainer.accumulate` unchanged: each rank
runs its share of every micro-batch (rows `rank::K`), FSDP reduce-scatters the gradients, and
`step` normalises by the rows seen on *all* ranks, which makes one step of K ranks equal to
one step of one device up to summation order.

The model is built on the meta device on every rank (`meta_init`): FSDP shards the empty
skeleton, each rank allocates its shard alone (`to_empty`), and rank 0, which alone builds the
agent's full initial weights (on the CPU, from the seed as one device does), broadcasts them
one tensor at a time into the shards, freeing each as it goes (`materialize`). So ranks
1..K-1 never hold more than their shard and one tensor in flight, rank 0 not more than the
full weights once, and the weights are bit for bit those every rank would have built.

All methods are collective: every rank of the group must call them in the same order (as the
ranks of one training slot do, driven by one host).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from flexmarl.config.schema import AgentConfig, ModelConfig
from flexmarl.policy import adapters
from flexmarl.policy.device import process_device
from flexmarl.policy.model import skeleton, stable_seed
from flexmarl.training import dcp as dcp_state
from flexmarl.training import lora
from flexmarl.training.state import TrainingState, comm_device
from flexmarl.training.trainer import (
    EPOCH_CHUNK_ROWS,
    AgentTrainer,
    TrainingError,
    enable_checkpointing,
    length_split,
)
from flexmarl.types import Sample

# bytes per all-gather when the full weights are published (one bucket in flight at a time)
PUBLISH_BUCKET_BYTES = 64 << 20


def _blocks(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers causal LM (through peft's wrapper too)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(inner, "model", inner)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TrainingError(f"{type(inner).__name__}: no transformer blocks (model.layers) "
                            "to shard")
    return list(layers)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather when it is sharded). Collective."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _buckets(items: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
             bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """`items` as host copies (floating ones cast to `dtype`), about `bucket_bytes` a bucket:
    each item is made (gathered) only when its bucket is being filled."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for key, value in items:
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        bucket[key] = value.to("cpu", copy=True).contiguous()
        size += bucket[key].numel() * bucket[key].element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def shard_model(model: Any, mesh: DeviceMesh,
                mixed_precision: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 over `mesh`, per transformer block and at the root. Frozen parameters (a LoRA
    agent's base) are sharded like the trained ones; FSDP reduce-scatters only gradients."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def materialize(module: torch.nn.Module, source: torch.nn.Module | None,
                device: torch.device, group: Any) -> None:
    """Allocate the shards of `module` (sharded on the meta device) on `device` and fill them
    from `source`, the same module with its full weights, which rank 0 of the default group
    alone holds (None elsewhere). One tensor at a time: rank 0 broadcasts it, every rank keeps
    its shard (`distribute_tensor`, no further communication), and rank 0 frees its full copy
    at once, so no rank holds more than its shards plus one tensor beyond what it had (rank 0:
    the rest of the full weights). Buffers (the rotary frequencies too, which the state dict
    leaves out) are broadcast whole. Collective."""
    module.to_empty(device=device)
    given = dict(source.named_parameters()) if source is not None else {}
    given_buffers = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if source is not None:
                held = given.pop(name)
                full = held.detach().to(device, copy=True)
                held.data = torch.empty(0, dtype=held.dtype)  # rank 0's full copy goes now
            else:
                full = torch.empty(param.shape, dtype=param.dtype, device=device)
            dist.broadcast(full, src=0, group=group)
            if isinstance(param, DTensor):
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                              src_data_rank=None))
            else:
                param.copy_(full)
            del full
        for name, buffer in module.named_buffers():
            if source is not None:
                buffer.copy_(given_buffers[name])
            dist.broadcast(buffer, src=0, group=group)


def _trim_heap() -> None:
    """Give the allocator's free pages back to the OS (glibc's `malloc_trim`): rank 0's full
    copy of the weights and the ranks' broadcast buffers, freed tensor by tensor, would
    otherwise stay in their resident heaps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the pages stay until reused
        pass


def shard_shared_base(base: Any, agents: dict[str, AgentConfig], run_seed: int,
                      mesh: DeviceMesh) -> Any:
    """One peft model over a shared base with an adapter per agent (`adapters.adapter_name`,
    each drawn from the same seed as on one device), sharded over `mesh`: the base once per
    slot. Every adapter stays trainable; only the active one takes part in a forward, so the
    others get no gradient, and each agent's optimizer holds its own adapter alone."""
    model: Any = base
    if any(acfg.model.gradient_checkpointing for acfg in agents.values()):
        enable_checkpointing(base)
    for name, acfg in agents.items():  # on the plain base (peft renames adapted layers)
        assert acfg.lora is not None
        lora.check_targets(name, base, acfg.lora)
    for name, acfg in agents.items():
        assert acfg.lora is not None
        model = adapters.add_adapter(model, adapters.adapter_name(name), acfg.lora,
                                     stable_seed(run_seed, name, "lora"))
    for pname, p in model.named_parameters():  # peft froze all adapters but the first
        p.requires_grad_("lora_" in pname)
    model.train()
    shard_model(model, mesh)
    return model


class ShardedAgentTrainer(AgentTrainer):
    """`AgentTrainer` whose state is sharded over `mesh` (default: the whole default group)."""

    def __init__(self, agent: str, cfg: AgentConfig, vocab_size: int, max_seq_len: int,
                 run_seed: int, total_steps: int | None = None, max_staleness: int = 0,
                 device: str | None = None, mesh: DeviceMesh | None = None,
                 mixed_precision: MixedPrecisionPolicy | None = None,
                 state_dir: str | None = None, policy: Any = None,
                 adapter: str | None = None, meta_init: bool = True) -> None:
        """`mixed_precision`: FSDP2's policy (e.g. bf16 params, fp32 reduce); the master
        weights and optimizer state stay float32 either way. `state_dir`: a folder all ranks
        share, where restart points (`get_state`) are written.

        `policy` and `adapter`: an agent on a shared base trains adapter `adapter` of the
        slot's one peft model `policy`, already sharded over `mesh` (`shard_shared_base`):
        the frozen base is sharded once per slot, each agent's adapter is sharded with it, and
        this trainer's optimizer, swaps, restart points and publication hold its adapter only.

        `meta_init` (a policy of its own, on a mesh over the whole group): every rank builds
        the model on the meta device and materialises its shard alone (see the module); False
        builds the full model on every rank first (the peak memory baseline)."""
        if not dist.is_initialized():
            raise TrainingError(f"agent {agent!r}: a sharded trainer needs an initialised "
                                "torch.distributed process group")
        if (policy is None) != (adapter is None):
            raise TrainingError(f"agent {agent!r}: a shared sharded policy needs its adapter "
                                "name, and the reverse")
        target = torch.device(device or process_device())
        mesh = mesh or init_device_mesh(target.type, (dist.get_world_size(),))
        # rank 0 of the default group broadcasts the initial weights: the mesh must span it
        self.meta_init = (meta_init and policy is None
                          and mesh.size() == dist.get_world_size())
        source = None
        if self.meta_init and dist.get_rank() == 0:
            with torch.random.fork_rng(devices=[]):  # the process's RNG as if not built
                source = AgentTrainer(agent, cfg, vocab_size, max_seq_len, run_seed,
                                      total_steps, max_staleness, device="cpu")
        super().__init__(agent, cfg, vocab_size, max_seq_len, run_seed, total_steps,
                         max_staleness, device, policy=policy)
        # the ranks must run the same forward/backward calls (FSDP's collectives): the whole
        # micro-batch is split by length (every rank has it) and each run dealt to the ranks
        # (`accumulate`); a rank never splits its own rows
        self.whole_split_tokens = self.split_call_tokens
        self.split_call_tokens = 0
        self._parts: list[int] | None = None  # this rank's rows of each run, in order
        self.state_dir = state_dir
        self.mesh = mesh
        self.group = self.mesh.get_group()
        self.rank = self.mesh.get_local_rank()
        self.world = self.mesh.size()
        # NCCL reduces only device tensors, gloo only host ones (the first GPU run failed with
        # "No backend type associated with device type cpu" on a host tensor)
        self.comm_device = comm_device(self.group)
        # the peft adapter this trainer trains (LoRA agents; "default" unless on a shared base)
        self.adapter = adapter or ("default" if cfg.lora is not None else None)
        self.shared_policy = policy is not None
        if policy is None:
            shard_model(self.model, self.mesh, mixed_precision)
        # the KL reference copy and a separate critic are sharded like the policy; PPO's
        # value head (hidden -> 1) too, as one FSDP unit of its own
        if self.ref_model is not None:
            shard_model(self.ref_model, self.mesh, mixed_precision)
        if self.critic_model is not None:
            shard_model(self.critic_model, self.mesh, mixed_precision)
        if self.value_head is not None:
            fully_shard(self.value_head, mesh=self.mesh)
        if self.meta_init:
            for part in ("model", "ref_model", "critic_model"):
                module = getattr(self, part)
                if module is not None:
                    materialize(module, getattr(source, part) if source else None,
                                self.device, self.group)
            # rank 0's full copy and every rank's broadcast buffers go before training
            del source
            gc.collect()
            _trim_heap()
        # the parameters are DTensors now: the optimizer is rebuilt over them (no state yet),
        # with AgentTrainer's groups and parameter order (actor, then critic, then value head)
        self.named_trainable = [
            (n, p) for n, p in self.model.named_parameters()
            if p.requires_grad and (adapter is None or f".{adapter}." in n)]
        self.actor_params = [p for _, p in self.named_trainable]
        critic = [(f"{part}.{n}", p) for part, module in self._state_modules().items()
                  if part != "model" for n, p in module.named_parameters()]
        critic.sort(key=lambda item: not item[0].startswith("critic."))
        self.named_trainable += critic
        self.critic_params = [p for _, p in critic]
        self.params = self.actor_params + self.critic_params
        groups = [{**g, "params": params} for g, params in zip(
            self.optimizer.param_groups, [self.actor_params, self.critic_params], strict=False)]
        self.optimizer = torch.optim.AdamW(
            groups, lr=cfg.optim.lr, betas=self.optimizer.defaults["betas"],
            weight_decay=self.optimizer.defaults["weight_decay"])
        # an adapter of a shared policy: its initial shard, as a fresh build has it (the
        # policy is built once per slot, so a later build would see the trained adapter)
        self.initial = self.capture_shard() if self.shared_policy else None
        # a row every rank has, for a rank left without rows of a pass (`_zero_weight_pass`)
        self._filler: Sample | None = None

    # --- training ------------------------------------------------------------------------------
    def accumulate(self, samples: list[Sample]) -> dict[str, float]:
        """This rank's share (rows rank::K) of the micro-batch; every rank must call it with the
        same samples. Split by length (`model.split_call_tokens`), each run of the whole
        micro-batch is dealt to the ranks (its rows rank::K). A rank left without rows (of the
        micro-batch, or of a run) runs one row with zero weight, because FSDP's collectives
        need every rank in every forward and backward."""
        if not samples:
            return {}
        if self.cfg.algorithm.mask_truncated:  # dropped before the split: every rank agrees
            cut = [s for s in samples if s.truncated]
            if cut and self.rank == 0:  # counted once (the ranks' sums are reduced)
                self._sums["rows_masked_truncated"] = (
                    self._sums.get("rows_masked_truncated", 0.0) + len(cut))
            samples = [s for s in samples if not s.truncated]
            if not samples:
                return {"rows": 0.0}
        self._filler = samples[0]
        runs = length_split([len(s.prompt) + len(s.response) for s in samples],
                            self.whole_split_tokens)
        self._parts = None
        if len(runs) > 1:  # each run dealt to the ranks: one forward and backward per run
            shares = [[samples[i] for i in run][self.rank::self.world] for run in runs]
            share = [s for part in shares for s in part]
            self._parts = [len(part) for part in shares]
        else:
            share = samples[self.rank::self.world]
        if share:
            super().accumulate(share)
            return {"rows": float(len(share))}
        saved = (self._rows, set(self._seen), dict(self._sums), self._nonfinite,
                 self.loss_scale, list(self._kept))
        self.loss_scale = self._share_weight = 0.0
        try:
            super().accumulate(samples[:1])
        finally:
            (self._rows, self._seen, self._sums, self._nonfinite, self.loss_scale,
             self._kept) = saved
            self._share_weight = 1.0
        return {"rows": 0.0}

    def _backward(self, samples: list[Sample], first_pass: bool) -> dict[str, float]:
        """On a shared policy, this agent's adapter is the active one in the forward (set on
        the layers directly: peft's `set_adapter` would freeze the other agents' adapters, and
        FSDP fixes which parameters train when it first gathers them)."""
        if self.shared_policy:
            for _, layer in adapters._lora_layers(self.model):
                layer._active_adapter = self.adapter
        parts, self._parts = self._parts, None
        if parts is None:
            return super()._backward(samples, first_pass)
        # the runs of the micro-batch's split: this rank's rows of each, or (none) a
        # zero-weight pass, so that every rank makes the same calls
        ends = list(itertools.accumulate(parts))
        return self._backward_runs([samples[end - n:end] for n, end in zip(parts, ends,
                                                                          strict=True)],
                                   first_pass)

    def _zero_weight_pass(self) -> None:
        """A forward and backward of one row that adds nothing (loss scale 0): a rank without
        rows of a pass still takes part in FSDP's all-gathers and reduce-scatters."""
        assert self._filler is not None
        saved = self.loss_scale, self._nonfinite
        self.loss_scale = self._share_weight = 0.0
        try:
            self._backward([self._filler], first_pass=False)
        finally:
            self.loss_scale, self._nonfinite = saved
            self._share_weight = 1.0

    # 0 while a rank runs a row that is not its (a zero-weight pass): it adds nothing to sums
    _share_weight = 1.0

    def _batch_total(self, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """A sum over the micro-batch's rows on all ranks (`LossInputs.total`, e.g. PPO's
        advantage whitening), differentiable; collective, in the same place on every rank."""
        return dist_nn.all_reduce(t * self._share_weight, group=self.group)

    def _epoch_plan(self, n_rows: int) -> tuple[int, int]:
        """Later passes (`AgentTrainer._later_epochs`), each rank over its own share of the
        kept rows: they normalise by the rows of all ranks, and every rank runs as many chunks
        as the rank with the most (zero-weight passes where it has none)."""
        total = torch.tensor([float(n_rows)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(total, group=self.group)
        chunks = torch.tensor([-(-n_rows // EPOCH_CHUNK_ROWS)], dtype=torch.int64,
                              device=self.comm_device)
        dist.all_reduce(chunks, op=dist.ReduceOp.MAX, group=self.group)
        return int(total.item()), int(chunks.item())

    def _agree_nonfinite(self) -> None:
        """A pass poisoned on any rank moves nothing on every rank."""
        poisoned = torch.tensor([float(self._nonfinite is not None)], device=self.comm_device)
        dist.all_reduce(poisoned, op=dist.ReduceOp.MAX, group=self.group)
        if poisoned.item() and self._nonfinite is None:
            self._nonfinite = "non-finite loss on another rank"

    def _sum_ranks(self, values: list[float]) -> list[float]:
        vals = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(vals, group=self.group)
        return [float(v) for v in vals]

    def _reduce_counts(self) -> None:
        """Rows, metric sums and the skip flag of all ranks, on every rank."""
        keys = sorted(set(self._sums) - {"logprob_diff_max"})
        # every rank must reduce the same keys: the key set follows from the algorithm
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (keys, self._nonfinite), group=self.group)
        all_keys = sorted({k for ks, _ in gathered for k in ks})
        vals = torch.tensor([float(self._rows)] + [self._sums.get(k, 0.0) for k in all_keys],
                            dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(vals, group=self.group)
        mx = torch.tensor([self._sums.get("logprob_diff_max", -1.0)], dtype=torch.float64,
                          device=self.comm_device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self.group)
        self._rows = int(vals[0])
        self._sums = {k: float(v) for k, v in zip(all_keys, vals[1:].tolist(), strict=True)}
        if mx.item() >= 0:
            self._sums["logprob_diff_max"] = float(mx.item())
        self._nonfinite = next((why for _, why in gathered if why is not None), None)

    def step(self) -> dict[str, float]:
        """As `AgentTrainer.step`, over the rows of all ranks: FSDP averaged the gradients over
        K ranks, so they are scaled by K / rows (`world_size`)."""
        self._reduce_counts()
        return super().step()

    def _build_model(self, name: str, cfg: ModelConfig, vocab_size: int, max_seq_len: int,
                     run_seed: int) -> Any:
        """On the meta device when `meta_init` (weights come from rank 0, `materialize`)."""
        if self.meta_init:
            return skeleton(name, cfg, vocab_size, max_seq_len)
        return super()._build_model(name, cfg, vocab_size, max_seq_len, run_seed)

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.world

    def _full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # --- per-rank state: swapping ----------------------------------------------------------------
    def local_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state."""
        own = self.params if self.shared_policy else [
            *self.model.parameters(), *self.critic_params]
        held = own + ([] if self.ref_model is None else list(self.ref_model.parameters()))
        params = sum(_local(p).numel() * _local(p).element_size() for p in held)
        grads = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                    for p in own if p.grad is not None)
        optim = sum(_local(v).numel() * _local(v).element_size()
                    for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": optim}

    def capture_shard(self) -> TrainingState:
        """This rank's shard of weights and optimizer moments, copied to host memory (never
        gathered): a `TrainingState`, so `state.swap_out` / `swap_in` move it to disk and back.
        The trained parameters only: a LoRA agent's frozen base stays where it is."""
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.named_trainable:
            tensors[f"param/{name}"] = _local(p).detach().to("cpu", copy=True)
            if p.grad is not None:  # a swap between micro-batches of one step
                tensors[f"grad/{name}"] = _local(p.grad).detach().to("cpu", copy=True)
        index = {id(p): i for i, p in enumerate(self.params)}
        for p, slots in self.optimizer.state.items():
            for key, v in slots.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim/{index[id(p)]}/{key}"] = _local(v).detach().to(
                        "cpu", copy=True)
        tensors["rng/torch"] = torch.get_rng_state()
        meta = {"agent": self.agent, "version": self.version, "rank": self.rank,
                "world": self.world, "rows": self._rows, "seen": sorted(self._seen),
                "sums": dict(self._sums), "nonfinite": self._nonfinite}
        return TrainingState(tensors, meta)

    def restore_shard(self, state: TrainingState) -> None:
        """Put `capture_shard`'s output back in place (same rank, same K), bit for bit."""
        meta = state.meta
        if (meta["agent"], meta["rank"], meta["world"]) != (self.agent, self.rank, self.world):
            raise TrainingError(
                f"agent {self.agent!r} rank {self.rank}/{self.world}: shard of agent "
                f"{meta['agent']!r} rank {meta['rank']}/{meta['world']}")
        with torch.no_grad():
            for name, p in self.named_trainable:
                _local(p).copy_(state.tensors[f"param/{name}"])
                grad = state.tensors.get(f"grad/{name}")
                if grad is None:
                    p.grad = None
                elif isinstance(p, DTensor):
                    p.grad = DTensor.from_local(grad.to(p.device, copy=True), p.device_mesh,
                                                p.placements, shape=p.shape, stride=p.stride())
                else:
                    p.grad = grad.to(p.device, copy=True)
            by_index = dict(enumerate(self.params))
            for key, v in state.tensors.items():
                if not key.startswith("optim/"):
                    continue
                _, idx, slot = key.split("/", 2)
                p = by_index[int(idx)]
                cur = self.optimizer.state[p].get(slot)
                if isinstance(cur, torch.Tensor):
                    _local(cur).copy_(v)
                else:  # the optimizer has not stepped since it was built: rebuild its slots
                    self.optimizer.state[p][slot] = (
                        DTensor.from_local(v.clone(), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride())
                        if isinstance(p, DTensor) and v.dim() > 0 else v.clone())
        torch.set_rng_state(state.tensors["rng/torch"])
        self.version = int(meta["version"])
        self._rows = int(meta["rows"])
        self._seen = set(meta["seen"])
        self._sums = dict(meta["sums"])
        self._nonfinite = meta["nonfinite"]

    # --- the Learner role (training/learner.py) on a sharded slot ----------------------------
    def capture(self) -> TrainingState:
        """A swap moves this rank's shard only (`capture_shard`)."""
        return self.capture_shard()

    def restore(self, state: TrainingState) -> None:
        self.restore_shard(state)

    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The restart point: a DCP checkpoint (each rank writes its shard) in a new folder
        under `state_dir`; the meta names it and carries every rank's RNG state. Collective.
        The three newest folders of the agent are kept (the driver, or a checkpoint being
        written, may still read the older)."""
        if self.state_dir is None:
            raise TrainingError(f"agent {self.agent!r}: a sharded trainer's restart point "
                                "needs a state folder shared by its ranks")
        root = Path(self.state_dir) / "restart" / self.agent
        named = [f"v{self.version}-{uuid.uuid4().hex[:8]}"]  # rank 0's name, for all ranks
        dist.broadcast_object_list(named, src=dist.get_global_rank(self.group, 0),
                                   group=self.group)
        name = named[0]
        self.save_checkpoint(root / name)
        rngs: list[Any] = [None] * self.world
        dist.all_gather_object(rngs, torch.get_rng_state().tolist(), group=self.group)
        if self.rank == 0:
            old = sorted((d for d in root.iterdir() if d.name != name),
                         key=lambda d: d.stat().st_mtime)
            for stale in old[:-2]:
                shutil.rmtree(stale, ignore_errors=True)
        return {}, {"agent": self.agent, "version": self.version, "dcp": str(root / name),
                    "world": self.world, "rng": rngs}

    def set_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load `get_state`'s restart point (any K wrote it; RNG states only at the same K)."""
        if meta.get("agent") != self.agent:
            raise TrainingError(f"agent {self.agent!r}: state of agent {meta.get('agent')!r}")
        if "dcp" not in meta:  # a one-device state (a checkpoint taken at K=1)
            self._load_full(arrays, meta)
            return
        self.load_checkpoint(meta["dcp"])
        if int(meta.get("world", 0)) == self.world:
            torch.set_rng_state(torch.tensor(meta["rng"][self.rank], dtype=torch.uint8))

    def _canonical(self, key: str) -> str | None:
        """A state key as a one-device trainer of the agent names it (a shared policy's
        adapter is peft's "default" there), or None for what this trainer does not own: the
        other agents' adapters. Restart points and checkpoints use these
        names, so any K, and one device, read them."""
        if not self.shared_policy:
            return key
        own = f".{self.adapter}."
        if own in key:
            return key.replace(own, ".default.")
        # another agent's adapter is not this agent's state (the frozen base is not saved)
        return None if ".lora_" in key else key

    def _local_key(self, key: str) -> str:
        return key.replace(".default.", f".{self.adapter}.") if self.shared_policy else key

    def _load_full(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """`AgentTrainer.get_state`'s full arrays (every rank has them), each rank keeping its
        shard: the model by name, AdamW's state by parameter index (the same order here). A
        LoRA agent's frozen base is left as it is (a shared base holds no state of its own)."""
        root = self.checkpoint_root()
        prefix = "" if root is self.model else "model."  # a critic: parts by name
        model: dict[str, Any] = {}
        for key, value in arrays.items():
            if key.startswith("model."):
                key = prefix + self._local_key(key[len("model."):])
            elif not key.startswith(("value_head.", "critic.")):
                continue
            model[key] = torch.from_numpy(np.array(value, copy=True))
        n_actor = len(self.actor_params)
        names = [prefix + n for n, _ in self.named_trainable[:n_actor]] + [
            n for n, _ in self.named_trainable[n_actor:]]
        if self.cfg.lora is not None:  # the adapters only
            model = {k: v for k, v in model.items() if k in set(names)}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in arrays.items():
            if key.startswith("optim."):
                _, idx, slot = key.split(".", 2)
                state.setdefault(names[int(idx)], {})[slot] = torch.from_numpy(
                    np.array(value, copy=True))
        groups = [{**g, "params": names} for g in meta["param_groups"]]
        optim: Any = {"state": state, "param_groups": groups}
        set_state_dict(root, self.optimizer, model_state_dict=model,
                       optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True,
                                                strict=self.cfg.lora is None))
        self.version = int(meta["version"])
        self._clear_step()

    # --- publication -----------------------------------------------------------------------
    def weight_buckets(self, dtype: torch.dtype | None = None,
                       bucket_bytes: int = PUBLISH_BUCKET_BYTES
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights, one bucket at a time: each bucket is all-gathered, handed out on
        every rank, and dropped before the next (the consumer keeps what it needs). Buffers
        (not sharded) come as they are. A LoRA agent's are the base model's weights with its
        adapter merged, under the base model's names."""
        if self.cfg.lora is not None:
            yield from self._merged_buckets(full=True, dtype=dtype, bucket_bytes=bucket_bytes)
            return
        yield from _buckets(((name, _full(v)) for name, v in self.model.state_dict().items()),
                            dtype, bucket_bytes)

    def _merged_buckets(self, full: bool, dtype: torch.dtype | None = None,
                        bucket_bytes: int = PUBLISH_BUCKET_BYTES
                        ) -> Iterator[dict[str, torch.Tensor]]:
        """`lora.merged_weights` of this agent's adapter on the sharded model, one adapted
        layer (base weight, A and B gathered) at a time, then (`full`) the other weights.
        The delta is peft's `get_delta_weight`: (B @ A) * scaling, transposed for
        fan_in_fan_out layers."""
        from peft.utils import transpose  # peft is LoRA's dependency

        prefix = "base_model.model."
        merged: set[str] = set()

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for name, layer in adapters._lora_layers(self.model):
                if not hasattr(layer, "base_layer") or self.adapter not in layer.lora_A:
                    continue
                base = _full(layer.base_layer.weight)
                delta = transpose(_full(layer.lora_B[self.adapter].weight)
                                  @ _full(layer.lora_A[self.adapter].weight),
                                  layer.fan_in_fan_out) * layer.scaling[self.adapter]
                key = name[len(prefix):] if name.startswith(prefix) else name
                merged.add(f"{key}.weight")
                yield f"{key}.weight", base + delta
            for key, value in self.model.state_dict().items() if full else ():
                key = key[len(prefix):] if key.startswith(prefix) else key
                key = key.replace(".base_layer.", ".")
                if "lora_" not in key and key not in merged:  # (its base is merged already)
                    yield key, _full(value)

        yield from _buckets(items(), dtype, bucket_bytes)

    def _adapter_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """`adapters.adapter_tensors` of this agent, one layer's A and B at a time."""
        for name, layer in adapters._lora_layers(self.model):
            if self.adapter in layer.lora_A:
                yield {f"{name}.lora_A": _full(layer.lora_A[self.adapter].weight).to(
                           "cpu", copy=True),
                       f"{name}.lora_B": _full(layer.lora_B[self.adapter].weight).to(
                           "cpu", copy=True)}

    def weights(self) -> dict[str, torch.Tensor]:
        """What the rollout replicas need (the same tensors as `AgentTrainer.weights`), built
        bucket by bucket; collective, every rank gets the result. An agent on a shared base
        publishes its adapter alone; any other LoRA agent its merged adapted layers."""
        out: dict[str, torch.Tensor] = {}
        if self.cfg.model.base is not None and self.cfg.lora is not None:
            for bucket in self._adapter_buckets():
                out.update({k: v.to(self.compute_dtype) for k, v in bucket.items()})
            return out
        buckets = (self._merged_buckets(full=False, dtype=self.compute_dtype)
                   if self.cfg.lora is not None else self.weight_buckets(self.compute_dtype))
        for bucket in buckets:
            out.update(bucket)
        return out

    def full_weights(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets():
            out.update(bucket)
        return out

    def save(self, directory: str | Path) -> Path:
        """The Hugging Face safetensors export of the full model (LoRA: merged), written by
        rank 0; a LoRA agent's adapter also alone under `adapter/`, in PEFT's format."""
        directory = Path(directory)
        tensors = self.full_weights()
        adapter = {} if self.cfg.lora is None else {  # PEFT's names: <layer>.lora_A.weight
            f"{k}.weight": v for bucket in self._adapter_buckets() for k, v in bucket.items()}

        def write_adapter(folder: Path, base: str) -> None:
            folder.mkdir(exist_ok=True)
            save_file(adapter, str(folder / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            peft_cfg = self.model.peft_config[self.adapter]
            peft_cfg.base_model_name_or_path = base
            peft_cfg.save_pretrained(str(folder))

        if self.rank == 0:
            self._write_folder(directory, tensors, write_adapter)
        dist.barrier(group=self.group)
        return directory

    # --- checkpoints (torch.distributed.checkpoint) ----------------------------------------
    def save_checkpoint(self, directory: str | Path) -> None:
        """Every rank writes its own shard of weights and optimizer state; any K can load it."""
        dcp_state.save(self.checkpoint_root(), self.optimizer, self.version, directory,
                       self.group, names=self._canonical)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load a checkpoint written by `save_checkpoint` at any K (resharded on read)."""
        self.version = dcp_state.load(self.checkpoint_root(), self.optimizer, directory,
                                      self.group, names=self._canonical)
        self._clear_step()
