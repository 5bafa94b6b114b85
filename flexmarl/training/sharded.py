"""An agent's trainer sharded over the K ranks of one torch.distributed group (FSDP2).

Every rank of the group builds the same `AgentTrainer` (same seed, same weights), then each
transformer block and the root model are wrapped with PyTorch's `fully_shard` on a 1-D
`DeviceMesh`: parameters, gradients and AdamW moments become `DTensor`s sharded on dim 0, so a
rank holds about 1/K of them. The loss path is `AgentTrainer.accumulate` unchanged: each rank
runs its share of every micro-batch (rows `rank::K`), FSDP reduce-scatters the gradients, and
`step` normalises by the rows seen on *all* ranks, which makes one step of K ranks equal to
one step of one device up to summation order.

All methods are collective: every rank of the group must call them in the same order (as the
ranks of one training slot do, driven by one host).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from flexmarl.config.schema import AgentConfig
from flexmarl.training import dcp as dcp_state
from flexmarl.training.state import TrainingState
from flexmarl.training.trainer import AgentTrainer, TrainingError
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


class ShardedAgentTrainer(AgentTrainer):
    """`AgentTrainer` whose state is sharded over `mesh` (default: the whole default group)."""

    def __init__(self, agent: str, cfg: AgentConfig, vocab_size: int, max_seq_len: int,
                 run_seed: int, total_steps: int | None = None, max_staleness: int = 0,
                 device: str | None = None, mesh: DeviceMesh | None = None,
                 mixed_precision: MixedPrecisionPolicy | None = None,
                 state_dir: str | None = None) -> None:
        """`mixed_precision`: FSDP2's policy (e.g. bf16 params, fp32 reduce); the master
        weights and optimizer state stay float32 either way. `state_dir`: a folder all ranks
        share, where restart points (`get_state`) are written."""
        if not dist.is_initialized():
            raise TrainingError(f"agent {agent!r}: a sharded trainer needs an initialised "
                                "torch.distributed process group")
        if cfg.algorithm.name == "ppo" or cfg.algorithm.kl_coef > 0:
            # the value head / critic / reference copy would need their own sharding
            raise TrainingError(f"agent {agent!r}: sharded training supports critic-free "
                                "algorithms without a KL reference so far (got "
                                f"{cfg.algorithm.name}, kl_coef={cfg.algorithm.kl_coef})")
        if cfg.algorithm.epochs > 1:
            raise TrainingError(f"agent {agent!r}: sharded training runs one pass per "
                                f"iteration so far (got algorithm.epochs={cfg.algorithm.epochs})")
        super().__init__(agent, cfg, vocab_size, max_seq_len, run_seed, total_steps,
                         max_staleness, device)
        self.state_dir = state_dir
        self.mesh = mesh or init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.group = self.mesh.get_group()
        self.rank = self.mesh.get_local_rank()
        self.world = self.mesh.size()
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        if mixed_precision is not None:
            kwargs["mp_policy"] = mixed_precision
        for block in _blocks(self.model):
            fully_shard(block, **kwargs)
        fully_shard(self.model, **kwargs)
        # the parameters are DTensors now: the optimizer is rebuilt over them (no state yet)
        self.actor_params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = list(self.actor_params)
        opt = self.optimizer
        self.optimizer = torch.optim.AdamW(
            [{"params": self.actor_params, "lr": cfg.optim.lr, "base_lr": cfg.optim.lr}],
            lr=cfg.optim.lr, betas=opt.defaults["betas"],
            weight_decay=opt.defaults["weight_decay"])

    # --- training ------------------------------------------------------------------------------
    def accumulate(self, samples: list[Sample]) -> dict[str, float]:
        """This rank's share (rows rank::K) of the micro-batch; every rank must call it with the
        same samples. A rank left without rows runs one row with zero weight, because FSDP's
        collectives need every rank in every forward and backward."""
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
        share = samples[self.rank::self.world]
        if share:
            super().accumulate(share)
            return {"rows": float(len(share))}
        saved = (self._rows, set(self._seen), dict(self._sums), self._nonfinite,
                 self.loss_scale, list(self._kept))
        self.loss_scale = 0.0
        try:
            super().accumulate(samples[:1])
        finally:
            (self._rows, self._seen, self._sums, self._nonfinite, self.loss_scale,
             self._kept) = saved
        return {"rows": 0.0}

    def _reduce_counts(self) -> None:
        """Rows, metric sums and the skip flag of all ranks, on every rank."""
        keys = sorted(set(self._sums) - {"logprob_diff_max"})
        # every rank must reduce the same keys: the key set follows from the algorithm
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (keys, self._nonfinite), group=self.group)
        all_keys = sorted({k for ks, _ in gathered for k in ks})
        vals = torch.tensor([float(self._rows)] + [self._sums.get(k, 0.0) for k in all_keys],
                            dtype=torch.float64)
        dist.all_reduce(vals, group=self.group)
        mx = torch.tensor([self._sums.get("logprob_diff_max", -1.0)], dtype=torch.float64)
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

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.world

    def _full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # --- per-rank state: swapping ----------------------------------------------------------------
    def local_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state."""
        params = sum(_local(p).numel() * _local(p).element_size()
                     for p in self.model.parameters())
        grads = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                    for p in self.model.parameters() if p.grad is not None)
        optim = sum(_local(v).numel() * _local(v).element_size()
                    for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": optim}

    def capture_shard(self) -> TrainingState:
        """This rank's shard of weights and optimizer moments, copied to host memory (never
        gathered): a `TrainingState`, so `state.swap_out` / `swap_in` move it to disk and back."""
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
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
            for name, p in self.model.named_parameters():
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

    def _load_full(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """`AgentTrainer.get_state`'s full arrays (every rank has them), each rank keeping its
        shard: the model by name, AdamW's state by parameter index (the same order here)."""
        model: dict[str, Any] = {k[len("model."):]: torch.from_numpy(np.array(v, copy=True))
                                 for k, v in arrays.items() if k.startswith("model.")}
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in arrays.items():
            if key.startswith("optim."):
                _, idx, slot = key.split(".", 2)
                state.setdefault(names[int(idx)], {})[slot] = torch.from_numpy(
                    np.array(value, copy=True))
        groups = [{**g, "params": names} for g in meta["param_groups"]]
        optim: Any = {"state": state, "param_groups": groups}
        set_state_dict(self.model, self.optimizer, model_state_dict=model,
                       optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True, strict=True))
        self.version = int(meta["version"])
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self._nonfinite = None

    # --- publication -----------------------------------------------------------------------
    def weight_buckets(self, dtype: torch.dtype | None = None,
                       bucket_bytes: int = PUBLISH_BUCKET_BYTES
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights, one bucket at a time: each bucket is all-gathered, handed out on
        every rank, and dropped before the next (the consumer keeps what it needs). Buffers
        (not sharded) come as they are."""
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name, v in self.model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            full = full.detach()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            bucket[name] = full.to("cpu", copy=True).contiguous()
            size += bucket[name].numel() * bucket[name].element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
        if bucket:
            yield bucket

    def weights(self) -> dict[str, torch.Tensor]:
        """What the rollout replicas need (the same tensors as `AgentTrainer.weights`), built
        bucket by bucket; collective, every rank gets the result."""
        if self.cfg.lora is not None:
            raise TrainingError(f"agent {self.agent!r}: publication of sharded LoRA agents "
                                "is not built yet")
        out: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(self.compute_dtype):
            out.update(bucket)
        return out

    def full_weights(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets():
            out.update(bucket)
        return out

    def save(self, directory: str | Path) -> Path:
        """The Hugging Face safetensors export of the full model, written by rank 0."""
        directory = Path(directory)
        tensors = self.full_weights()
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(str(directory))
        dist.barrier(group=self.group)
        return directory

    # --- checkpoints (torch.distributed.checkpoint) ----------------------------------------
    def save_checkpoint(self, directory: str | Path) -> None:
        """Every rank writes its own shard of weights and optimizer state; any K can load it."""
        dcp_state.save(self.model, self.optimizer, self.version, directory, self.group)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load a checkpoint written by `save_checkpoint` at any K (resharded on read)."""
        self.version = dcp_state.load(self.model, self.optimizer, directory, self.group)
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self._nonfinite = None

