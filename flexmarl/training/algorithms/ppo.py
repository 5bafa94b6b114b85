"""PPO with a critic and GAE over the response tokens (Schulman et al., 2017; Ouyang et al., 2022).

Read top to bottom:
1. the critic gives a value V_t for the state before each response token: a linear value head
   on the policy's last hidden states (`critic: head`) or a separate model (`critic: separate`);
2. token rewards: the row's scalar reward on its last token, plus the per-token KL penalty
   with `kl_mode: reward`;
3. GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lambda)^l delta_{t+l},
   returns = A + V. The values used here are the critic's at the weights that generated the rows
   (the trainer steps once per iteration, so they are the current forward's values, detached);
4. optional whitening of A over the batch's tokens, then the clipped surrogate
   (common.policy_loss) plus value_coef * 0.5 (V - returns)^2 averaged over each row's tokens.
"""

from __future__ import annotations

import torch

from flexmarl.config.schema import PPOConfig
from flexmarl.training.algorithms.common import (
    LossInputs,
    last_token_rewards,
    policy_loss,
    reward_kl,
    rewards_as_advantages,
    row_mean,
    whiten,
)

# No group baseline: the critic is the baseline.
sequence_advantages = rewards_as_advantages


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, R]; V after a row's last token is 0 (episode ends)."""
    values = values * mask
    adv = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
        next_value = values[:, t]
    return adv, (adv + values) * mask


def rows_independent(cfg: PPOConfig) -> bool:
    """Without whitening each row's loss is its own; whitening takes statistics over the
    micro-batch's tokens, which a split into sub-batches would change."""
    return not cfg.whiten_advantages


def loss(inp: LossInputs, cfg: PPOConfig, step: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    if inp.values is None:
        raise ValueError("ppo.loss needs critic values")
    old_values = inp.values.detach()
    rewards = last_token_rewards(inp.rewards, inp.mask) + reward_kl(inp, cfg)
    adv, returns = gae(rewards, old_values, inp.mask, cfg.gamma, cfg.gae_lambda)
    if cfg.whiten_advantages:
        adv = whiten(adv, inp.mask, cfg.adv_eps, inp.total)
    total, metrics = policy_loss(inp, adv.detach(), cfg, step)
    v_row = row_mean(0.5 * (inp.values - returns.detach()) ** 2, inp.mask)
    total = total + cfg.value_coef * v_row.sum()
    metrics["loss/value"] = float(v_row.detach().sum())
    return total, metrics


__all__ = ["gae", "loss", "rows_independent", "sequence_advantages"]
