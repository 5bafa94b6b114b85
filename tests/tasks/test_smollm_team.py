"""The pretrained multi-agent example (`examples/smollm_team.yaml`, `make demo-llm`): three
SmolLM2-135M agents with LoRA (solver -> verifier -> reviser) on text-level nodes; every
agent's reward rises and none collapses onto one answer. Slow (minutes on a CPU)."""

from pathlib import Path

import numpy as np
import pytest

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from tests.smollm import requires_smollm

pytestmark = [pytest.mark.slow, requires_smollm]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm_team.yaml"


def test_every_agent_of_the_smollm_team_learns(tmp_path):
    cfg = load_config(EXAMPLE, ["train.iterations=8"])
    records = train(cfg, tmp_path / "run").records
    for agent in ("solver", "verifier", "reviser"):
        curve = [r[f"agent/{agent}/reward_mean"] for r in records]
        assert np.mean(curve[-3:]) > np.mean(curve[:3]), (agent, curve)
        # not collapsed onto one answer: answers still differ across episodes
        assert records[-1][f"agent/{agent}/top_response_frac"] < 0.5, agent
        assert records[-1][f"agent/{agent}/logprob_diff_max"] <= 1e-4
