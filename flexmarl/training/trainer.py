"""One trainer per trainable agent: accumulate gradients over micro-batches, step once per
iteration batch, hand out the new weights.

The trainer never sees the store: it receives micro-batches as plain samples (prompt, response,
old log-probs, advantage, mask), so it runs unchanged in-process, in a worker process or in an
actor.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from flexmarl.config.schema import AgentConfig, OptimConfig
from flexmarl.policy.model import build_model, stable_seed, weights_of
from flexmarl.policy.sampling import make_token_batch, response_forward
from flexmarl.training import algorithms, lora
from flexmarl.training.algorithms.common import LossInputs, entropy_coef


class TrainingError(RuntimeError):
    pass


@dataclass
class Sample:
    """One row as the trainer needs it (the store's data contract, by named keys)."""

    sample_id: str
    prompt: list[int]
    response: list[int]
    old_logprobs: list[float]
    advantage: float
    allowed: list[int] | None
    temperature: float
    policy_version: int
    reward: float = 0.0


def lr_factor(cfg: OptimConfig, step: int, total: int, n_actor: int, n_critic: int) -> float:
    """The multiplier of `optim.lr` at optimizer step `step` (0-based)."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.schedule == "constant":
        return warm
    if cfg.schedule == "cosine":
        t = min(1.0, step / max(1, total))
        return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
    # critic_scaled (enterprise MARL seed document):
    # lr_t = lr_0 * min(1, sqrt(N_critic / N_actor)) * exp(-lambda * t)
    return warm * min(1.0, math.sqrt(n_critic / max(n_actor, 1))) * math.exp(-cfg.decay * step)


class AgentTrainer:
    def __init__(
        self, agent: str, cfg: AgentConfig, vocab_size: int, max_seq_len: int, run_seed: int,
        total_steps: int | None = None,
    ) -> None:
        self.agent = agent
        self.cfg = cfg
        self.algo = algorithms.get(cfg.algorithm.name)
        self.total_steps = cfg.optim.total_steps or total_steps or 1
        base = build_model(agent, cfg.model, vocab_size, max_seq_len, run_seed)
        self.vocab = base.config.vocab_size
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0 and cfg.lora is None:
            # with LoRA the reference is the base model itself (adapters disabled)
            self.ref_model = copy.deepcopy(base).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.model = lora.apply(agent, base, cfg.lora) if cfg.lora is not None else base
        self.model.train()
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
            if cfg.algorithm.critic == "separate":
                self.critic_model = build_model(f"{agent}.critic", cfg.model, vocab_size,
                                                max_seq_len, run_seed)
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
            if s.policy_version != self.version:
                raise TrainingError(
                    f"agent {self.agent!r}: sample {s.sample_id} from version "
                    f"{s.policy_version} offered to trainer at version {self.version}"
                )
            if s.sample_id in self._seen:
                raise TrainingError(
                    f"agent {self.agent!r}: sample {s.sample_id} offered twice in one step"
                )
        batch = make_token_batch(
            [s.prompt for s in samples],
            [s.response for s in samples],
            [s.allowed for s in samples],
            [s.temperature for s in samples],
            self.vocab,
        )
        rwidth = batch.response_tokens.shape[1]
        old = torch.zeros((len(samples), rwidth))
        for i, s in enumerate(samples):
            old[i, : len(s.old_logprobs)] = torch.as_tensor(s.old_logprobs)
        shared_head = self.value_head is not None and self.critic_model is None
        ent_grad = entropy_coef(self.cfg.algorithm, self.version) > 0
        logp, entropy, hidden = response_forward(self.model, batch,
                                                 with_entropy="grad" if ent_grad else True,
                                                 with_hidden=shared_head)
        inputs = LossInputs(
            logp=logp, old_logp=old, mask=batch.response_mask,
            advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            ref_logp=self._reference_logprobs(batch), entropy=entropy,
            values=self._values(batch, hidden),
        )
        loss, metrics = self.algo.loss(inputs, self.cfg.algorithm, step=self.version)
        bad = [k for k, v in metrics.items() if not math.isfinite(float(v))]
        if not torch.isfinite(loss.detach()) or bad:
            # A poisoned micro-batch would turn every weight into NaN: its step is skipped.
            # (Masked terms can keep the loss itself finite while its parts are not.)
            what = f"non-finite loss {float(loss.detach()):.4g}" if not bad else \
                f"non-finite {', '.join(bad)}"
            self._nonfinite = self._nonfinite or what
        else:
            loss.backward()
        self._rows += len(samples)
        self._seen.update(s.sample_id for s in samples)
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        return {"rows": float(len(samples))}

    def _set_lr(self) -> float:
        factor = lr_factor(self.cfg.optim, self.version, self.total_steps, self.n_actor,
                           self.n_critic)
        for i, group in enumerate(self.optimizer.param_groups):
            decay_only = i > 0 and self.cfg.optim.schedule == "critic_scaled"
            f = math.exp(-self.cfg.optim.decay * self.version) if decay_only else factor
            group["lr"] = group["base_lr"] * f
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> dict[str, float]:
        """Normalise the summed gradients by the rows seen, clip, step; version += 1."""
        if self._rows == 0:  # every row of the iteration failed: keep weights, move on
            self.version += 1
            return {"skipped": 1.0, "rows": 0.0}
        scale = 1.0 / self._rows
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        max_norm = self.cfg.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm is not None else float("inf")
        )
        if self._nonfinite is None and not torch.isfinite(norm):
            self._nonfinite = f"non-finite gradient norm {float(norm):.4g}"
        if self._nonfinite is not None:
            return self._skip_step(self._nonfinite)
        lr = self._set_lr()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(self._sums.pop("tokens", 0.0), 1.0)
        metrics = {k: v / self._rows for k, v in self._sums.items()}
        metrics["clip_frac"] = self._sums.get("clip_frac", 0.0) / tokens
        metrics["grad_norm"] = float(norm)
        metrics["lr"] = lr
        metrics["rows"] = float(self._rows)
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self.version += 1
        return metrics

    def _skip_step(self, reason: str) -> dict[str, float]:
        """Drop this iteration's gradients, keep the weights, still advance the version (the
        rows of this version were used up)."""
        rows = float(self._rows)
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self._nonfinite = None
        self.version += 1
        return {"skipped": 1.0, "rows": rows, "skip_reason": reason}  # type: ignore[dict-item]

    def weights(self) -> dict[str, torch.Tensor]:
        """What the rollout replicas need to hold this version (LoRA: the merged adapted layers)."""
        if self.cfg.lora is not None:
            return lora.merged_weights(self.model)
        return weights_of(self.model)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy under the base model's names (LoRA merged), e.g. for a checkpoint."""
        if self.cfg.lora is not None:
            return lora.merged_weights(self.model, full=True)
        return weights_of(self.model)

    def save(self, directory: str | Path) -> Path:
        """Weights as safetensors plus the HF config, so `from_pretrained(dir)` reloads them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.full_weights().items()}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        config = self.model.get_base_model().config if self.cfg.lora else self.model.config
        config.save_pretrained(str(directory))
        (directory / "flexmarl.json").write_text(
            json.dumps({"agent": self.agent, "policy_version": self.version}) + "\n"
        )
        return directory

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "rows_pending": self._rows}

    # --- full training state, for checkpoints and trainer restarts ---------------------------
    def _state_modules(self) -> dict[str, torch.nn.Module]:
        """Every module with trained weights: the policy (LoRA: with its adapters) and the
        critic, as a value head or a separate model."""
        out: dict[str, torch.nn.Module] = {"model": self.model}
        if getattr(self, "value_head", None) is not None:
            out["value_head"] = self.value_head
        if getattr(self, "critic_model", None) is not None:
            out["critic"] = self.critic_model
        return out

    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything a restarted trainer needs to continue bit for bit: weights, optimizer
        moments and step counts, the version and the RNG states, as (arrays, JSON-able meta).
        Gradients of a step in progress are not part of it (they are rebuilt from the rows)."""
        arrays: dict[str, np.ndarray] = {
            f"{part}.{k}": v.detach().cpu().numpy().copy()
            for part, module in self._state_modules().items()
            for k, v in module.state_dict().items()
        }
        opt = self.optimizer.state_dict()
        for idx, slots in opt["state"].items():
            for key, value in slots.items():
                arrays[f"optim.{idx}.{key}"] = value.detach().cpu().numpy().copy()
        arrays["rng.torch"] = torch.get_rng_state().numpy().copy()
        np_state = np.random.get_state()
        arrays["rng.numpy"] = np.asarray(np_state[1]).copy()
        meta = {
            "agent": self.agent,
            "version": self.version,
            "param_groups": opt["param_groups"],
            "rng_numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "hf_config": json.loads(self.model.config.to_json_string()),
        }
        return arrays, meta

    def set_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore `get_state`'s output; any gradients accumulated so far are dropped."""
        if meta.get("agent") != self.agent:
            raise TrainingError(f"agent {self.agent!r}: state of agent {meta.get('agent')!r}")
        for part, module in self._state_modules().items():
            prefix = f"{part}."
            module.load_state_dict({k[len(prefix):]: torch.from_numpy(np.array(v, copy=True))
                                    for k, v in arrays.items() if k.startswith(prefix)})
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
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0
        self._seen.clear()
        self._sums = {}
        self._nonfinite = None
