"""One trainer per trainable agent: accumulate gradients over micro-batches, step once per
iteration batch, hand out the new weights.

The trainer never sees the store: it receives micro-batches as plain samples (prompt, response,
old log-probs, advantage, mask), so it runs unchanged in-process, in a worker process or in an
actor.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from flexmarl.config.schema import AgentConfig
from flexmarl.policy.model import build_model, weights_of
from flexmarl.policy.sampling import make_token_batch, response_logprobs
from flexmarl.training.algorithms import grpo


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


class AgentTrainer:
    def __init__(
        self, agent: str, cfg: AgentConfig, vocab_size: int, max_seq_len: int, run_seed: int
    ) -> None:
        self.agent = agent
        self.cfg = cfg
        self.model = build_model(agent, cfg.model, vocab_size, max_seq_len, run_seed)
        self.model.train()
        self.vocab = self.model.config.vocab_size
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        self.version = 0
        self._rows = 0
        self._seen: set[str] = set()
        self._sums: dict[str, float] = {}
        self._nonfinite: str | None = None  # why this step must be skipped (NaN/inf seen)

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
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        logp, entropy = response_logprobs(self.model, batch, with_entropy=True)
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = response_logprobs(self.ref_model, batch)
        loss, metrics = grpo.loss(
            logp, old, adv, batch.response_mask, self.cfg.algorithm, ref_logp, entropy,
            step=self.version,
        )
        if not torch.isfinite(loss.detach()):
            # A poisoned micro-batch would turn every weight into NaN: its step is skipped.
            self._nonfinite = self._nonfinite or f"non-finite loss {float(loss.detach()):.4g}"
        else:
            loss.backward()
        self._rows += len(samples)
        self._seen.update(s.sample_id for s in samples)
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        return {"rows": float(len(samples))}

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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(self._sums.pop("tokens", 0.0), 1.0)
        metrics = {k: v / self._rows for k, v in self._sums.items()}
        metrics["clip_frac"] = self._sums.get("clip_frac", 0.0) / tokens
        metrics["grad_norm"] = float(norm)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
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
        return weights_of(self.model)

    def save(self, directory: str | Path) -> Path:
        """Weights as safetensors plus the HF config, so `from_pretrained(dir)` reloads them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.weights().items()}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        self.model.config.save_pretrained(str(directory))
        (directory / "flexmarl.json").write_text(
            json.dumps({"agent": self.agent, "policy_version": self.version}) + "\n"
        )
        return directory

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "rows_pending": self._rows}

    # --- full training state, for checkpoints and trainer restarts ---------------------------
    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything a restarted trainer needs to continue bit for bit: weights, optimizer
        moments and step counts, the version and the RNG states, as (arrays, JSON-able meta).
        Gradients of a step in progress are not part of it (they are rebuilt from the rows)."""
        arrays: dict[str, np.ndarray] = {
            f"model.{k}": v.numpy() for k, v in self.weights().items()
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
        weights = {k[len("model."):]: torch.from_numpy(np.array(v, copy=True))
                   for k, v in arrays.items() if k.startswith("model.")}
        self.model.load_state_dict(weights)
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
