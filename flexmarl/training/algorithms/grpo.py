"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Read top to bottom:
1. the G trajectories sampled for one input form a group; each row's advantage is its reward
   minus the group mean, divided by the group std (Shao et al., 2024, DeepSeekMath); the
   orchestrator computes it when a group is complete (`sequence_advantages`). With
   `normalize: agent` the mean and std are those of all the agent's rows of the iteration
   (Dr. MAS's agent-wise normalisation), with `batch` those of every trainable agent's rows;
   both wait for the iteration's last episode (`normalized_advantages`). `agent_previous`
   takes the agent's mean and std of the previous iteration (`baseline_advantages`): no
   wait, and a signal even when a group's samples agree. `balance_labels` (with `agent`)
   weighs the true classes of the rows equally around their balanced mean
   (`label_balanced_advantages`);
2. every response token of a row carries the row's advantage; with `kl_mode: reward` the
   per-token KL penalty to the reference is added to it;
3. the loss of one row is the PPO clipped surrogate averaged over the row's tokens, plus the KL
   term (k3, `kl_mode: loss`) and minus the entropy bonus (common.policy_loss).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flexmarl.config.schema import GRPOConfig
from flexmarl.training.algorithms.common import LossInputs, entropy_coef, policy_loss, reward_kl

__all__ = ["baseline_advantages", "entropy_coef", "group_advantages", "label_balanced_advantages",
           "loss", "normalized_advantages", "reward_stats", "rows_independent",
           "sequence_advantages"]


def group_advantages(rewards: list[float], cfg: GRPOConfig) -> list[float]:
    """`normalize: group`: each reward against its own group's mean (and std)."""
    return normalized_advantages(rewards, rewards, cfg)


def normalized_advantages(rewards: list[float], reference: list[float],
                          cfg: GRPOConfig) -> list[float]:
    """(r - mean(reference)) / (std(reference) + eps) for each r of `rewards` (no division with
    `scale_by_std: false`). The reference is the group (`normalize: group`), all of the agent's
    rows of the iteration (`agent`) or every trainable agent's rows (`batch`)."""
    r = np.asarray(rewards, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    centered = r - ref.mean()
    if cfg.scale_by_std:
        centered = centered / (ref.std() + cfg.adv_eps)
    return centered.tolist()


sequence_advantages = group_advantages


def baseline_advantages(rewards: list[float], mean: float, std: float,
                        cfg: GRPOConfig) -> list[float]:
    """`normalize: agent_previous`: (r - mean) / (std + eps) against statistics known before
    the rewards (the agent's previous iteration)."""
    centered = np.asarray(rewards, dtype=np.float64) - mean
    if cfg.scale_by_std:
        centered = centered / (std + cfg.adv_eps)
    return centered.tolist()


def label_balanced_advantages(rewards: list[float], labels: list[str],
                              cfg: GRPOConfig) -> list[float]:
    """`balance_labels`: w_c * (r - b) / (std + eps) for a row of class c, where
    w_c = n / (C * n_c) (C classes among the n rows) gives every class the same total weight,
    b = sum(w * r) / n is the balanced mean (the mean of the classes' mean rewards) and std the
    weighted std around it. The estimator of balanced accuracy's gradient with one baseline for
    all rows: an agent answering one thing to every input (right on one class, wrong on the
    other) still gets a signal on each class, toward its own answer where that is right and away
    from it where it is wrong, which per-class baselines (each class all right or all wrong:
    every advantage 0) would not give."""
    r = np.asarray(rewards, dtype=np.float64)
    lab = np.asarray(labels, dtype=object)
    classes = sorted(set(labels))
    weight = np.empty_like(r)
    for c in classes:
        rows = lab == c
        weight[rows] = len(r) / (len(classes) * int(rows.sum()))
    centered = r - float(np.mean(weight * r))
    if cfg.scale_by_std:
        centered = centered / (math.sqrt(float(np.mean(weight * centered ** 2))) + cfg.adv_eps)
    return (weight * centered).tolist()


def reward_stats(rewards: list[float]) -> tuple[float, float]:
    """Mean and population std, exactly rounded sums (independent of the rewards' order)."""
    mean = math.fsum(rewards) / len(rewards)
    return mean, math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


def rows_independent(cfg: GRPOConfig) -> bool:
    """Each row's loss depends on that row alone (its advantage came with it), so the trainer
    may split a micro-batch into sub-batches by length and get the same sum."""
    return True


def loss(inp: LossInputs, cfg: GRPOConfig, step: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over rows of the per-row loss (not the mean: the trainer normalises at step time)."""
    token_adv = inp.advantages.unsqueeze(1) * inp.mask + reward_kl(inp, cfg)
    return policy_loss(inp, token_adv, cfg, step)
