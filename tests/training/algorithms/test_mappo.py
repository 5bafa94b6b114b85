"""MAPPO / IPPO pieces against hand-computed cases: GAE with episode ends, the clipped
surrogate, the clipped Huber value loss, the value normaliser, the critic's inputs."""

from __future__ import annotations

import numpy as np
import torch

from flexmarl.training.algorithms import ippo, mappo
from flexmarl.training.algorithms.mappo import MappoConfig


def test_gae_hand_computed_with_an_episode_end() -> None:
    r = torch.tensor([[1.0], [0.0], [2.0]])
    v = torch.tensor([[0.5], [0.2], [0.1]])
    d = torch.tensor([[0.0], [1.0], [0.0]])
    last = torch.tensor([0.3])
    g, lam = 0.9, 0.8
    # t=2: delta = 2 + 0.9*0.3 - 0.1 = 2.17, A2 = 2.17
    # t=1 (done): delta = 0 - 0.2 = -0.2, A1 = -0.2 (trace cut)
    # t=0: delta = 1 + 0.9*0.2 - 0.5 = 0.68, A0 = 0.68 + 0.72*(-0.2) = 0.536
    adv, ret = mappo.gae(r, v, d, last, g, lam)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.536, -0.2, 2.17]))
    torch.testing.assert_close(ret[:, 0], torch.tensor([1.036, 0.0, 2.27]))


def test_policy_loss_hand_computed() -> None:
    cfg = MappoConfig(clip_eps=0.2, entropy_coef=0.1)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.9, 1.1]]))  # ratios 1.5, 0.9, 1.1
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    ent = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third step is a dead agent's: ignored
    loss, m = mappo.policy_loss(logp, old, adv, ent, mask, cfg)
    # surrogates: min(1.5, 1.2)*1 = 1.2; min(0.9*-2, 0.9*-2) = -1.8 -> mean -0.3 -> pg 0.3
    assert abs(m["loss/policy"] - (-(1.2 - 1.8) / 2)) < 1e-6
    assert abs(m["entropy"] - 1.5) < 1e-6
    assert abs(float(loss) - (0.3 - 0.1 * 1.5)) < 1e-6
    assert abs(m["clip_frac"] - 0.5) < 1e-6  # 1.5 is clipped, 0.9 is not


def test_value_loss_clipped_huber_hand_computed() -> None:
    cfg = MappoConfig(clip_eps=0.2, huber_delta=1.0, clip_value=True)
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    target = torch.tensor([[3.0, 0.5]])
    mask = torch.ones(1, 2)
    # step 0: unclipped error 2 -> huber 1*(2-0.5) = 1.5; clipped value 0.7, error 2.3 -> 1.8
    #   max = 1.8; step 1: error 0.5 -> 0.125 both ways
    out = mappo.value_loss(v, old, target, mask, cfg)
    assert abs(float(out) - (1.8 + 0.125) / 2) < 1e-6
    sq = mappo.value_loss(v, old, target, mask, MappoConfig(huber_delta=None, clip_value=False))
    assert abs(float(sq) - (0.5 * 4 + 0.5 * 0.25) / 2) < 1e-6


def test_value_norm_debiased_statistics() -> None:
    vn = mappo.ValueNorm(beta=0.9)
    x = torch.tensor([1.0, 3.0])
    vn.update(x)  # debiased: exactly the batch's mean and (clamped) variance
    mean, var = vn.stats()
    assert abs(float(mean) - 2.0) < 1e-9 and abs(float(var) - 1.0) < 1e-9
    vn.update(torch.tensor([5.0, 7.0]))
    # EMA with weights 0.1*0.9 and 0.1, over debias 0.19
    m = (0.09 * 2 + 0.1 * 6) / 0.19
    assert abs(float(vn.stats()[0]) - m) < 1e-9
    y = torch.tensor([0.3, -1.2])
    torch.testing.assert_close(vn.denormalize(vn.normalize(y)), y)


def test_critic_inputs_mappo_vs_ippo() -> None:
    own = np.ones((2, 3))
    state = np.full((2, 5), 2.0)
    obs = [np.ones((2, 3)), np.zeros((2, 4))]
    assert ippo.critic_features("ippo", None, own, state, obs) is own
    assert ippo.critic_features("mappo", "state", own, state, obs) is state
    assert ippo.critic_features("mappo", "concat_obs", own, state, obs).shape == (2, 7)
