"""One trainer per trainable agent: accumulate gradients over micro-batches, step once per
iteration batch, hand out the new weights.

The trainer never sees the store: it receives micro-batches as plain samples (prompt, response,
old log-probs, advantage, mask), so it runs unchanged in-process, in a worker process or in an
actor.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from flexmarl.config.schema import AgentConfig, ModelConfig, OptimConfig
from flexmarl.policy import adapters
from flexmarl.policy.device import compute_dtype, memory_stats, process_device
from flexmarl.policy.model import build_model, stable_seed, weights_of
from flexmarl.policy.sampling import make_token_batch, response_forward
from flexmarl.policy.tokenizer import TokenizerError, agent_tokenizer, base_model_name
from flexmarl.training import algorithms, lora
from flexmarl.training import dcp as dcp_state
from flexmarl.training import state as st
from flexmarl.training.algorithms.common import LossInputs, entropy_coef
from flexmarl.training.learner import Audit
from flexmarl.types import Sample

# rows per forward/backward in the passes after the first (`algorithm.epochs`): a fixed
# chunking, so the summation order never depends on how the first pass's micro-batches came
EPOCH_CHUNK_ROWS = 64
# `model.split_call_tokens` left out: a forward and backward call's fixed cost, in tokens
SPLIT_CALL_TOKENS = {"cpu": 64, "accelerator": 1024}


def split_call_tokens(cfg: AgentConfig, device_type: str) -> int:
    """`model.split_call_tokens` as a trainer on a `device_type` device applies it; 0 (never
    split) when the algorithm's loss takes statistics over the micro-batch
    (`rows_independent`)."""
    if not algorithms.get(cfg.algorithm.name).rows_independent(cfg.algorithm):
        return 0
    if cfg.model.split_call_tokens is not None:
        return cfg.model.split_call_tokens
    return SPLIT_CALL_TOKENS["cpu" if device_type == "cpu" else "accelerator"]


def length_split(lengths: list[int], call_tokens: int) -> list[list[int]]:
    """The rows (indices into `lengths`), sorted by length, cut into the runs that minimise
    sum over runs of (call_tokens + rows x longest): the padded tokens of one forward per run
    plus each call's fixed cost. Exact (dynamic programming over the sorted rows); ties keep
    the rows' order, so the split depends only on the lengths. call_tokens 0: one run."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if call_tokens <= 0 or len(order) < 2:
        return [order] if order else []
    ordered = [lengths[i] for i in order]
    if ordered[0] == ordered[-1]:  # nothing to save: more runs only add calls
        return [order]
    n = len(order)
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the cheapest split of the j shortest rows
        best[j], cut[j] = min((best[i] + call_tokens + (j - i) * ordered[j - 1], i)
                              for i in range(j))
    runs = []
    j = n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


class TrainingError(RuntimeError):
    pass


def enable_checkpointing(base: Any) -> None:
    """Activation (gradient) checkpointing of a transformers model, non-reentrant."""
    # transformers renamed it (activation_) after 5.17, kwargs included
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})


def lr_factor(cfg: OptimConfig, step: int, total: int, n_actor: int, n_critic: int) -> float:
    """The multiplier of `optim.lr` at optimizer step `step` (0-based)."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.schedule == "constant":
        return warm
    if cfg.schedule == "cosine":
        t = min(1.0, step / max(1, total))
        cosine = 0.5 * (1 + math.cos(math.pi * t))
        return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
    # critic_scaled (enterprise MARL seed document):
    # lr_t = lr_0 * min(1, sqrt(N_critic / N_actor)) * exp(-lambda * t)
    return warm * min(1.0, math.sqrt(n_critic / max(n_actor, 1))) * math.exp(-cfg.decay * step)


class AgentTrainer:
    def __init__(
        self, agent: str, cfg: AgentConfig, vocab_size: int, max_seq_len: int, run_seed: int,
        total_steps: int | None = None, max_staleness: int = 0, device: str | None = None,
        shared_base: torch.nn.Module | None = None, policy: Any = None,
    ) -> None:
        """`device`: where the trainer computes (None: this process's device, see
        `policy.device`). Weights and optimizer state stay float32 there; forward and backward
        run under autocast to `model.dtype` (bf16 on GPUs by default).

        `max_staleness`: rows generated by versions [version - max_staleness, version] are
        accepted (`pipeline.max_staleness`: 0, on-policy, except 1 in one_step_off). Stale rows
        need no extra correction: the loss's ratio pi_theta / pi_behaviour uses the log-probs
        recorded at generation (`Sample.old_logprobs`), the clipped importance weight of
        one-step off-policy PPO/GRPO.

        `shared_base`: the built base of an agent on a shared base (`model.base`), on this
        trainer's device in float32; the trainer wraps a tree over the same tensors (no copy).

        `policy`: a peft model the slot built and wrapped already, used as it is (a sharded
        slot's one peft model over its sharded shared base, an adapter per agent)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.agent = agent
        self.max_staleness = max_staleness
        self.cfg = cfg
        self.algo = algorithms.get(cfg.algorithm.name)
        self.total_steps = cfg.optim.total_steps or total_steps or 1
        self.device = torch.device(device or process_device())
        self.compute_dtype = compute_dtype(cfg.model.dtype, self.device)
        self.split_call_tokens = split_call_tokens(cfg, self.device.type)
        # float16 gradients underflow without scaling: a fixed loss scale, divided out at the
        # step (an overflow makes the step non-finite, and it is skipped like any such step)
        self.loss_scale = 1024.0 if self.compute_dtype == torch.float16 else 1.0
        base: Any  # a transformers causal LM
        if policy is not None:
            base = policy.get_base_model()
        elif shared_base is not None:
            base = adapters.share_base(shared_base)
        else:
            base = self._build_model(agent, cfg.model, vocab_size, max_seq_len, run_seed)
        if cfg.model.gradient_checkpointing and policy is None:  # a built policy has it set
            enable_checkpointing(base)
        self.vocab = base.config.vocab_size
        self.ref_model: Any = None
        if cfg.algorithm.kl_coef > 0 and cfg.lora is None:
            # with LoRA the reference is the base model itself (adapters disabled)
            self.ref_model = copy.deepcopy(base).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        # a transformers model, or peft's wrapper of one (both duck-typed)
        self.model: Any = policy if policy is not None else (
            lora.apply(agent, base, cfg.lora, stable_seed(run_seed, agent, "lora"))
            if cfg.lora is not None else base)
        self.model.train()
        self._hf_json: dict[str, Any] | None = None  # `_hf_config`
        self.actor_params = [p for p in self.model.parameters() if p.requires_grad]
        self.critic_model = None
        self.value_head: torch.nn.Linear | None = None
        critic_params: list[torch.nn.Parameter] = []
        if cfg.algorithm.name == "ppo":
            hidden = base.config.hidden_size
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stable_seed(run_seed, agent, "value_head"))
                self.value_head = torch.nn.Linear(hidden, 1)
                torch.nn.init.normal_(self.value_head.weight, std=1.0 / math.sqrt(hidden))
                torch.nn.init.zeros_(self.value_head.bias)
            self.value_head.to(self.device)
            if cfg.algorithm.critic == "separate":
                self.critic_model = self._build_model(f"{agent}.critic", cfg.model,
                                                      vocab_size, max_seq_len, run_seed)
                self.critic_model.train()
                critic_params += list(self.critic_model.parameters())
            critic_params += list(self.value_head.parameters())
        self.critic_params = critic_params
        self.params = self.actor_params + critic_params
        self.n_actor = sum(p.numel() for p in self.actor_params)
        self.n_critic = sum(p.numel() for p in critic_params)
        groups = [{"params": self.actor_params, "lr": cfg.optim.lr, "base_lr": cfg.optim.lr}]
        if critic_params:
            clr = getattr(cfg.algorithm, "critic_lr", None) or cfg.optim.lr
            groups.append({"params": critic_params, "lr": clr, "base_lr": clr})
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        self.version = 0
        self._rows = 0
        self._seen: set[str] = set()
        self._sums: dict[str, float] = {}
        self._nonfinite: str | None = None  # why this step must be skipped (NaN/inf seen)
        # algorithm.epochs > 1: the iteration's rows, for the passes after the first
        self._kept: list[Sample] = []

    def _build_model(self, name: str, cfg: ModelConfig, vocab_size: int, max_seq_len: int,
                     run_seed: int) -> Any:
        """A model the trainer owns, with its initial weights (`policy.model.build_model`); a
        sharded trainer builds it on the meta device instead and loads its shard later."""
        return build_model(name, cfg, vocab_size, max_seq_len, run_seed, self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Forward passes in the compute dtype over float32 master weights."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _reference_logprobs(self, batch) -> torch.Tensor | None:
        if self.cfg.algorithm.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.ref_model is not None:
                return response_forward(self.ref_model, batch)[0]
            with self.model.disable_adapter():  # LoRA: the base weights are the reference
                return response_forward(self.model, batch)[0]

    def _values(self, batch, hidden: torch.Tensor | None) -> torch.Tensor | None:
        if self.value_head is None:
            return None
        if self.critic_model is not None:
            _, _, hidden = response_forward(self.critic_model, batch, with_hidden=True)
        assert hidden is not None
        return self.value_head(hidden.float()).squeeze(-1) * batch.response_mask

    def accumulate(self, samples: list[Sample]) -> dict[str, float]:
        """Forward/backward one micro-batch; gradients add up until `step`."""
        if not samples:
            return {}
        for s in samples:
            if not self.version - self.max_staleness <= s.policy_version <= self.version:
                allowed = (f"only version {self.version}" if self.max_staleness == 0 else
                           f"versions {max(0, self.version - self.max_staleness)}.."
                           f"{self.version}, max_staleness={self.max_staleness}")
                raise TrainingError(
                    f"agent {self.agent!r}: sample {s.sample_id} from version "
                    f"{s.policy_version} offered to trainer at version {self.version} "
                    f"(accepts {allowed})"
                )
            if s.sample_id in self._seen:
                raise TrainingError(
                    f"agent {self.agent!r}: sample {s.sample_id} offered twice in one step"
                )
        self._seen.update(s.sample_id for s in samples)
        if self.cfg.algorithm.mask_truncated:
            cut = sum(s.truncated for s in samples)
            if cut:
                self._sums["rows_masked_truncated"] = (
                    self._sums.get("rows_masked_truncated", 0.0) + cut)
                samples = [s for s in samples if not s.truncated]
                if not samples:
                    return {"rows": 0.0}
        if self.cfg.algorithm.epochs > 1:
            self._kept.extend(samples)
        metrics = self._backward(samples, first_pass=True)
        self._rows += len(samples)
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        return {"rows": float(len(samples))}

    def _backward(self, samples: list[Sample], first_pass: bool) -> dict[str, float]:
        """Forward and backward of one micro-batch, split by length (`length_split`); its
        loss metrics, summed over its rows."""
        runs = length_split([len(s.prompt) + len(s.response) for s in samples],
                            self.split_call_tokens)
        return self._backward_runs(
            [samples] if len(runs) == 1 else [[samples[i] for i in run] for run in runs],
            first_pass)

    def _backward_runs(self, runs: list[list[Sample]], first_pass: bool) -> dict[str, float]:
        """One forward and backward per run of rows (an empty run: `_zero_weight_pass`); the
        runs' loss metrics, summed."""
        metrics: dict[str, float] = {}
        for rows in runs:
            if not rows:
                self._zero_weight_pass()
                continue
            for k, v in self._backward_batch(rows, first_pass).items():
                metrics[k] = metrics.get(k, 0.0) + v
        return metrics

    def _backward_batch(self, samples: list[Sample], first_pass: bool) -> dict[str, float]:
        """Forward and backward of rows padded to one width; their loss metrics, summed over
        the rows. A non-finite loss adds no gradient and poisons the step (`_nonfinite`)."""
        batch = make_token_batch(
            [s.prompt for s in samples],
            [s.response for s in samples],
            [s.allowed for s in samples],
            [s.temperature for s in samples],
            self.vocab,
        ).to(self.device)
        rwidth = batch.response_tokens.shape[1]
        counts = np.fromiter((len(s.old_logprobs) for s in samples), dtype=np.int64,
                             count=len(samples))
        old_np = np.zeros((len(samples), rwidth), dtype=np.float32)
        old_np[np.arange(rwidth)[None, :] < counts[:, None]] = np.fromiter(
            (v for s in samples for v in s.old_logprobs), dtype=np.float32,
            count=int(counts.sum()))
        old = torch.from_numpy(old_np).to(self.device)
        shared_head = self.value_head is not None and self.critic_model is None
        ent_grad = entropy_coef(self.cfg.algorithm, self.version) > 0
        with self._autocast():
            logp, entropy, hidden = response_forward(self.model, batch,
                                                     with_entropy="grad" if ent_grad else True,
                                                     with_hidden=shared_head)
            inputs = LossInputs(
                logp=logp, old_logp=old, mask=batch.response_mask,
                advantages=torch.tensor([s.advantage for s in samples],
                                        dtype=torch.float32).to(self.device),
                rewards=torch.tensor([s.reward for s in samples],
                                     dtype=torch.float32).to(self.device),
                ref_logp=self._reference_logprobs(batch), entropy=entropy,
                values=self._values(batch, hidden), total=self._batch_total,
            )
        if first_pass:
            self._logprob_diff(samples, logp.detach(), old, batch.response_mask)
        loss, metrics = self.algo.loss(inputs, self.cfg.algorithm, step=self.version)
        bad = [k for k, v in metrics.items() if not math.isfinite(float(v))]
        if not torch.isfinite(loss.detach()) or bad:
            # A poisoned micro-batch would turn every weight into NaN: its step is skipped.
            # (Masked terms can keep the loss itself finite while its parts are not.)
            what = f"non-finite loss {float(loss.detach()):.4g}" if not bad else \
                f"non-finite {', '.join(bad)}"
            self._nonfinite = self._nonfinite or what
            if self.world_size > 1:
                # the peers of a sharded slot run their backward: this rank's FSDP
                # collectives must run too (every rank skips the step, `_reduce_counts`)
                (loss * 0.0).backward()
        else:
            (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
        return metrics

    def _logprob_diff(self, samples: list[Sample], logp: torch.Tensor, old: torch.Tensor,
                      mask: torch.Tensor) -> None:
        """|trainer log-prob - rollout log-prob| over the tokens of rows generated by exactly
        these weights: the rollout/training numerics mismatch every GPU RL framework watches."""
        same = torch.tensor([s.policy_version == self.version for s in samples],
                            device=mask.device)
        m = mask * same.unsqueeze(1)
        n = float(m.sum())
        if n == 0:
            return
        diff = (logp.float() - old).abs() * m
        self._sums["logprob_diff_sum"] = self._sums.get("logprob_diff_sum", 0.0) + float(
            diff.sum())
        self._sums["logprob_diff_tokens"] = self._sums.get("logprob_diff_tokens", 0.0) + n
        self._sums["logprob_diff_max"] = max(self._sums.get("logprob_diff_max", 0.0),
                                             float(diff.max()))

    def _set_lr(self) -> float:
        factor = lr_factor(self.cfg.optim, self.version, self.total_steps, self.n_actor,
                           self.n_critic)
        for i, group in enumerate(self.optimizer.param_groups):
            decay_only = i > 0 and self.cfg.optim.schedule == "critic_scaled"
            f = math.exp(-self.cfg.optim.decay * self.version) if decay_only else factor
            group["lr"] = group["base_lr"] * f
        return float(self.optimizer.param_groups[0]["lr"])

    # ranks the gradients were averaged over (FSDP averages; a sharded trainer has K)
    world_size = 1
    # sums over the whole micro-batch (`LossInputs.total`); a sharded trainer's reduce them
    _batch_total: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over the whole model (a sharded trainer gathers its pieces)."""
        return norm

    def _optimizer_step(self, rows: int) -> torch.Tensor:
        """Normalise the summed gradients by `rows`, clip and step (unless a non-finite loss
        or gradient norm poisoned them: then `_nonfinite` says why and nothing moves)."""
        scale = self.world_size / (rows * self.loss_scale)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        max_norm = self.cfg.optim.max_grad_norm
        norm = self._full_norm(torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm is not None else float("inf")
        ))
        if self._nonfinite is None and not torch.isfinite(norm):
            self._nonfinite = f"non-finite gradient norm {float(norm):.4g}"
        if self._nonfinite is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _later_epochs(self) -> dict[str, float]:
        """Passes 2..epochs over the kept rows (sample_id order, fixed chunks), one optimizer
        step each; a non-finite pass moves nothing and ends the passes. A sharded slot runs
        the same passes over each rank's share (its `_epoch_plan`, `_zero_weight_pass`,
        `_agree_nonfinite` and `_sum_ranks` make the ranks agree)."""
        rows = sorted(self._kept, key=lambda s: s.sample_id)
        self._kept = []
        total, chunks = self._epoch_plan(len(rows))
        done, last = 1, {}
        for _ in range(1, self.cfg.algorithm.epochs):
            sums: dict[str, float] = {}
            for i in range(chunks):
                chunk = rows[i * EPOCH_CHUNK_ROWS:(i + 1) * EPOCH_CHUNK_ROWS]
                if not chunk:  # a rank with fewer rows than its peers
                    self._zero_weight_pass()
                    continue
                for k, v in self._backward(chunk, False).items():
                    sums[k] = sums.get(k, 0.0) + v
            self._agree_nonfinite()
            self._optimizer_step(total)
            if self._nonfinite is not None:
                self._nonfinite = None
                break
            done += 1
            last = sums
        out = {"epochs": float(done)}
        if done > 1:
            policy, clip, tokens = self._sum_ranks(
                [last.get("loss/policy", 0.0), last.get("clip_frac", 0.0),
                 last.get("tokens", 0.0)])
            out["loss/policy_last_epoch"] = policy / total
            out["clip_frac_last_epoch"] = clip / max(tokens, 1.0)
        return out

    def _epoch_plan(self, n_rows: int) -> tuple[int, int]:
        """(rows a later pass normalises by, chunks it runs): this trainer's own."""
        return n_rows, -(-n_rows // EPOCH_CHUNK_ROWS)

    def _zero_weight_pass(self) -> None:
        """Nothing to do on one device (a sharded rank without rows still joins collectives)."""

    def _agree_nonfinite(self) -> None:
        """One device decides alone whether a pass was non-finite."""

    def _sum_ranks(self, values: list[float]) -> list[float]:
        return values

    def step(self) -> dict[str, float]:
        """Normalise the summed gradients by the rows seen, clip, step (then the later epochs'
        passes, `algorithm.epochs`); version += 1."""
        if self._rows == 0:  # every row of the iteration failed: keep weights, move on
            masked = self._sums.get("rows_masked_truncated", 0.0)
            self._clear_step()
            self.version += 1
            return {"skipped": 1.0, "rows": 0.0, **(
                {"rows_masked_truncated": masked} if masked else {})}
        lr = self._set_lr()
        norm = self._optimizer_step(self._rows)
        if self._nonfinite is not None:
            return self._skip_step(self._nonfinite)
        # (not `if self._kept`: a rank of a sharded slot may hold none of the rows)
        extra = self._later_epochs() if self.cfg.algorithm.epochs > 1 else {}
        tokens = max(self._sums.pop("tokens", 0.0), 1.0)
        lpd_sum = self._sums.pop("logprob_diff_sum", None)
        lpd_tokens = self._sums.pop("logprob_diff_tokens", 0.0)
        lpd_max = self._sums.pop("logprob_diff_max", None)
        metrics = {k: v / self._rows for k, v in self._sums.items()}
        if lpd_sum is not None and lpd_tokens > 0:
            metrics["logprob_diff_mean"] = lpd_sum / lpd_tokens
            metrics["logprob_diff_max"] = float(lpd_max or 0.0)
        metrics.update(memory_stats(self.device))
        metrics["clip_frac"] = self._sums.get("clip_frac", 0.0) / tokens
        metrics["grad_norm"] = float(norm)
        metrics["lr"] = lr
        metrics["rows"] = float(self._rows)
        metrics["train_world_size"] = float(self.world_size)  # ranks it trained on
        metrics.update(extra)
        if "rows_masked_truncated" in metrics:  # a count, not a per-row mean
            metrics["rows_masked_truncated"] = self._sums["rows_masked_truncated"]
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self.version += 1
        return metrics

    def _skip_step(self, reason: str) -> dict[str, float]:
        """Drop this iteration's gradients, keep the weights, still advance the version (the
        rows of this version were used up)."""
        rows = float(self._rows)
        self._clear_step()
        self.version += 1
        return {"skipped": 1.0, "rows": rows, "skip_reason": reason}  # type: ignore[dict-item]

    def _clear_step(self) -> None:
        """Forget the step in progress: gradients, rows, kept rows, metric sums, poison."""
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0
        self._kept = []
        self._seen.clear()
        self._sums = {}
        self._nonfinite = None

    def weights(self) -> dict[str, torch.Tensor]:
        """What the rollout replicas need to hold this version (LoRA: the merged adapted layers;
        on a shared base: the adapter alone, the replica holds the base), in the compute dtype
        (replicas hold the weights autocast computes with)."""
        if self.cfg.model.base is not None and self.cfg.lora is not None:
            return {k: v.to(self.compute_dtype)
                    for k, v in adapters.adapter_tensors(self.model).items()}
        if self.cfg.lora is not None:
            return {k: v.to(self.compute_dtype) if v.is_floating_point() else v
                    for k, v in lora.merged_weights(self.model).items()}
        return weights_of(self.model, self.compute_dtype)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy under the base model's names (LoRA merged), e.g. for a checkpoint."""
        if self.cfg.lora is not None:
            return lora.merged_weights(self.model, full=True)
        return weights_of(self.model)

    def save(self, directory: str | Path) -> Path:
        """A folder that loads as it is: the full weights (LoRA: merged) as safetensors with the
        HF config (`AutoModelForCausalLM.from_pretrained(dir)`), the agent's tokenizer and chat
        template when it has one (`AutoTokenizer.from_pretrained(dir)`), and for a LoRA agent
        its adapter alone in PEFT's format under `adapter/` (`PeftModel.from_pretrained(base,
        dir / "adapter")`), the base named in it and in flexmarl.json."""
        tensors = {k: v.contiguous() for k, v in self.full_weights().items()}

        def write_adapter(folder: Path, base: str) -> None:
            for peft_cfg in self.model.peft_config.values():
                peft_cfg.base_model_name_or_path = base
            # the embeddings are the base's (not trained): no look-up of the base's config
            self.model.save_pretrained(str(folder), save_embedding_layers=False)

        return self._write_folder(Path(directory), tensors, write_adapter)

    def _write_folder(self, directory: Path, tensors: dict[str, torch.Tensor],
                      write_adapter: Callable[[Path, str], None]) -> Path:
        """`save`'s folder from the full weights; `write_adapter(folder, base name)` writes a
        LoRA agent's adapter in PEFT's format."""
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        inner = self.model.get_base_model() if self.cfg.lora else self.model
        inner.config.save_pretrained(str(directory))
        tokenizer = self._tokenizer()
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        base = base_model_name(self.agent, self.cfg.model)
        if self.cfg.lora is not None:
            write_adapter(directory / "adapter", base)
        (directory / "flexmarl.json").write_text(json.dumps(
            {"agent": self.agent, "policy_version": self.version, "base_model": base,
             "lora": self.cfg.lora is not None, "tokenizer": tokenizer is not None}) + "\n")
        return directory

    def _tokenizer(self) -> Any:
        """The agent's tokenizer, or None for a token-level agent whose vocabulary cannot hold
        one (a random model smaller than the byte-level tokenizer)."""
        try:
            return agent_tokenizer(self.agent, self.cfg.model, self.vocab)
        except TokenizerError:
            return None

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "rows_pending": self._rows}

    # --- full training state, for checkpoints and trainer restarts ---------------------------
    # --- the Learner role's exact state and memory (training/learner.py) ----------------------
    trained_on: Audit | None = None  # an LLM step's rows are audited by the store

    def capture(self) -> st.TrainingState:
        """The exact state a swap moves; a frozen base stays (a trainer built from the same
        config has it bit for bit)."""
        return st.capture(self, frozen=False)

    def restore(self, state: st.TrainingState) -> None:
        st.restore(self, state)

    def state_objects(self) -> list[Any]:
        """Modules and optimizer this trainer holds (a shared base is the slot's, not here)."""
        objects: list[Any] = [*self._state_modules().values(), self.optimizer]
        if self.ref_model is not None:
            objects.append(self.ref_model)
        return objects

    def _state_modules(self) -> dict[str, Any]:
        """Every module with trained weights: the policy (LoRA: with its adapters) and the
        critic, as a value head or a separate model."""
        out: dict[str, Any] = {"model": self.model}
        if getattr(self, "value_head", None) is not None:
            out["value_head"] = self.value_head
        if getattr(self, "critic_model", None) is not None:
            out["critic"] = self.critic_model
        return out

    def checkpoint_root(self) -> torch.nn.Module:
        """The module tree a `torch.distributed.checkpoint` folder holds (`training.dcp`):
        the policy, or with a critic every trained part under its `_state_modules` name."""
        parts = self._state_modules()
        return self.model if len(parts) == 1 else torch.nn.ModuleDict(parts)

    def _shared_keys(self, part: str, module: Any) -> set[str]:
        """The frozen base tensors of an agent on a shared base: the same in every trainer
        built from the config, and held once per slot, so restart points leave them out."""
        if part != "model" or self.cfg.model.base is None:
            return set()
        return {k for k, p in module.named_parameters(remove_duplicate=False)
                if not p.requires_grad} | {
            k for k, _ in module.named_buffers()}

    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything a restarted trainer needs to continue bit for bit: weights, optimizer
        moments and step counts, the version and the RNG states, as (arrays, JSON-able meta).
        Gradients of a step in progress are not part of it (they are rebuilt from the rows)."""
        arrays: dict[str, np.ndarray] = {
            f"{part}.{k}": v.detach().cpu().numpy().copy()
            for part, module in self._state_modules().items()
            for k, v in module.state_dict().items() if k not in self._shared_keys(part, module)
        }
        opt: dict[str, Any] = dict(self.optimizer.state_dict())
        for idx, slots in opt["state"].items():
            for key, value in slots.items():
                arrays[f"optim.{idx}.{key}"] = value.detach().cpu().numpy().copy()
        arrays["rng.torch"] = torch.get_rng_state().numpy().copy()
        np_state: Any = np.random.get_state()  # (name, keys, pos, has_gauss, cached)
        arrays["rng.numpy"] = np.asarray(np_state[1]).copy()
        meta = {
            "agent": self.agent,
            "version": self.version,
            "param_groups": opt["param_groups"],
            "rng_numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "hf_config": dict(self._hf_config()),
        }
        return arrays, meta

    def _hf_config(self) -> dict[str, Any]:
        """The model's config as JSON values, made once: transformers rebuilds it field by
        field on every call, a third of a restart point's time after every step."""
        if self._hf_json is None:
            self._hf_json = json.loads(self.model.config.to_json_string())
        return self._hf_json

    def set_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore `get_state`'s output; any gradients accumulated so far are dropped. A
        sharded slot's state (`meta["dcp"]`, written at any K) is read resharded to this one
        device."""
        if meta.get("agent") != self.agent:
            raise TrainingError(f"agent {self.agent!r}: state of agent {meta.get('agent')!r}")
        if "dcp" in meta:
            self.version = dcp_state.load(self.checkpoint_root(), self.optimizer, meta["dcp"])
            self._clear_step()
            return
        for part, module in self._state_modules().items():
            prefix = f"{part}."
            shared = self._shared_keys(part, module)
            result = module.load_state_dict(
                {k[len(prefix):]: torch.from_numpy(np.array(v, copy=True))
                 for k, v in arrays.items() if k.startswith(prefix)}, strict=not shared)
            missing = set(result.missing_keys) - shared
            if missing or result.unexpected_keys:
                raise TrainingError(f"agent {self.agent!r}: state does not fit the trainer "
                                    f"(missing {sorted(missing)[:3]}, "
                                    f"unexpected {sorted(result.unexpected_keys)[:3]})")
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in arrays.items():
            if key.startswith("optim."):
                _, idx, name = key.split(".", 2)
                state.setdefault(int(idx), {})[name] = torch.from_numpy(np.array(value, copy=True))
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        torch.set_rng_state(torch.from_numpy(np.array(arrays["rng.torch"], copy=True)))
        name, pos, has_gauss, cached = meta["rng_numpy"]
        np.random.set_state((name, np.array(arrays["rng.numpy"], dtype=np.uint32), pos,
                             has_gauss, cached))
        self.version = int(meta["version"])
        self._clear_step()
