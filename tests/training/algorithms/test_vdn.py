"""VDN's targets and age-weighted loss against hand-computed cases, and a short real run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexmarl.training.algorithms import vdn


def test_double_q_vdn_targets_hand_computed() -> None:
    online = torch.tensor([[[1.0, 2.0], [0.5, 0.1]]])  # argmax: agent0 -> 1, agent1 -> 0
    target = torch.tensor([[[10.0, 20.0], [30.0, 40.0]]])
    y = vdn.td_targets(online, target, torch.tensor([1.0]), torch.tensor([0.0]), 0.5)
    assert float(y) == pytest.approx(1.0 + 0.5 * (20.0 + 30.0))
    y_done = vdn.td_targets(online, target, torch.tensor([1.0]), torch.tensor([1.0]), 0.5)
    assert float(y_done) == pytest.approx(1.0)


def test_age_weighted_huber_loss_hand_computed() -> None:
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[0.5, 0.5], [1.0, 1.0]]])
    actions = torch.tensor([[0, 1], [1, 0]])
    targets = torch.tensor([3.5, 1.0])
    w = torch.tensor([1.0, 0.5])
    out, td = vdn.loss(q, actions, targets, w)
    # row 0: Q_tot 3, error 0.5 -> huber 0.125; row 1: Q_tot 1.5, error 0.5 -> 0.125
    assert float(out) == pytest.approx((1.0 * 0.125 + 0.5 * 0.125) / 2)
    torch.testing.assert_close(td, torch.tensor([-0.5, 0.5]))
    assert vdn.epsilon(0, 0.05, 100) == 1.0 and vdn.epsilon(50, 0.05, 100) == pytest.approx(0.525)
    assert vdn.epsilon(500, 0.05, 100) == 0.05


def test_vdn_learner_steps_through_the_replay_table() -> None:
    """A rollout worker's iterations into the learner's replay table: rows added once per
    env step, updates from min_size on, priorities set, age weights below 1."""
    pytest.importorskip("mpe2")
    from flexmarl.envs.pettingzoo import VecParallelEnv
    from flexmarl.marl.offpolicy import QLearner, QRollout, q_layouts
    from flexmarl.marl.policies import MarlSample
    from tests.marl.configs import marl_cfg

    cfg = marl_cfg({
        "env": {"id": "mpe2.simple_spread_v3", "num_envs": 4},
        "algorithm": {"name": "vdn", "min_size": 200, "capacity": 1000, "batch_size": 32,
                      "target_every": 5},
        "train": {"env_steps": 400, "rollout_steps": 25}})
    probe = VecParallelEnv(cfg.env.id, cfg.env.options, 1, 0)
    probe.reset()
    lay = q_layouts(cfg, probe)
    learner, worker = QLearner(cfg, lay["shared"]), QRollout(cfg, lay)
    metrics: dict = {}
    for k in range(4):
        worker.load("shared", k, learner.weights())
        res = worker.run(k)
        assert res.transitions["obs"].shape == (25, 4, 3, 18)
        learner.accumulate([MarlSample(f"{k}-w0_0_0", k, k, 0, res.transitions)])
        metrics = learner.step()
        audit = learner.trained_on
        assert audit == [(f"{k}-w0_0_0", k, k, 0)]
    assert len(learner.replay) == 400
    assert learner.updates == (400 - 200) // 4 + 1 and learner.updates >= 5
    assert np.isfinite(metrics["loss/value"]) and metrics["age_weight_mean"] < 1.0
    assert (learner.replay.priority[: len(learner.replay)] > 0).all()


def test_agents_that_left_are_out_of_q_tot_and_of_the_target() -> None:
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    actions = torch.tensor([[0, 1]])
    # agent 1 did not act: Q_tot = 1 (not 3); target 1.5 -> error -0.5, huber 0.125
    out, td = vdn.loss(q, actions, torch.tensor([1.5]), torch.tensor([1.0]),
                       alive=torch.tensor([[1.0, 0.0]]))
    assert float(out) == pytest.approx(0.125) and float(td) == pytest.approx(-0.5)
    online = torch.tensor([[[1.0, 2.0], [0.5, 0.1]]])
    target = torch.tensor([[[10.0, 20.0], [30.0, 40.0]]])
    # agent 0 has left by the next step: only agent 1's 30 is bootstrapped
    y = vdn.td_targets(online, target, torch.tensor([1.0]), torch.tensor([0.0]), 0.5,
                       next_alive=torch.tensor([[0.0, 1.0]]))
    assert float(y) == pytest.approx(1.0 + 0.5 * 30.0)


@pytest.mark.slow  # KAZ steps slowly: ~45 s under load
def test_vdn_transitions_where_agents_leave_mid_episode() -> None:
    """Knights, Archers, Zombies: agents killed mid-episode. The rollout records who acted
    (`alive`) and who has a future (`next_alive`); a dead agent never has one, and the
    learner trains on such transitions."""
    pytest.importorskip("pettingzoo.butterfly")
    from flexmarl.envs.pettingzoo import VecParallelEnv
    from flexmarl.marl.offpolicy import QLearner, QRollout, q_layouts
    from flexmarl.marl.policies import MarlSample
    from tests.marl.configs import marl_cfg

    cfg = marl_cfg({
        "seed": 1,
        "env": {"id": "pettingzoo.butterfly.knights_archers_zombies_v11", "num_envs": 2,
                "options": {"max_cycles": 300, "spawn_delay": 5, "line_death": True,
                            "max_zombies": 4}},
        "algorithm": {"name": "vdn", "min_size": 150, "capacity": 2000, "batch_size": 16},
        "train": {"env_steps": 400, "rollout_steps": 100}})
    probe = VecParallelEnv(cfg.env.id, cfg.env.options, 1, 0)
    probe.reset()
    lay = q_layouts(cfg, probe)
    learner, worker = QLearner(cfg, lay["shared"]), QRollout(cfg, lay)
    partial = 0
    for k in range(2):
        worker.load("shared", k, learner.weights())
        tr = worker.run(k).transitions
        alive, nxt, done = tr["alive"].astype(bool), tr["next_alive"].astype(bool), tr["done"]
        assert not (nxt & ~alive).any()  # no future without acting now
        # an agent that left at t is not acting at t+1 in the same environment (unless
        # the environment was reset: then nobody has a future)
        left = alive[:-1] & ~nxt[:-1]
        reset = ~nxt[:-1].any(-1, keepdims=True)
        assert not (left & alive[1:] & ~reset).any()
        partial += int((left.any(-1) & nxt[:-1].any(-1)).sum())
        assert set(np.unique(done)) <= {0.0, 1.0}
        learner.accumulate([MarlSample(f"{k}-w0_0_0", k, k, 0, tr)])
        metrics = learner.step()
    assert partial > 0, "no agent left while others went on"
    assert np.isfinite(metrics["loss/value"])
