"""The referential game (real worker processes) learns with every algorithm (slow: ~1 min each)."""

from pathlib import Path

import pytest

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

GAME = Path(__file__).resolve().parents[2] / "examples" / "referential_game.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("algo", [
    "{name: ppo, entropy_coef: 0.3, entropy_decay_steps: 100}",
    "{name: reinforce_pp, entropy_coef: 0.3, entropy_decay_steps: 100, kl_coef: 0.0}",
])
def test_referential_game_improves(tmp_path, algo):
    cfg = load_config(GAME, ["train.iterations=40", f"agents.speaker.algorithm={algo}",
                             f"agents.listener.algorithm={algo}"])
    result = train(cfg, tmp_path / "run")
    first = sum(r["task/success_rate"] for r in result.records[:5]) / 5
    last = sum(r["task/success_rate"] for r in result.records[-5:]) / 5
    assert last > first + 0.2, f"{algo}: {first:.2f} -> {last:.2f}"
