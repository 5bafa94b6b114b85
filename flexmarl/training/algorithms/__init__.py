"""One file per algorithm, each readable top to bottom: grpo, ppo, reinforce_pp."""

from __future__ import annotations

from types import ModuleType

from flexmarl.training.algorithms import grpo, ppo, reinforce_pp


def get(name: str) -> ModuleType:
    """The module of an algorithm by its config name (each has `sequence_advantages`,
    `loss` and `rows_independent`)."""

    return {"grpo": grpo, "ppo": ppo, "reinforce_pp": reinforce_pp}[name]
