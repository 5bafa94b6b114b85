"""Pieces every algorithm shares: KL estimators, the clipped surrogate, entropy and metrics.

Shapes: B rows (sequences) x R response tokens; `mask` is 1 where a response token exists.
Every algorithm returns the *sum over rows* of per-row losses (each row's loss is a mean over
its tokens): the trainer divides by the rows of the iteration batch at step time, so gradient
accumulation over any micro-batch split equals one big batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The metric names every algorithm reports (docs/design.md section 9); the trainer adds
# grad_norm, lr.
METRICS = ("loss/policy", "loss/value", "kl", "entropy", "clip_frac")


@dataclass
class LossInputs:
    logp: torch.Tensor  # [B, R] log-probs of the response tokens under the current weights
    old_logp: torch.Tensor  # [B, R] behaviour log-probs recorded at generation (the trainer's
    # weights when on-policy, one version older in one_step_off: see policy_loss)
    mask: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B] sequence advantages from the orchestrator (GRPO)
    rewards: torch.Tensor  # [B] the rows' scalar rewards (PPO, REINFORCE++)
    ref_logp: torch.Tensor | None = None  # [B, R] under the frozen reference
    entropy: torch.Tensor | None = None  # [B, R]
    values: torch.Tensor | None = None  # [B, R] critic values (PPO), with grad
    # a sum over the whole micro-batch when its rows are split over the ranks of a sharded
    # slot (batch statistics: `whiten`); None: this batch is the whole micro-batch
    total: Callable[[torch.Tensor], torch.Tensor] | None = None


def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's valid tokens: [B, R] -> [B]."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref on the sampled tokens: the per-token KL penalty of RLHF rewards."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 with d = log pi_ref - log pi: unbiased, always >= 0 (Schulman's k3)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def entropy_coef(cfg, step: int) -> float:
    if cfg.entropy_decay_steps is None:
        return cfg.entropy_coef
    return cfg.entropy_coef * max(0.0, 1.0 - step / cfg.entropy_decay_steps)


def rewards_as_advantages(rewards: list[float], cfg: object) -> list[float]:
    """Sequence advantages of a critic-free or critic-based algorithm without a group baseline:
    the rewards themselves (the critic or the batch normalisation supplies the baseline)."""
    return list(rewards)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scalar rewards placed on each row's last response token: [B, R]."""
    out = torch.zeros_like(mask)
    lengths = mask.sum(-1).long()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = rewards[rows].to(out.dtype)
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float,
           total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Normalise over all valid tokens of the batch (mean 0, std 1); `total`: the sums over
    the whole micro-batch when this is one rank's share of it (`LossInputs.total`)."""
    total = total or (lambda t: t)
    n = total(mask.sum()).clamp(min=1.0)
    mean = total((x * mask).sum()) / n
    var = total((((x - mean) * mask) ** 2).sum()) / n
    return (x - mean) / (var.sqrt() + eps) * mask


def clip_bounds(cfg) -> tuple[float, float]:
    """(low, high): the ratio is clipped to [1 - low, 1 + high] (clip-higher when they differ)."""
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    return cfg.clip_eps, high


def importance_ratio(inp: LossInputs, cfg) -> torch.Tensor:
    """pi_theta / pi_behaviour per token [B, R].

    `ratio_level: sequence` (GSPO): every token of a row carries the row's ratio
    s = exp(mean_t(logp - old_logp)), written as sg[s] * pi / sg[pi] so its gradient is GSPO's
    (the row's ratio times the token's score) while its value is s.
    """
    log_ratio = inp.logp - inp.old_logp
    if cfg.ratio_level == "token":
        return torch.exp(log_ratio)
    seq_log_ratio = row_mean(log_ratio, inp.mask).unsqueeze(1)
    token_log_ratio = seq_log_ratio.detach() + inp.logp - inp.logp.detach()
    return torch.exp(token_log_ratio) * inp.mask


def aggregate_rows(token_loss: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Per-row loss [B] from per-token losses: mean over the row's tokens (`sequence`) or
    their sum over the constant `loss_norm_tokens` (`token_sum_norm`, Dr. GRPO)."""
    if cfg.loss_agg == "token_sum_norm":
        return (token_loss * mask).sum(-1) / float(cfg.loss_norm_tokens)
    return row_mean(token_loss, mask)


def policy_loss(
    inp: LossInputs, token_adv: torch.Tensor, cfg, step: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with per-token advantages, plus KL (loss mode) and entropy bonus.

    The ratio is pi_theta / pi_behaviour with `old_logp` the log-probs recorded when the row
    was generated, not recomputed under the trainer's weights before the step. On-policy the
    two coincide (ratio 1 at the first forward); in `pipeline.mode: one_step_off` a row comes
    from the version one step older than the trainer, and this clipped ratio is exactly the
    importance correction of one-step off-policy PPO/GRPO (grpo, ppo and reinforce_pp all use
    this function).
    """
    mask = inp.mask
    ratio = importance_ratio(inp, cfg)
    low, high = clip_bounds(cfg)
    surr1 = ratio * token_adv
    surr2 = ratio.clamp(1.0 - low, 1.0 + high) * token_adv
    pg_row = aggregate_rows(-torch.minimum(surr1, surr2), mask, cfg)
    total = pg_row.sum()
    metrics = {
        "loss/policy": float(pg_row.detach().sum()),
        "loss/value": 0.0,
        "clip_frac": float((((ratio < 1.0 - low) | (ratio > 1.0 + high)).float() * mask).sum()),
        "tokens": float(mask.sum()),
    }
    if inp.ref_logp is not None and cfg.kl_coef > 0:
        kl_row = row_mean(kl_k3(inp.logp, inp.ref_logp), mask)
        if cfg.kl_mode == "loss":
            total = total + cfg.kl_coef * kl_row.sum()
        metrics["kl"] = float(kl_row.detach().sum())
    else:  # no reference: report the drift from the generating weights
        metrics["kl"] = float(row_mean(inp.old_logp - inp.logp.detach(), mask).sum())
    metrics["entropy"] = 0.0
    if inp.entropy is not None:
        ent_row = row_mean(inp.entropy, mask)
        coef = entropy_coef(cfg, step)
        if coef > 0:
            total = total - coef * ent_row.sum()
        metrics["entropy"] = float(ent_row.detach().sum())
    return total, metrics


def reward_kl(inp: LossInputs, cfg) -> torch.Tensor:
    """Per-token KL penalty -kl_coef * (log pi_old - log pi_ref) when kl_mode is 'reward'."""
    if cfg.kl_mode != "reward" or cfg.kl_coef <= 0 or inp.ref_logp is None:
        return torch.zeros_like(inp.mask)
    return -cfg.kl_coef * kl_k1(inp.old_logp, inp.ref_logp).detach() * inp.mask
