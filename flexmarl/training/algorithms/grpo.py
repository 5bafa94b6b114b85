"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Read top to bottom:
1. the G trajectories sampled for one input form a group; each row's advantage is its reward
   minus the group mean, divided by the group std (Shao et al., 2024, DeepSeekMath);
2. the loss of one row is the PPO clipped surrogate, averaged over the row's response tokens,
   plus an optional KL to a frozen reference (k3 estimator) and an optional entropy bonus;
3. the trainer sums row losses over micro-batches and divides by the number of rows in the
   iteration batch at step time, so accumulation over any split equals one big batch.
"""

from __future__ import annotations

import numpy as np
import torch

from flexmarl.config.schema import AlgorithmConfig


def group_advantages(rewards: list[float], cfg: AlgorithmConfig) -> list[float]:
    r = np.asarray(rewards, dtype=np.float64)
    centered = r - r.mean()
    if cfg.scale_by_std:
        centered = centered / (r.std() + cfg.adv_eps)
    return centered.tolist()


def entropy_coef(cfg: AlgorithmConfig, step: int) -> float:
    if cfg.entropy_decay_steps is None:
        return cfg.entropy_coef
    return cfg.entropy_coef * max(0.0, 1.0 - step / cfg.entropy_decay_steps)


def loss(
    logp: torch.Tensor,  # [B, R] under the current weights
    old_logp: torch.Tensor,  # [B, R] recorded at generation
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, R]
    cfg: AlgorithmConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over rows of the per-row loss (not the mean: the trainer normalises at step time)."""
    tokens = mask.sum(-1).clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
    pg = -torch.minimum(surr1, surr2)
    per_row = (pg * mask).sum(-1) / tokens
    total = per_row.sum()
    metrics = {
        "loss/policy": float(per_row.detach().sum()),
        "clip_frac": float((((ratio - 1.0).abs() > cfg.clip_eps).float() * mask).sum()),
        "tokens": float(mask.sum()),
    }
    if ref_logp is not None and cfg.kl_coef > 0:
        delta = ref_logp - logp
        kl = (torch.exp(delta) - delta - 1.0) * mask
        kl_row = kl.sum(-1) / tokens
        total = total + cfg.kl_coef * kl_row.sum()
        metrics["kl"] = float(kl_row.detach().sum())
    else:
        metrics["kl"] = float((((old_logp - logp.detach()) * mask).sum(-1) / tokens).sum())
    if entropy is not None:
        ent_row = entropy.sum(-1) / tokens
        coef = entropy_coef(cfg, step)
        if coef > 0:
            total = total - coef * ent_row.sum()
        metrics["entropy"] = float(ent_row.detach().sum())
    return total, metrics
