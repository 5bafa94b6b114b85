"""Tasks of the deliberately broken runs that `flexmarl doctor` must diagnose
(benchmarks/doctor_cases.py records them into tests/data/doctor/)."""

from __future__ import annotations

from flexmarl.tasks.referential import build_referential_game


def large_rewards(scale: float = 1000.0, **options):
    """Unnormalised large observations: the team reward in the thousands, not in [0, 1]."""
    task = build_referential_game(**options)
    inner = task.graph.episode_reward
    task.graph.set_episode_reward(lambda ctx: scale * inner(ctx) + scale)
    return task


def lazy_speaker(bonus: float = 2.0, **options):
    """A reward that makes the speaker lazy: it is paid for always sending the first symbol,
    whatever the target, so it stops carrying information and the team stays at chance."""
    task = build_referential_game(**options)
    speak = task.graph.nodes["speak"]
    lowest = min(speak.prompt(_Ctx()).allowed_tokens)
    speak.reward = lambda ctx: bonus if ctx.outputs["speak"][0] == lowest else 0.0
    return task


class _Ctx:
    input_id, trajectory_id, outputs = "x-0", 0, {}
    data = {"target": 6, "candidates": [6, 7, 8, 9]}
