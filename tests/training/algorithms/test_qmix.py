"""QMIX's mixer against a hand-computed case, its monotonicity and hypernetwork shapes, its
targets, and a short real run selected by config."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexmarl.training.algorithms import qmix


def _hand_mixer() -> qmix.QMixer:
    """2 agents, embedding 2, state [1.0], one-layer hypernetworks with chosen weights."""
    m = qmix.QMixer(n_agents=2, state_dim=1, embed=2, hypernet_layers=1)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.hyper_w1.weight.copy_(torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))  # |.| -> W1
        m.hyper_b1.weight.copy_(torch.tensor([[0.1], [0.2]]))
        m.hyper_w2.weight.copy_(torch.tensor([[-1.0], [2.0]]))  # |.| -> w2 = [1, 2]
        m.v[0].weight.copy_(torch.tensor([[1.0], [1.0]]))
        m.v[2].weight.copy_(torch.tensor([[0.5, 0.5]]))
        m.v[2].bias.fill_(0.25)
    return m


def test_mixing_hand_computed() -> None:
    m = _hand_mixer()
    q = torch.tensor([[1.0, -1.0]])
    s = torch.tensor([[1.0]])
    # W1 = [[1, 2], [0.5, 3]]: q W1 = [1 - 0.5, 2 - 3] = [0.5, -1]; + b1 [0.1, 0.2]
    # elu -> [0.6, e^-0.8 - 1]; . w2 [1, 2]; + V = relu([1, 1]) . [0.5, 0.5] + 0.25 = 1.25
    expected = 0.6 * 1 + (math.exp(-0.8) - 1) * 2 + 1.25
    with torch.no_grad():
        out = m(q, s)
    assert float(out) == pytest.approx(expected, rel=1e-6)
    w1, b1, w2, v = m.weights(s)
    torch.testing.assert_close(w1, torch.tensor([[[1.0, 2.0], [0.5, 3.0]]]))
    assert float(v) == pytest.approx(1.25)


def test_hypernetwork_shapes_and_monotonic_mixing() -> None:
    torch.manual_seed(0)
    m = qmix.QMixer(n_agents=3, state_dim=7, embed=8, hypernet_layers=2, hypernet_embed=16)
    s = torch.randn(5, 7)
    w1, b1, w2, v = m.weights(s)
    assert w1.shape == (5, 3, 8) and b1.shape == (5, 1, 8) and w2.shape == (5, 8, 1)
    assert v.shape == (5,) and (w1 >= 0).all() and (w2 >= 0).all()
    assert m.hyper_w1[0].in_features == 7 and m.hyper_w1[2].out_features == 3 * 8
    q = torch.randn(5, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(m(q, s).sum(), q)
    assert (grad >= 0).all()  # dQ_tot / dQ_a >= 0 for every agent and state
    with pytest.raises(ValueError, match="hypernet_layers must be 1 or 2"):
        qmix.QMixer(3, 7, hypernet_layers=3)


def test_double_q_targets_through_the_target_mixer() -> None:
    m = _hand_mixer()
    online = torch.tensor([[[1.0, 2.0], [0.5, 0.1]]])  # argmax: agent0 -> 1, agent1 -> 0
    target = torch.tensor([[[10.0, 1.0], [-1.0, 40.0]]])  # chosen: [1, -1]
    y = qmix.td_targets(online, target, torch.tensor([1.0]), torch.tensor([0.0]), 0.5, m,
                        torch.tensor([[1.0]]))
    with torch.no_grad():
        mixed = float(m(torch.tensor([[1.0, -1.0]]), torch.tensor([[1.0]])))
    assert float(y) == pytest.approx(1.0 + 0.5 * mixed)
    loss, td = qmix.loss(torch.tensor([[[1.0, 0.0], [0.0, -1.0]]]), torch.tensor([[0, 1]]),
                         torch.tensor([mixed + 0.5]), torch.tensor([2.0]), m,
                         torch.tensor([[1.0]]))
    assert float(td) == pytest.approx(-0.5) and float(loss) == pytest.approx(2.0 * 0.125)


def test_qmix_selected_by_config_trains_its_mixer_on_spread() -> None:
    pytest.importorskip("mpe2")
    from flexmarl.envs.pettingzoo import VecParallelEnv
    from flexmarl.marl.offpolicy import QLearner, QRollout, q_layouts
    from flexmarl.marl.policies import MarlSample
    from tests.marl.configs import marl_cfg

    cfg = marl_cfg({
        "env": {"id": "mpe2.simple_spread_v3", "num_envs": 4},
        "algorithm": {"name": "qmix", "min_size": 200, "capacity": 1000, "batch_size": 32,
                      "target_every": 5, "mixing_embed": 8},
        "train": {"env_steps": 400, "rollout_steps": 25}})
    probe = VecParallelEnv(cfg.env.id, cfg.env.options, 1, 0)
    probe.reset()
    lay = q_layouts(cfg, probe)
    learner, worker = QLearner(cfg, lay["shared"]), QRollout(cfg, lay)
    assert learner.mixer is not None and learner.mixer.state_dim == probe.state.shape[1]
    before = {k: v.clone() for k, v in learner.mixer.state_dict().items()}
    metrics: dict = {}
    for k in range(4):
        worker.load("shared", k, learner.weights())
        res = worker.run(k)
        learner.accumulate([MarlSample(f"{k}-w0_0_0", k, k, 0, res.transitions)])
        metrics = learner.step()
    assert np.isfinite(metrics["loss/value"])
    assert any(not torch.equal(before[k], v) for k, v in learner.mixer.state_dict().items())
    assert learner.replay.fields["state"].shape[1] == learner.mixer.state_dim
