"""Non-LLM policies for classic MARL: MLP / GRU actors, categorical and diagonal-Gaussian
heads, a value critic, running observation normalisation, optional parameter sharing.

One `NetPolicy` serves one or several agents (parameter sharing: the agent's one-hot id is
appended to its observation). Everything the policy's outputs depend on (weights and the
observation statistics) is its *version*: the statistics change only when the trainer steps,
never during a rollout, so the log-probs a rollout records are exactly those the trainer
recomputes at the first epoch (ratio 1, on-policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flexmarl.envs.spaces import ActionSpec


class RunningMeanStd(nn.Module):
    """Per-feature running mean/variance (Chan et al.'s parallel update); `normalize` clips
    to +-clip so one wild observation cannot blow up a gradient (the enterprise document's
    troubleshooting table: exploding gradients from unnormalised observations)."""

    mean: torch.Tensor  # registered buffers, declared for the type checker
    var: torch.Tensor
    count: torch.Tensor

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0.0, dtype=torch.float64))
        self.clip, self.eps = clip, eps

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        if x.shape[0] == 0:
            return
        b_mean, b_var, b_n = x.mean(0), x.var(0, unbiased=False), float(x.shape[0])
        n = float(self.count)
        total = n + b_n
        delta = b_mean - self.mean
        self.mean += delta * b_n / total
        m2 = self.var * n + b_var * b_n + delta.pow(2) * n * b_n / total
        self.var.copy_(m2 / total)
        self.count.fill_(total)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if float(self.count) == 0:
            return x
        out = (x - self.mean.to(x.dtype)) / torch.sqrt(self.var.to(x.dtype) + self.eps)
        return out.clamp(-self.clip, self.clip)


def mlp(in_dim: int, hidden: list[int], activation: str, layer_norm: bool = False,
        orthogonal: bool = False) -> tuple[nn.Sequential, int]:
    """Linear + activation layers. `layer_norm`: the on-policy MAPPO code's MLPBase (a
    LayerNorm on the input, "feature normalisation", and one after each activation);
    `orthogonal`: its weight init (orthogonal, the activation's gain, zero bias)."""
    act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
    gain = {"tanh": 5.0 / 3, "relu": 2.0**0.5}[activation]  # torch's calculate_gain
    layers: list[nn.Module] = [nn.LayerNorm(in_dim)] if layer_norm else []
    for h in hidden:
        lin = nn.Linear(in_dim, h)
        if orthogonal:
            nn.init.orthogonal_(lin.weight, gain=gain)
            nn.init.zeros_(lin.bias)
        layers += [lin, act()] + ([nn.LayerNorm(h)] if layer_norm else [])
        in_dim = h
    return nn.Sequential(*layers), in_dim


class ActionDist:
    """The head's distribution over one action row: categorical (one or several, masked) or a
    diagonal Gaussian. log_prob / entropy sum over an action's components."""

    def __init__(self, spec: ActionSpec, out: torch.Tensor, log_std: torch.Tensor | None,
                 mask: torch.Tensor | None) -> None:
        self.spec = spec
        if spec.kind == "box":
            assert log_std is not None
            self.normal = torch.distributions.Normal(out, log_std.exp().expand_as(out))
            return
        if mask is not None:
            out = out.masked_fill(~mask, torch.finfo(out.dtype).min)
        self.cats = [torch.distributions.Categorical(logits=part)
                     for part in torch.split(out, list(spec.nvec), dim=-1)]

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.spec.kind == "box":
            noise = torch.randn(self.normal.mean.shape, generator=generator)
            return self.normal.mean + self.normal.stddev * noise
        cols = [torch.multinomial(c.probs.reshape(-1, c.probs.shape[-1]), 1,
                                  generator=generator).reshape(c.probs.shape[:-1])
                for c in self.cats]
        return torch.stack(cols, -1).to(torch.float32)

    def mode(self) -> torch.Tensor:
        if self.spec.kind == "box":
            return self.normal.mean
        return torch.stack([c.probs.argmax(-1) for c in self.cats], -1).to(torch.float32)

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "box":
            return self.normal.log_prob(action).sum(-1)
        return sum(c.log_prob(action[..., i].long()) for i, c in enumerate(self.cats))

    def entropy(self) -> torch.Tensor:
        if self.spec.kind == "box":
            return self.normal.entropy().sum(-1)
        return sum(c.entropy() for c in self.cats)


@dataclass
class NetConfigView:
    kind: str  # mlp | gru
    hidden: list[int]
    activation: str
    gru_hidden: int
    layer_norm: bool = False
    orthogonal: bool = False


class Actor(nn.Module):
    """MLP or GRU trunk + linear head. The GRU's hidden state is carried through an episode
    and zeroed at its first step (`starts`)."""

    def __init__(self, in_dim: int, spec: ActionSpec, net: NetConfigView) -> None:
        super().__init__()
        self.spec, self.kind = spec, net.kind
        self.trunk, out_dim = mlp(in_dim, net.hidden, net.activation, net.layer_norm,
                                  net.orthogonal)
        self.hidden_size = net.gru_hidden if net.kind == "gru" else 0
        if net.kind == "gru":
            self.gru = nn.GRUCell(out_dim, net.gru_hidden)
            out_dim = net.gru_hidden
        self.head = nn.Linear(out_dim, spec.logits_dim)
        nn.init.orthogonal_(self.head.weight, gain=0.01)
        nn.init.zeros_(self.head.bias)
        self.log_std = nn.Parameter(torch.full((spec.dim,), -0.5)) if spec.kind == "box" else None

    def step(self, x: torch.Tensor, h: torch.Tensor | None, starts: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step for a batch: x [B, D], h [B, H] -> head output [B, L], new h."""
        z = self.trunk(x)
        if self.kind == "gru":
            assert h is not None
            if starts is not None:
                h = h * (~starts).unsqueeze(-1).to(h.dtype)
            h = self.gru(z, h)
            z = h
        return self.head(z), h

    def sequence(self, x: torch.Tensor, h0: torch.Tensor | None, starts: torch.Tensor
                 ) -> torch.Tensor:
        """A [T, B, D] sequence from hidden state h0 -> head outputs [T, B, L]."""
        if self.kind != "gru":
            return self.head(self.trunk(x))
        outs, h = [], h0
        for t in range(x.shape[0]):
            out, h = self.step(x[t], h, starts[t])
            outs.append(out)
        return torch.stack(outs)

    def dist(self, out: torch.Tensor, mask: torch.Tensor | None) -> ActionDist:
        return ActionDist(self.spec, out, self.log_std, mask)


class Critic(nn.Module):
    def __init__(self, in_dim: int, net: NetConfigView) -> None:
        super().__init__()
        self.trunk, out_dim = mlp(in_dim, net.hidden, net.activation, net.layer_norm,
                                  net.orthogonal)
        self.head = nn.Linear(out_dim, 1)
        if net.orthogonal:
            nn.init.orthogonal_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x)).squeeze(-1)


class NetPolicy(nn.Module):
    """Actor + critic of one policy, serving `agents` (several: parameter sharing).

    Actor input: the (normalised) observation, zero-padded to the largest of its agents,
    plus the agent's one-hot id when shared. Critic input: `critic_dim` features (the global
    state or concatenated observations for MAPPO, the actor's input for IPPO), normalised
    the same way, plus the agent id when shared.
    """

    def __init__(self, agents: list[str], obs_dim: int, critic_dim: int, spec: ActionSpec,
                 net: NetConfigView, obs_norm: bool) -> None:
        super().__init__()
        self.agents = list(agents)
        self.obs_dim, self.critic_dim = obs_dim, critic_dim
        self.id_dim = len(agents) if len(agents) > 1 else 0
        self.obs_norm = RunningMeanStd(obs_dim) if obs_norm else None
        self.critic_norm = RunningMeanStd(critic_dim) if obs_norm else None
        self.actor = Actor(obs_dim + self.id_dim, spec, net)
        self.critic = Critic(critic_dim + self.id_dim, net)

    def _with_id(self, x: torch.Tensor, agent_ids: torch.Tensor) -> torch.Tensor:
        if not self.id_dim:
            return x
        onehot = torch.nn.functional.one_hot(agent_ids, self.id_dim).to(x.dtype)
        return torch.cat([x, onehot.expand(*x.shape[:-1], self.id_dim)], -1)

    def actor_input(self, obs: torch.Tensor, agent_ids: torch.Tensor) -> torch.Tensor:
        if self.obs_norm is not None:
            obs = self.obs_norm.normalize(obs)
        return self._with_id(obs, agent_ids)

    def critic_input(self, x: torch.Tensor, agent_ids: torch.Tensor) -> torch.Tensor:
        if self.critic_norm is not None:
            x = self.critic_norm.normalize(x)
        return self._with_id(x, agent_ids)

    def value(self, x: torch.Tensor, agent_ids: torch.Tensor) -> torch.Tensor:
        return self.critic(self.critic_input(x, agent_ids))

    @torch.no_grad()
    def update_stats(self, obs: torch.Tensor, critic_x: torch.Tensor) -> None:
        """Fold one iteration's inputs into the running statistics (the next version's)."""
        if self.obs_norm is not None and self.critic_norm is not None:
            self.obs_norm.update(obs)
            self.critic_norm.update(critic_x)
