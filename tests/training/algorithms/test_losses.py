"""Each algorithm's loss on small cases worked out by hand."""

import math

import pytest
import torch

from flexmarl.config.schema import GRPOConfig, OptimConfig, PPOConfig, ReinforcePPConfig
from flexmarl.training.algorithms import common, grpo, ppo, reinforce_pp
from flexmarl.training.trainer import lr_factor


def _inputs(logp, old, mask, adv=None, rewards=None, ref=None, values=None):
    logp, old, mask = (torch.tensor(x, dtype=torch.float32) for x in (logp, old, mask))
    b = logp.shape[0]
    return common.LossInputs(
        logp=logp, old_logp=old, mask=mask,
        advantages=torch.tensor(adv if adv is not None else [0.0] * b),
        rewards=torch.tensor(rewards if rewards is not None else [0.0] * b),
        ref_logp=None if ref is None else torch.tensor(ref, dtype=torch.float32),
        values=None if values is None else torch.tensor(values, requires_grad=True),
    )


def test_grpo_group_advantages_and_clipped_loss():
    assert grpo.group_advantages([1, 0, 0, 1], GRPOConfig(adv_eps=1e-12)) == pytest.approx(
        [1, -1, -1, 1])
    # row 0 on-policy with A=2 -> -2; row 1 ratio 1.5 (clipped to 1.2) with A=1 -> -1.2
    inp = _inputs([[0.0, 0.0], [math.log(1.5), 0.0]], [[0.0, 0.0], [0.0, 0.0]],
                  [[1, 1], [1, 0]], adv=[2.0, 1.0])
    loss, m = grpo.loss(inp, GRPOConfig(clip_eps=0.2))
    assert float(loss) == pytest.approx(-2.0 - 1.2)
    assert m["loss/policy"] == pytest.approx(-3.2)
    assert m["clip_frac"] == 1.0 and m["tokens"] == 3.0
    assert set(common.METRICS) <= set(m)


def test_grpo_kl_loss_and_reward_modes():
    # ref log-prob 0 where the policy has log(0.5): k3 = exp(d) - d - 1 with d = -log 0.5
    lp = math.log(0.5)
    inp = _inputs([[lp]], [[lp]], [[1]], adv=[0.0], ref=[[0.0]])
    k3 = 2.0 - math.log(2.0) - 1.0
    loss, m = grpo.loss(inp, GRPOConfig(kl_coef=0.1, kl_mode="loss"))
    assert float(loss) == pytest.approx(0.1 * k3, rel=1e-5) and m["kl"] == pytest.approx(k3)
    # reward mode: advantage becomes -0.1 * (old - ref) = +0.1 log 2, loss = -that
    loss, _ = grpo.loss(inp, GRPOConfig(kl_coef=0.1, kl_mode="reward"))
    assert float(loss) == pytest.approx(-0.1 * math.log(2.0), rel=1e-5)


def test_reinforce_pp_returns_and_batch_normalised_advantages():
    mask = [[1, 1], [1, 0]]
    inp = _inputs([[0, 0], [0, 0]], [[0, 0], [0, 0]], mask, rewards=[1.0, 0.0])
    cfg = ReinforcePPConfig(kl_coef=0.0, adv_eps=1e-12)
    # returns 1, 1 | 0: mean 2/3, std sqrt(2)/3 -> advantages 1/sqrt2, 1/sqrt2 | -sqrt2
    adv = reinforce_pp.advantages(inp, cfg)
    s2 = math.sqrt(2)
    assert adv.tolist()[0] == pytest.approx([1 / s2, 1 / s2], rel=1e-5)
    assert adv.tolist()[1][0] == pytest.approx(-s2, rel=1e-5)
    # token KL in the reward: old - ref = 0.1, 0.2 with beta 0.5, gamma 0.5
    inp = _inputs([[0, 0]], [[0.1, 0.2]], [[1, 1]], rewards=[1.0], ref=[[0.0, 0.0]])
    r = common.last_token_rewards(inp.rewards, inp.mask) + common.reward_kl(
        inp, ReinforcePPConfig(kl_coef=0.5))
    g = reinforce_pp.discounted_returns(r, inp.mask, 0.5)
    assert g.tolist()[0] == pytest.approx([-0.05 + 0.5 * 0.9, 0.9], rel=1e-5)
    loss, m = reinforce_pp.loss(inp, ReinforcePPConfig(kl_coef=0.5))
    assert torch.isfinite(loss) and m["loss/value"] == 0.0


def test_ppo_gae_and_value_loss():
    values = torch.tensor([[0.5, 0.2]])
    rewards = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    adv, ret = ppo.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.8]) and ret.tolist()[0] == pytest.approx([1, 1])
    adv, _ = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert adv.tolist()[0] == pytest.approx([-0.3, 0.8])
    adv, _ = ppo.gae(rewards, values, mask, gamma=0.5, lam=0.5)  # d0 = .1-.5, d1 = .8
    assert adv.tolist()[0] == pytest.approx([-0.4 + 0.25 * 0.8, 0.8])
    inp = _inputs([[0, 0]], [[0, 0]], [[1, 1]], rewards=[1.0], values=[[0.5, 0.2]])
    cfg = PPOConfig(gamma=1.0, gae_lambda=1.0, value_coef=0.5, whiten_advantages=False)
    loss, m = ppo.loss(inp, cfg)
    vloss = 0.5 * (0.25 + 0.64) / 2
    assert m["loss/value"] == pytest.approx(vloss)
    assert float(loss.detach()) == pytest.approx(-(0.5 + 0.8) / 2 + 0.5 * vloss, rel=1e-5)
    loss.backward()
    assert inp.values.grad.tolist()[0] == pytest.approx([0.5 * (0.5 - 1) / 2, 0.5 * (0.2 - 1) / 2])


def test_lr_schedules():
    assert lr_factor(OptimConfig(), 7, 10, 1, 1) == 1.0
    cos = OptimConfig(schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(cos, 0, 10, 1, 1) == pytest.approx(1.0)
    assert lr_factor(cos, 5, 10, 1, 1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(cos, 10, 10, 1, 1) == pytest.approx(0.1)
    cs = OptimConfig(schedule="critic_scaled", decay=0.01)
    assert lr_factor(cs, 10, 100, 400, 100) == pytest.approx(0.5 * math.exp(-0.1))
    assert lr_factor(cs, 0, 100, 100, 400) == pytest.approx(1.0)  # min(1, .) caps it
    assert lr_factor(OptimConfig(warmup_steps=4), 1, 10, 1, 1) == pytest.approx(0.5)


def test_clip_higher_uses_the_wider_upper_bound():
    # ratio 1.5 with A=1: clip_eps 0.2 alone caps it at 1.2; clip_eps_high 0.28 at 1.28.
    # ratio 0.5 with A=-1: the lower bound stays 1 - 0.2 = 0.8 -> loss -(-0.8) = 0.8 (the
    # pessimistic min picks the clipped 0.8*-1 = -0.8 over 0.5*-1 = -0.5)
    inp = _inputs([[math.log(1.5)], [math.log(0.5)]], [[0.0], [0.0]], [[1], [1]],
                  adv=[1.0, -1.0])
    loss, m = grpo.loss(inp, GRPOConfig(clip_eps=0.2))
    assert float(loss) == pytest.approx(-1.2 + 0.8, rel=1e-5)
    loss, m = grpo.loss(inp, GRPOConfig(clip_eps=0.2, clip_eps_high=0.28))
    assert float(loss) == pytest.approx(-1.28 + 0.8, rel=1e-5)
    assert m["clip_frac"] == 2.0
    # a ratio of 1.25 is clipped with the symmetric bound, not with clip-higher
    inp = _inputs([[math.log(1.25)]], [[0.0]], [[1]], adv=[1.0])
    assert grpo.loss(inp, GRPOConfig(clip_eps=0.2, clip_eps_high=0.28))[1]["clip_frac"] == 0.0
    assert grpo.loss(inp, GRPOConfig(clip_eps=0.2))[1]["clip_frac"] == 1.0


def test_token_sum_norm_aggregation_has_no_length_bias():
    # on-policy (ratio 1): token loss = -A. Row 0 has 3 tokens, row 1 has 1.
    inp = _inputs([[0.0] * 3, [0.0] * 3], [[0.0] * 3, [0.0] * 3], [[1, 1, 1], [1, 0, 0]],
                  adv=[1.0, 1.0])
    # sequence: each row's mean, -1 + -1
    assert float(grpo.loss(inp, GRPOConfig())[0]) == pytest.approx(-2.0)
    # Dr. GRPO: each row's token sum over the constant 4: -3/4 + -1/4
    loss, _ = grpo.loss(inp, GRPOConfig(loss_agg="token_sum_norm", loss_norm_tokens=4))
    assert float(loss) == pytest.approx(-1.0)
    # per-row, so splitting the batch into two micro-batches gives the same sum
    halves = [_inputs([[0.0] * 3], [[0.0] * 3], [m], adv=[1.0]) for m in ([1, 1, 1], [1, 0, 0])]
    cfg = GRPOConfig(loss_agg="token_sum_norm", loss_norm_tokens=4)
    assert sum(float(grpo.loss(h, cfg)[0]) for h in halves) == pytest.approx(-1.0)


def test_gspo_sequence_ratio_value_and_gradient():
    # row log-ratios 0.1 and 0.3 on two tokens: s = exp(0.2); both tokens carry s
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    inp = common.LossInputs(logp=logp, old_logp=torch.zeros(1, 2), mask=torch.ones(1, 2),
                            advantages=torch.tensor([1.0]), rewards=torch.tensor([0.0]))
    cfg = GRPOConfig(ratio_level="sequence", clip_eps=0.5)
    s = math.exp(0.2)
    assert common.importance_ratio(inp, cfg).tolist()[0] == pytest.approx([s, s], rel=1e-6)
    loss, _ = grpo.loss(inp, cfg)
    assert float(loss.detach()) == pytest.approx(-s, rel=1e-6)
    loss.backward()
    # d(-s)/d logp_t = -s * d(mean log ratio)/d logp_t = -s / 2 (GSPO's gradient)
    assert logp.grad.tolist()[0] == pytest.approx([-s / 2, -s / 2], rel=1e-6)
    # outside the clip range the row's ratio is clipped once: A=1, s=exp(0.2) > 1 + 1e-3
    loss, m = grpo.loss(inp, GRPOConfig(ratio_level="sequence", clip_eps=1e-3))
    assert float(loss) == pytest.approx(-(1 + 1e-3), rel=1e-6) and m["clip_frac"] == 2.0
