"""REINFORCE++ (Hu, 2025): critic-free, with token-level KL in the reward and batch-normalised
advantages.

Read top to bottom:
1. token rewards: r_t = -kl_coef * (log pi_old(y_t) - log pi_ref(y_t)) on every token
   (`kl_mode: reward`, the default), plus the row's scalar reward on its last token;
2. returns G_t = sum_{s >= t} gamma^(s-t) r_s;
3. advantages are the returns normalised over all tokens of the batch (mean 0, std 1). The
   batch is the micro-batch the trainer receives (complete groups): gradients are accumulated
   as micro-batches arrive, so set `train.micro_batch_size` to the iteration's rows for global
   normalisation;
4. the PPO clipped surrogate on those advantages (common.policy_loss).
"""

from __future__ import annotations

import torch

from flexmarl.config.schema import ReinforcePPConfig
from flexmarl.training.algorithms.common import (
    LossInputs,
    last_token_rewards,
    policy_loss,
    reward_kl,
    rewards_as_advantages,
    whiten,
)

# No group baseline: the trainer normalises over the batch.
sequence_advantages = rewards_as_advantages


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    out = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = (token_rewards[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def advantages(inp: LossInputs, cfg: ReinforcePPConfig) -> torch.Tensor:
    rewards = last_token_rewards(inp.rewards, inp.mask) + reward_kl(inp, cfg)
    returns = discounted_returns(rewards, inp.mask, cfg.gamma)
    return whiten(returns, inp.mask, cfg.adv_eps, inp.total)


def rows_independent(cfg: ReinforcePPConfig) -> bool:
    """The returns are whitened over the micro-batch's tokens: its rows belong together."""
    return False


def loss(
    inp: LossInputs, cfg: ReinforcePPConfig, step: int = 0
) -> tuple[torch.Tensor, dict[str, float]]:
    return policy_loss(inp, advantages(inp, cfg).detach(), cfg, step)
