"""VDN (Sunehag et al., 2018): value decomposition for cooperative agents, off-policy.

Read top to bottom:
1. one Q-network per policy (shared across agents by default, the agent's one-hot id in its
   input) gives Q_a(o_a, .) over agent a's discrete actions; illegal actions are masked;
2. the team's value is the sum: Q_tot(o, u) = sum_a Q_a(o_a, u_a), trained on the team reward
   (the mean of the agents' rewards);
3. double-Q target: y = r + gamma (1 - done) sum_a Q'_a(o'_a, argmax_u Q_a(o'_a, u)), with Q'
   a target network copied every `target_every` updates;
4. loss = mean_i w_i * huber(Q_tot_i - y_i), with w_i the replay table's age weight
   1 / (1 + log(age)) (flexmarl/store/replay.py); the new |TD errors| become the priorities.
Behaviour: epsilon-greedy, epsilon decaying linearly from 1 to `eps_end` over
`eps_decay_steps` environment steps.

Off-policy: the rows come from the replay table, not from iteration k; the on-policy
consistency contract does not apply (docs/marl.md).
Metric names: loss/value (the TD loss), q_mean, td_abs_mean, epsilon, grad_norm, lr.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from flexmarl.config.schema import Strict


class VdnConfig(Strict):
    """VDN (sum of agent values) or QMIX (monotonic mixing network of the global state), with
    a prioritized, age-weighted replay table (off-policy; docs/marl.md)."""

    name: Literal["vdn", "qmix"] = "vdn"
    # QMIX's mixer (training/algorithms/qmix.py): embedding width, hypernetwork depth (1 or 2)
    # and hidden width
    mixing_embed: int = Field(32, gt=0)
    hypernet_layers: Literal[1, 2] = 2
    hypernet_embed: int = Field(64, gt=0)
    lr: float = Field(5e-4, gt=0)
    gamma: float = Field(0.99, ge=0, le=1)
    batch_size: int = Field(256, gt=0)
    updates_per_step: int = Field(1, gt=0)  # gradient steps per vectorised env step
    target_every: int = Field(200, gt=0)  # updates between target-network copies
    eps_end: float = Field(0.05, ge=0, le=1)
    eps_decay_steps: int = Field(100_000, gt=0)  # env steps
    max_grad_norm: float | None = Field(10.0, gt=0)
    # the replay table (the enterprise document's configuration)
    capacity: int = Field(100_000, gt=0)
    min_size: int = Field(5000, gt=0)
    prioritized: bool = True
    priority_fraction: float = Field(0.15, ge=0, le=1)  # of each batch, drawn by priority
    priority_alpha: float = Field(0.6, ge=0)
    age_weight: bool = True  # w = 1 / (1 + log(age)) on each sampled row's loss

    @model_validator(mode="after")
    def _sizes(self) -> VdnConfig:
        if self.capacity < self.min_size:
            raise ValueError(f"capacity ({self.capacity}) must be >= min_size "
                             f"({self.min_size})")
        return self


METRICS = ("loss/value", "q_mean", "td_abs_mean", "grad_norm", "lr")


class QNet(nn.Module):
    def __init__(self, in_dim: int, n_actions: int, hidden: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.ReLU()]
            in_dim = h
        self.body = nn.Sequential(*layers, nn.Linear(in_dim, n_actions))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.body(x)
        if mask is not None:
            q = q.masked_fill(~mask, -1e9)
        return q


def td_targets(q_next_online: torch.Tensor, q_next_target: torch.Tensor,
               reward: torch.Tensor, done: torch.Tensor, gamma: float,
               next_alive: torch.Tensor | None = None) -> torch.Tensor:
    """Double-Q VDN targets. q_next_*: [B, N, A] (masked), reward/done: [B] -> [B].
    `next_alive` [B, N] (1/0): agents with a future at the next step (present, or cut by a
    time limit); an agent that has left adds nothing to the sum."""
    best = q_next_online.argmax(-1, keepdim=True)
    chosen = q_next_target.gather(-1, best).squeeze(-1)
    if next_alive is not None:
        chosen = chosen * next_alive
    return reward + gamma * (1.0 - done) * chosen.sum(-1)


def loss(q: torch.Tensor, actions: torch.Tensor, targets: torch.Tensor,
         weights: torch.Tensor, alive: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, N, A], actions [B, N] -> (age-weighted Huber loss, TD errors [B]). `alive`
    [B, N]: agents that acted at this step; the others' Q is left out of Q_tot."""
    chosen = q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    if alive is not None:
        chosen = chosen * alive
    q_tot = chosen.sum(-1)
    td = q_tot - targets.detach()
    per = torch.nn.functional.huber_loss(q_tot, targets.detach(), reduction="none")
    return (weights * per).mean(), td.detach()


def epsilon(step: int, eps_end: float, decay_steps: int) -> float:
    return max(eps_end, 1.0 - (1.0 - eps_end) * step / max(decay_steps, 1))


__all__ = ["METRICS", "QNet", "epsilon", "loss", "td_targets"]
