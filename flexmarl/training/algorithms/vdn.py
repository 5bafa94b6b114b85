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

import torch
from torch import nn

# VdnConfig is the config schema's (an environment run's agents name it); kept importable
# from here, beside the algorithm
from flexmarl.config.schema import VdnConfig

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


__all__ = ["METRICS", "QNet", "VdnConfig", "epsilon", "loss", "td_targets"]
