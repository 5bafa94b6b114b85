"""The co-adaptation trap of an answer/judge team (issue 34), on tiny random models: a judge
that answers YES to everything (what pays while its partner is mostly right) must get out of
it and judge again with the judge settings docs/training.md recommends (`normalize: agent`
with `balance_labels: true`: every true class weighs the same around one balanced baseline),
and stays stuck without them. Its reference is the YES-sayer itself, so it takes no KL (the KL
would hold it there); the answerer keeps the team's `kl_coef: 0.1`."""

from pathlib import Path

import numpy as np
import pytest

from flexmarl.config.schema import config_from_dict
from flexmarl.orchestrator.run import train
from flexmarl.training.trainer import AgentTrainer, Sample

N = 8  # objects; the judge says YES (id 3 + 2N) or NO (4 + 2N)
YES, NO = 3 + 2 * N, 4 + 2 * N
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
         "init_std": 0.1}
TEAM = {"answerer": {"name": "grpo", "kl_coef": 0.1},
        "judge": {"name": "grpo", "normalize": "agent", "balance_labels": True}}


def yes_sayer(out: Path) -> Path:
    """A judge trained to say YES whatever it sees (about 0.99 YES), saved as a checkpoint."""
    cfg = config_from_dict({"task": {"builder": "x:y"}, "agents": {"judge": {
        "model": MODEL, "optim": {"lr": 0.01}}}}).agents["judge"]
    trainer = AgentTrainer("judge", cfg, 5 + 2 * N, 16, run_seed=0)
    rng = np.random.default_rng(0)
    for k in range(30):
        batch = []
        for i in range(32):
            prompt = [1, 3 + int(rng.integers(N)), 2, 3 + N + int(rng.integers(N)), 2]
            token = YES if i % 2 == 0 else NO
            batch.append(Sample(f"{k}-{i}_0_0", prompt, [token], [-0.7],
                                1.0 if token == YES else -1.0, [YES, NO], 1.0, k))
        trainer.accumulate(batch)
        trainer.step()
    trainer.save(out)
    return out


def run_team(tmp_path: Path, algorithms: dict, judge: Path, iterations: int = 20,
             seed: int = 0) -> dict[str, np.ndarray]:
    """Per-iteration answerer and judge rewards and the judge's top answer fraction."""
    agents = {name: {"model": MODEL, "algorithm": algo, "optim": {"lr": 0.003}}
              for name, algo in algorithms.items()}
    agents["judge"]["model"] = {**MODEL, "checkpoint": str(judge)}
    cfg = config_from_dict({
        "seed": seed,
        "task": {"builder": "flexmarl.tasks.answer_judge:build_token_answer_judge",
                 "options": {"num_objects": N}},
        "agents": agents,
        "train": {"iterations": iterations, "inputs_per_iteration": 16, "group_size": 4,
                  "micro_batch_size": 32, "credit": {"team": 0.0, "node": 1.0}},
        "runtime": {"torch_threads": 1}})
    records = train(cfg, tmp_path / "run").records
    keys = {"answerer": "agent/answerer/reward_mean", "judge": "agent/judge/reward_mean",
            "top": "agent/judge/top_response_frac",
            # the judge's reward on episodes whose answer was right / wrong (`label=`)
            "right": "agent/judge/reward_mean/True", "wrong": "agent/judge/reward_mean/False"}
    # (an iteration whose answers were all right has no reward on wrong ones: NaN)
    return {k: np.array([r.get(key, np.nan) for r in records]) for k, key in keys.items()}


def test_a_yes_saying_judge_judges_again_with_the_judge_settings(tmp_path):
    # seed 1: with a baseline per class (balance_labels before 2026-12-06) this judge stayed
    # on YES (balanced accuracy 0.498 over the second half); seeds 0-4 measured in
    # docs/training.md ("Teams that co-adapt")
    curve = run_team(tmp_path, TEAM, yes_sayer(tmp_path / "judge"), seed=1)
    assert curve["top"][0] > 0.9  # it starts collapsed: YES is right on right answers only
    assert curve["right"][0] > 0.9 and curve["wrong"][0] < 0.1
    assert curve["answerer"][-5:].mean() > curve["answerer"][:5].mean() + 0.2
    # it answers both ways again, and over the second half judges better than saying one
    # thing to every input: its balanced accuracy (the mean of its reward on right and on
    # wrong answers; always-YES: exactly 0.5). Its raw reward is no test: once the answerer
    # is right 95% of the time, always-YES earns 0.95 and a judge cannot beat it by a margin
    # that stands out of the noise of the few wrong answers it sees.
    assert curve["top"][1:].min() < 0.8
    balanced = (curve["right"] + curve["wrong"]) / 2
    assert np.nanmean(balanced[10:]) > 0.58


@pytest.mark.slow
def test_without_them_the_judge_stays_a_yes_sayer(tmp_path):
    curve = run_team(tmp_path, {"answerer": {"name": "grpo"}, "judge": {"name": "grpo"}},
                     yes_sayer(tmp_path / "judge"))
    assert curve["top"].min() > 0.95
    assert np.nanmin(curve["right"]) > 0.95 and np.nanmax(curve["wrong"]) < 0.05
    assert (curve["judge"] - curve["answerer"])[10:].mean() <= 0.02
    assert np.nanmean(((curve["right"] + curve["wrong"]) / 2)[10:]) < 0.52
