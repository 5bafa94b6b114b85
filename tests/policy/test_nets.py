"""Network policies: running statistics, masked / multi-discrete / Gaussian heads, GRU resets,
parameter sharing by agent id."""

from __future__ import annotations

import math

import numpy as np
import torch

from flexmarl.envs.spaces import ActionSpec
from flexmarl.policy.nets import ActionDist, Actor, NetConfigView, NetPolicy, RunningMeanStd

MLP = NetConfigView("mlp", [16], "tanh", 8)
GRU = NetConfigView("gru", [16], "tanh", 8)


def test_running_mean_std_matches_numpy_over_batches() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(3, 2, (50, 4)), rng.normal(-1, 0.5, (30, 4))
    rms = RunningMeanStd(4)
    rms.update(torch.tensor(a))
    rms.update(torch.tensor(b))
    both = np.concatenate([a, b])
    np.testing.assert_allclose(rms.mean.numpy(), both.mean(0), rtol=1e-10)
    np.testing.assert_allclose(rms.var.numpy(), both.var(0), rtol=1e-10)
    x = torch.tensor(both, dtype=torch.float32)
    z = rms.normalize(x)
    np.testing.assert_allclose(z.mean(0).numpy(), 0, atol=1e-5)
    assert float(rms.normalize(torch.full((1, 4), 1e6)).max()) == 10.0  # clipped


def test_categorical_mask_and_multi_discrete_log_prob() -> None:
    spec = ActionSpec("multi_discrete", nvec=(3, 2))
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -0.5]])
    mask = torch.tensor([[True, False, True, True, True]])
    d = ActionDist(spec, logits, None, mask)
    g = torch.Generator().manual_seed(0)
    samples = torch.cat([d.sample(g) for _ in range(200)])
    assert not (samples[:, 0] == 1).any()  # masked action never sampled
    # hand-computed: log softmax over the unmasked {0, 2} and over {0.5, -0.5}
    lp = d.log_prob(torch.tensor([[2.0, 1.0]]))
    expected = (2.0 - math.log(math.exp(0) + math.exp(2))) + (-0.5 - math.log(
        math.exp(0.5) + math.exp(-0.5)))
    assert abs(float(lp) - expected) < 1e-6


def test_gaussian_head_log_prob_and_entropy() -> None:
    spec = ActionSpec("box", dim=2, low=(-1, -1), high=(1, 1))
    mean, log_std = torch.tensor([[0.1, -0.2]]), torch.tensor([0.0, math.log(0.5)])
    d = ActionDist(spec, mean, log_std, None)
    a = torch.tensor([[0.3, 0.0]])
    hand = sum(-0.5 * ((x - m) / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi)
               for x, m, s in ((0.3, 0.1, 1.0), (0.0, -0.2, 0.5)))
    assert abs(float(d.log_prob(a)) - hand) < 1e-6
    hand_ent = sum(0.5 + 0.5 * math.log(2 * math.pi) + math.log(s) for s in (1.0, 0.5))
    assert abs(float(d.entropy()) - hand_ent) < 1e-6


def test_gru_hidden_state_carried_and_reset_at_episode_start() -> None:
    torch.manual_seed(0)
    actor = Actor(3, ActionSpec("discrete", nvec=(4,)), GRU)
    x = torch.randn(6, 2, 3)
    starts = torch.zeros(6, 2, dtype=torch.bool)
    starts[0] = True
    starts[3, 0] = True  # env 0 starts a new episode at t=3
    h0 = torch.randn(2, 8)
    out = actor.sequence(x, h0, starts)
    # the episode starting at t=3 equals a fresh sequence from a zero state
    first = torch.zeros(3, 1, dtype=torch.bool)
    first[0] = True
    fresh = actor.sequence(x[3:, :1], torch.zeros(1, 8), first)
    torch.testing.assert_close(out[3:, :1], fresh)
    # env 1 carries its state: replaying t=3.. from scratch differs
    no_carry = actor.sequence(x[3:, 1:], torch.zeros(1, 8), first)
    assert not torch.allclose(out[3:, 1:], no_carry)
    # step-by-step (rollout) equals the sequence (training)
    h, steps = h0, []
    for t in range(6):
        o, h = actor.step(x[t], h, starts[t])
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps), out)


def test_parameter_sharing_appends_agent_id() -> None:
    pol = NetPolicy(["a", "b", "c"], 4, 6, ActionSpec("discrete", nvec=(5,)), MLP, False)
    x = pol.actor_input(torch.zeros(2, 4), torch.tensor([0, 2]))
    assert x.shape == (2, 7) and x[0, 4:].tolist() == [1, 0, 0] and x[1, 4:].tolist() == [0, 0, 1]
    solo = NetPolicy(["a"], 4, 6, ActionSpec("discrete", nvec=(5,)), MLP, True)
    assert solo.actor_input(torch.zeros(2, 4), torch.tensor([0, 0])).shape == (2, 4)


def test_layer_norm_and_orthogonal_init_follow_the_on_policy_mlp() -> None:
    """`layer_norm`: an input LayerNorm makes the actor blind to a common shift and scale of its
    input vector (the on-policy code's feature normalisation); `orthogonal`: hidden weights
    with orthonormal rows times the ReLU gain."""
    torch.manual_seed(0)
    spec = ActionSpec("discrete", nvec=(5,))
    ln = Actor(6, spec, NetConfigView("mlp", [4, 4], "relu", 8, layer_norm=True,
                                      orthogonal=True))
    x = torch.randn(3, 6)
    torch.testing.assert_close(ln.sequence(x, None, torch.zeros(3, dtype=torch.bool)),
                               ln.sequence(3.0 * x - 2.0, None, torch.zeros(3, dtype=torch.bool)))
    plain = Actor(6, spec, NetConfigView("mlp", [4, 4], "relu", 8))
    assert not torch.allclose(plain.sequence(x, None, torch.zeros(3, dtype=torch.bool)),
                              plain.sequence(3.0 * x - 2.0, None,
                                             torch.zeros(3, dtype=torch.bool)))
    w = ln.trunk[1].weight  # [LayerNorm, Linear, ReLU, LayerNorm, ...]
    torch.testing.assert_close(w @ w.T, 2.0 * torch.eye(4), atol=1e-5, rtol=0)
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in ln.trunk) == 3
