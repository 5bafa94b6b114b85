"""QMIX (Rashid et al., 2018): VDN's learner with a monotonic mixing network in place of the sum.

Read top to bottom:
1. per-agent Q_a(o_a, .) as in `vdn.py` (shared network, agent id in its input);
2. Q_tot(o, u, s) = w2(s)^T elu(W1(s)^T q + b1(s)) + V(s), q = [Q_1(o_1, u_1), ..., Q_N];
   the mixing weights W1 [N, E] and w2 [E] come from hypernetworks of the global state s and
   pass through abs(), so dQ_tot / dQ_a >= 0 for every agent: the argmax of Q_tot is each
   agent's own argmax (decentralised greedy execution stays consistent with the team value);
   the biases b1 and V(s) are unconstrained;
3. double-Q target: y = r + gamma (1 - done) Q'_tot(Q'_a(o'_a, argmax_u Q_a(o'_a, u)), s'),
   with target copies of both the agent network and the mixer;
4. loss = mean_i w_i * huber(Q_tot_i - y_i), w_i the replay table's age weight, as VDN's.
Off-policy, over the same replay table; the on-policy consistency contract does not apply.
"""

from __future__ import annotations

import torch
from torch import nn


class QMixer(nn.Module):
    """Hypernetworks of the state: `hypernet_layers` 1 (a linear map) or 2 (with a ReLU
    hidden layer of `hypernet_embed` units), pymarl's two variants."""

    def __init__(self, n_agents: int, state_dim: int, embed: int = 32,
                 hypernet_layers: int = 2, hypernet_embed: int = 64) -> None:
        super().__init__()
        if hypernet_layers not in (1, 2):
            raise ValueError(f"algorithm.hypernet_layers must be 1 or 2, got {hypernet_layers}")
        self.n_agents, self.state_dim, self.embed = n_agents, state_dim, embed

        def hyper(out: int) -> nn.Module:
            if hypernet_layers == 1:
                return nn.Linear(state_dim, out)
            return nn.Sequential(nn.Linear(state_dim, hypernet_embed), nn.ReLU(),
                                 nn.Linear(hypernet_embed, out))

        self.hyper_w1 = hyper(n_agents * embed)
        self.hyper_w2 = hyper(embed)
        self.hyper_b1 = nn.Linear(state_dim, embed)
        self.v = nn.Sequential(nn.Linear(state_dim, embed), nn.ReLU(), nn.Linear(embed, 1))

    def weights(self, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """W1 [B, N, E] >= 0, b1 [B, 1, E], w2 [B, E, 1] >= 0, V [B] for states [B, S]."""
        B = state.shape[0]
        w1 = self.hyper_w1(state).abs().view(B, self.n_agents, self.embed)
        b1 = self.hyper_b1(state).view(B, 1, self.embed)
        w2 = self.hyper_w2(state).abs().view(B, self.embed, 1)
        return w1, b1, w2, self.v(state).view(B)

    def forward(self, q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Chosen-action values q [B, N] and states [B, S] -> Q_tot [B]."""
        w1, b1, w2, v = self.weights(state)
        hidden = nn.functional.elu(torch.bmm(q.unsqueeze(1), w1) + b1)  # [B, 1, E]
        return torch.bmm(hidden, w2).view(-1) + v


def td_targets(q_next_online: torch.Tensor, q_next_target: torch.Tensor,
               reward: torch.Tensor, done: torch.Tensor, gamma: float,
               target_mixer: QMixer, next_state: torch.Tensor,
               next_alive: torch.Tensor | None = None) -> torch.Tensor:
    """Double-Q QMIX targets. q_next_*: [B, N, A] (masked), next_state [B, S] -> [B].
    `next_alive` [B, N]: an agent that has left enters the mixer with Q = 0."""
    best = q_next_online.argmax(-1, keepdim=True)
    chosen = q_next_target.gather(-1, best).squeeze(-1)  # [B, N]
    if next_alive is not None:
        chosen = chosen * next_alive
    return reward + gamma * (1.0 - done) * target_mixer(chosen, next_state)


def loss(q: torch.Tensor, actions: torch.Tensor, targets: torch.Tensor,
         weights: torch.Tensor, mixer: QMixer, state: torch.Tensor,
         alive: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, N, A], actions [B, N], state [B, S] -> (age-weighted Huber loss, TD errors [B]).
    `alive` [B, N]: an agent that did not act enters the mixer with Q = 0."""
    chosen = q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    if alive is not None:
        chosen = chosen * alive
    q_tot = mixer(chosen, state)
    td = q_tot - targets.detach()
    per = torch.nn.functional.huber_loss(q_tot, targets.detach(), reduction="none")
    return (weights * per).mean(), td.detach()


__all__ = ["QMixer", "loss", "td_targets"]
