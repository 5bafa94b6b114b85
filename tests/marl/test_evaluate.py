"""Greedy evaluation (`flexmarl/marl/evaluate.py`, `train.eval_every`): the most likely action
on the evaluation's own, fixed episodes; training unchanged by it; the in-run figures equal
those of the checkpoints the run wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mpe2")

from flexmarl.config.schema import ConfigError  # noqa: E402
from flexmarl.envs.pettingzoo import VecParallelEnv  # noqa: E402
from flexmarl.marl.evaluate import (  # noqa: E402
    EVAL_SEED_OFFSET,
    GreedyEvaluator,
    evaluate_checkpoint,
    summarize,
)
from flexmarl.marl.learner import PolicyLearner  # noqa: E402
from flexmarl.marl.run import MarlRun, train_marl  # noqa: E402
from tests.marl.configs import marl_cfg  # noqa: E402


def spread(**over):
    raw = {"seed": 3,
           "env": {"id": "mpe2.simple_spread_v3", "options": {"N": 3, "max_cycles": 25},
                   "num_envs": 4},
           "algorithm": {"name": "mappo", "epochs": 2, "minibatches": 1},
           "train": {"env_steps": 300, "rollout_steps": 25, "eval_episodes": 6}}
    return marl_cfg(raw, **over)


def constant_weights(c, action: int) -> tuple[MarlRun, dict[str, torch.Tensor]]:
    """Weights whose most likely action is `action` for every input (head bias only)."""
    run = MarlRun(c)
    learner = PolicyLearner(c, run.layouts["shared"])
    w = learner.weights()
    w["actor.head.weight"] = torch.zeros_like(w["actor.head.weight"])
    bias = torch.zeros_like(w["actor.head.bias"])
    bias[action] = 1.0
    w["actor.head.bias"] = bias
    return run, w


@pytest.mark.parametrize("kind", ["mlp", "gru"])
def test_greedy_takes_the_most_likely_action_on_fixed_episodes(kind: str) -> None:
    c = spread(**{"network.kind": kind})
    run, w = constant_weights(c, 3)  # mpe2's discrete action 3: move down
    ev = GreedyEvaluator(c, run.layouts, 6)
    ev.load("shared", 1, w)
    got = ev.run()
    # by hand: the evaluation's environments (seed + offset), action 3 throughout
    venv = VecParallelEnv(c.env.id, c.env.options, 6, c.seed + EVAL_SEED_OFFSET)
    venv.reset()
    for _ in range(25):
        venv.step({a: np.full((6, 1), 3.0, np.float32) for a in venv.agents})
    want = summarize(venv.pop_episodes())
    assert got == pytest.approx(want)
    assert got["eval/episodes"] == 6 and got["eval/length"] == 25
    assert "eval/landmarks_covered" in got
    assert ev.run() == got  # the same start states at every evaluation
    _, w0 = constant_weights(c, 0)  # standing still scores differently
    ev.load("shared", 2, w0)
    assert ev.run()["eval/return"] != pytest.approx(got["eval/return"])


def test_greedy_evaluation_needs_every_policy_loaded() -> None:
    c = spread()
    ev = GreedyEvaluator(c, MarlRun(c).layouts, 2)
    with pytest.raises(RuntimeError, match="no weights loaded for policies \\['shared'\\]"):
        ev.run()


@pytest.mark.slow  # two runs (13 s); the evaluation's own tests above stay fast
def test_eval_every_leaves_training_unchanged_and_matches_the_checkpoints(tmp_path) -> None:
    plain = train_marl(spread(), None).records
    c = spread(**{"train.eval_every": 2, "train.checkpoint_every": 1,
                  "train.keep_checkpoints": 5})
    evald = train_marl(c, tmp_path / "run").records
    assert len(plain) == len(evald) == 3
    for a, b in zip(plain, evald, strict=True):  # bit-identical training
        for key in ("return_mean", "task/landmarks_covered", "agent/shared/loss/policy",
                    "agent/shared/loss/value", "agent/shared/entropy"):
            assert a[key] == b[key], key
        assert not any(k.startswith("eval/") for k in a)
    # iterations 1 (eval_every 2) and 2 (the last one)
    assert [("eval/return" in r) for r in evald] == [False, True, True]
    for rec in evald[1:]:
        completed, metrics = evaluate_checkpoint(
            c, tmp_path / "run" / "checkpoints" / f"gen-{rec['iteration'] + 1:06d}", 6)
        assert completed == rec["iteration"] + 1
        assert metrics == {k: v for k, v in rec.items() if k.startswith("eval/")}
    assert evald[1]["eval/return"] != evald[2]["eval/return"]  # the weights differ
    # the run folder itself: its LATEST generation
    assert evaluate_checkpoint(c, tmp_path / "run", 6)[0] == 3


def test_eval_every_is_refused_for_the_replay_learners() -> None:
    with pytest.raises(ConfigError, match="train.eval_every: vdn"):
        spread(**{"algorithm": {"name": "vdn"}, "train.eval_every": 1})
