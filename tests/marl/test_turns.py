"""AEC-only games trained as a chain of turns (flexmarl/envs/turns.py): the wrapper's turns,
masks, rewards and ends against hand-played games, its errors, and MAPPO against a random
tictactoe opponent whose return rises."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pettingzoo.classic")

from flexmarl.envs.pettingzoo import EnvError, VecParallelEnv, make_parallel  # noqa: E402
from flexmarl.envs.turns import TurnParallelEnv  # noqa: E402

TTT = "pettingzoo.classic.tictactoe_v3"


def test_self_play_turns_forced_passes_and_the_games_end() -> None:
    env = make_parallel(TTT)
    assert isinstance(env, TurnParallelEnv)
    obs, _ = env.reset(seed=0)
    assert env.agents == ["player_1", "player_2"]
    assert obs["player_1"]["action_mask"].all()  # player_1's turn: every cell free
    assert list(obs["player_2"]["action_mask"]) == [1] + [0] * 8  # a forced pass
    # player_1 plays 0, 1, 2 (the top row), player_2 plays 3, 4; the passes are ignored
    for move, turn in ((0, "player_1"), (3, "player_2"), (1, "player_1"), (4, "player_2")):
        other = "player_2" if turn == "player_1" else "player_1"
        obs, rew, term, trunc, _ = env.step({turn: move, other: 0})
        assert rew == {"player_1": 0.0, "player_2": 0.0} and not any(term.values())
        assert obs[turn]["action_mask"].tolist() == [1] + [0] * 8  # now the other's turn
        assert obs[other]["action_mask"][move] == 0
    obs, rew, term, trunc, _ = env.step({"player_1": 2, "player_2": 0})
    assert rew == {"player_1": 1.0, "player_2": -1.0}
    assert term == {"player_1": True, "player_2": True} and not any(trunc.values())
    assert env.agents == []


def test_a_random_opponent_replies_inside_the_step_and_its_win_is_the_learners_loss() -> None:
    env = make_parallel(TTT, opponents={"player_2": "random"})
    env.reset(seed=3)
    assert env.possible_agents == ["player_1"] and env.agents == ["player_1"]
    total, steps = 0.0, 0
    while env.agents:
        mask = env.aec.observe("player_1")["action_mask"]
        assert env.aec.agent_selection == "player_1"  # the opponent has replied already
        _, rew, term, _, _ = env.step({"player_1": int(np.flatnonzero(mask)[0])})
        total, steps = total + rew["player_1"], steps + 1
    assert steps <= 5 and total in (-1.0, 0.0, 1.0)
    # random vs random from player_1's side, many games: it wins more than it loses
    venv = VecParallelEnv(TTT, {}, 16, 0, {"player_2": "random"})
    venv.reset()
    rng = np.random.default_rng(0)
    for _ in range(150):
        venv.step({"player_1": np.array([[rng.choice(np.flatnonzero(m))]
                                         for m in venv.masks["player_1"]])})
    returns = [e.returns["player_1"] for e in venv.pop_episodes()]
    assert len(returns) > 400 and 0.15 < float(np.mean(returns)) < 0.45


def test_opponent_errors_name_the_field() -> None:
    with pytest.raises(EnvError, match="env.opponents: .* no agent 'player_9'"):
        make_parallel(TTT, opponents={"player_9": "random"})
    with pytest.raises(EnvError, match="env.opponents.player_2: unknown opponent 'minimax'"):
        make_parallel(TTT, opponents={"player_2": "minimax"})
    with pytest.raises(EnvError, match="every agent .* is an opponent"):
        make_parallel(TTT, opponents={"player_1": "random", "player_2": "random"})


@pytest.mark.slow  # a learning run (13 s); test_run's MPE run checks MARL learning in make test
def test_mappo_beats_a_random_tictactoe_opponent(tmp_path) -> None:
    """The example (flexmarl train examples/tictactoe.yaml) at a short budget: player_1's
    return against the random opponent rises well above random play's (about +0.3)."""
    from pathlib import Path

    from flexmarl.config.schema import load_config
    from flexmarl.marl.run import train_marl

    example = Path(__file__).resolve().parents[2] / "examples" / "tictactoe.yaml"
    cfg = load_config(example, ["train.env_steps=16000"])
    res = train_marl(cfg, tmp_path / "run")
    rets = [r["return_mean"] for r in res.records if "return_mean" in r]
    first, last = float(np.mean(rets[:5])), float(np.mean(rets[-5:]))
    assert first < 0.5 and last > first + 0.25, (first, last)
    # the run folder reads like an LLM run's: summary.json, and doctor finds the agent and
    # its common reward metric
    import json

    from flexmarl.cli.doctor import load_run

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == len(res.records)
    run = load_run(tmp_path / "run")
    assert run.agents == ["player_1"]
    its, rewards = run.series("agent/player_1/reward_mean")
    assert len(its) == len(res.records) and rewards[-1] == res.records[-1]["return_mean"]
