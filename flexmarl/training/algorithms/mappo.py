"""MAPPO (Yu et al., 2022): PPO for cooperative agents with a centralised critic.

Read top to bottom:
1. rollout (flexmarl/marl/rollout.py, in a rollout worker) records, per agent and environment, T
   steps of observation, critic input (the global state, or concatenated observations;
   `ippo.py`: the agent's own observation), action, behaviour log-prob, the critic's output,
   reward, `done` (the agent's chain of nodes ends at this step) and `alive` (the agent acted at
   this step). A truncated chain gets gamma * V(final observation) added to its last reward, so
   a time limit is not mistaken for a terminal state;
2. value normalisation: the critic predicts returns in normalised units; `ValueNorm` keeps a
   debiased running mean and variance of the returns (the on-policy MAPPO code's scheme);
3. GAE over each chain: delta_t = r_t + gamma V_{t+1} (1 - done_t) - V_t,
   A_t = delta_t + gamma lambda (1 - done_t) A_{t+1}; returns = A + V (both unnormalised),
   advantages normalised over the iteration's live steps;
4. `epochs` passes over the iteration's rows, each split into `minibatches` (by chain, so a
   GRU replays a chain from its stored initial hidden state): clipped surrogate
   -min(r A, clip(r, 1-eps, 1+eps) A), minus entropy_coef * entropy, plus value_coef * a
   (clipped, Huber) error of the normalised value against the normalised return.

Consistency (docs/design.md section 5, extended): every epoch and every mini-batch of policy
p's update k draws only on the `PolicyBatch` built from iteration k's rows (taken from the
store once, checked against the version vector); `update` reports each row's sample id once
per epoch through `on_epoch`, the audit trail tests check.

Metric names are fixed: loss/policy, loss/value, entropy, kl, clip_frac, grad_norm, lr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# the config lives with the run config's other algorithm configs (agents with a `network`
# name it); kept importable from here, beside the algorithm
from flexmarl.config.schema import MappoConfig
from flexmarl.policy.nets import NetPolicy

METRICS = ("loss/policy", "loss/value", "entropy", "kl", "clip_frac", "grad_norm", "lr")


class ValueNorm(torch.nn.Module):
    """Debiased exponential running mean/variance of returns (beta close to 1)."""

    mean: torch.Tensor  # registered buffers, declared for the type checker
    mean_sq: torch.Tensor
    debias: torch.Tensor

    def __init__(self, beta: float = 0.99999, eps: float = 1e-5) -> None:
        super().__init__()
        self.beta, self.eps = beta, eps
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean_sq", torch.zeros((), dtype=torch.float64))
        self.register_buffer("debias", torch.zeros((), dtype=torch.float64))

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.debias.clamp(min=self.eps)
        mean, mean_sq = self.mean / d, self.mean_sq / d
        return mean, (mean_sq - mean**2).clamp(min=1e-2)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.to(torch.float64)
        self.mean.mul_(self.beta).add_((1 - self.beta) * x.mean())
        self.mean_sq.mul_(self.beta).add_((1 - self.beta) * (x**2).mean())
        self.debias.mul_(self.beta).add_(1 - self.beta)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.stats()
        return ((x - mean) / var.sqrt()).to(x.dtype)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.stats()
        return (x * var.sqrt() + mean).to(x.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor,
        last_values: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [T, B]; `values` V(s_t) and `last_values` V(s_T), unnormalised;
    done_t = 1 cuts both the bootstrap and the trace at step t."""
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(last_values)
    next_value = last_values
    for t in range(T - 1, -1, -1):
        cont = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * next_value * cont - values[t]
        running = delta + gamma * lam * cont * running
        adv[t] = running
        next_value = values[t]
    return adv, adv + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                entropy: torch.Tensor, mask: torch.Tensor, cfg: MappoConfig
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate minus the entropy bonus, averaged over live steps."""
    ratio = torch.exp(logp - old_logp)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    pg = -masked_mean(surr, mask)
    ent = masked_mean(entropy, mask)
    with torch.no_grad():
        kl = masked_mean((ratio - 1) - (logp - old_logp), mask)  # k3 estimator
        clip = masked_mean(((ratio - 1).abs() > cfg.clip_eps).float(), mask)
    return pg - cfg.entropy_coef * ent, {"loss/policy": float(pg.detach()),
                                         "entropy": float(ent.detach()),
                                         "kl": float(kl), "clip_frac": float(clip)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor,
               mask: torch.Tensor, cfg: MappoConfig) -> torch.Tensor:
    """(Clipped) Huber or squared error, all in normalised units when value_norm is on."""

    def err(v: torch.Tensor) -> torch.Tensor:
        e = targets - v
        if cfg.huber_delta is None:
            return 0.5 * e**2
        d = cfg.huber_delta
        return torch.where(e.abs() <= d, 0.5 * e**2, d * (e.abs() - 0.5 * d))

    loss = err(values)
    if cfg.clip_value:
        clipped = old_values + (values - old_values).clamp(-cfg.clip_eps, cfg.clip_eps)
        loss = torch.maximum(loss, err(clipped))
    return masked_mean(loss, mask)


@dataclass
class PolicyBatch:
    """One policy's rows of one iteration, as [T, B] arrays (B = environments x its agents)."""

    sample_ids: list[str]  # one per column
    iteration: int
    obs: torch.Tensor  # [T, B, D] raw
    critic_x: torch.Tensor  # [T, B, C] raw
    agent_ids: torch.Tensor  # [B]
    actions: torch.Tensor  # [T, B, A]
    action_mask: torch.Tensor | None  # [T, B, L] bool
    logp: torch.Tensor  # [T, B] behaviour log-probs
    values: torch.Tensor  # [T, B] critic outputs at rollout (normalised units)
    rewards: torch.Tensor  # [T, B]
    dones: torch.Tensor  # [T, B]
    alive: torch.Tensor  # [T, B]
    starts: torch.Tensor  # [T, B] bool: first step of an episode (GRU reset)
    h0: torch.Tensor | None  # [B, H]
    last_values: torch.Tensor  # [B] critic output for the state after step T-1
    adv: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def compute_advantages(batch: PolicyBatch, vnorm: ValueNorm, cfg: MappoConfig) -> None:
    """GAE with the rollout's values (denormalised), then update the value normaliser with
    this iteration's returns and normalise the advantages over live steps."""
    denorm = vnorm.denormalize if cfg.value_norm else (lambda x: x)
    adv, returns = gae(batch.rewards, denorm(batch.values), batch.dones,
                       denorm(batch.last_values), cfg.gamma, cfg.gae_lambda)
    if cfg.normalize_advantages:
        m = batch.alive
        mean = masked_mean(adv, m)
        std = masked_mean((adv - mean) ** 2, m).sqrt()
        adv = (adv - mean) / (std + 1e-8)
    batch.adv, batch.returns = adv * batch.alive, returns
    if cfg.value_norm:
        vnorm.update(returns[batch.alive.bool()])


def update(policy: NetPolicy, actor_opt: torch.optim.Optimizer,
           critic_opt: torch.optim.Optimizer, batch: PolicyBatch, vnorm: ValueNorm,
           cfg: MappoConfig, generator: torch.Generator,
           on_epoch: Callable[[int, list[str]], None] | None = None) -> dict[str, float]:
    """`epochs` x `minibatches` PPO steps on this iteration's batch only; metrics averaged."""
    assert batch.adv is not None and batch.returns is not None
    targets = vnorm.normalize(batch.returns) if cfg.value_norm else batch.returns
    B = batch.obs.shape[1]
    n_mb = min(cfg.minibatches, B)
    sums: dict[str, float] = dict.fromkeys(METRICS, 0.0)
    n = 0
    for epoch in range(cfg.epochs):
        if on_epoch is not None:
            on_epoch(epoch, batch.sample_ids)
        perm = torch.randperm(B, generator=generator)
        for cols in torch.chunk(perm, n_mb):
            mask = batch.alive[:, cols]
            x = policy.actor_input(batch.obs[:, cols], batch.agent_ids[cols])
            h0 = batch.h0[cols] if batch.h0 is not None else None
            out = policy.actor.sequence(x, h0, batch.starts[:, cols])
            am = batch.action_mask[:, cols] if batch.action_mask is not None else None
            dist = policy.actor.dist(out, am)
            logp = dist.log_prob(batch.actions[:, cols])
            pl, m = policy_loss(logp, batch.logp[:, cols], batch.adv[:, cols], dist.entropy(),
                                mask, cfg)
            v = policy.value(batch.critic_x[:, cols], batch.agent_ids[cols])
            vl = value_loss(v, batch.values[:, cols], targets[:, cols], mask, cfg)
            actor_opt.zero_grad()
            critic_opt.zero_grad()
            (pl + cfg.value_coef * vl).backward()
            params = [p for g in actor_opt.param_groups + critic_opt.param_groups
                      for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(
                params, cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf"))
            actor_opt.step()
            critic_opt.step()
            m.update({"loss/value": float(vl.detach()), "grad_norm": float(norm), "lr": cfg.lr})
            for k in METRICS:
                sums[k] += m[k]
            n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}


__all__ = ["METRICS", "PolicyBatch", "ValueNorm", "compute_advantages", "gae", "policy_loss",
           "update", "value_loss"]
