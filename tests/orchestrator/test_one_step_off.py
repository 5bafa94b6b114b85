"""pipeline.mode=one_step_off on the local runtime: iteration k generated with version
max(0, k-1), its rows trained by step k, once each, and rollout k+1 overlapping step k."""

import time
from collections import defaultdict
from pathlib import Path

import pytest

from flexmarl.config.schema import ConfigError, load_config
from flexmarl.orchestrator.run import train
from tests.orchestrator.test_pipeline import _assert_exactly_once

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _instrument(submitted: dict, stepped: dict):
    """on_runtime hook: the wall time of each iteration's first generate submission and of the
    end of every agent's optimizer steps (in order, so step k is stepped[agent][k])."""
    def hook(runtime) -> None:
        rollout, pool = runtime.rollout, runtime.train
        generate, step = rollout.generate, pool.step

        async def timed_generate(request, priority):
            submitted.setdefault(priority[0], time.monotonic())
            assert request.version == max(0, priority[0] - 1)
            return await generate(request, priority)

        async def timed_step(agent):
            out = await step(agent)
            stepped[agent].append(time.monotonic())
            return out

        rollout.generate, pool.step = timed_generate, timed_step
    return hook


def test_one_step_off_trains_each_row_once_one_version_stale_and_overlaps(tmp_path):
    cfg = load_config(EXAMPLES / "referential_game.yaml", [
        "pipeline.mode=one_step_off", "train.iterations=3", "train.inputs_per_iteration=4",
        "train.group_size=4", "train.micro_batch_size=8"])
    assert cfg.pipeline.max_staleness == 1
    submitted: dict[int, float] = {}
    stepped: dict[str, list[float]] = defaultdict(list)
    result = train(cfg, tmp_path / "run", on_runtime=_instrument(submitted, stepped))
    _assert_exactly_once(result, cfg)
    for agent, trail in result.audit.items():
        assert {(v, s) for _, v, s in trail} == {(0, 0), (0, 1), (1, 2)}, agent
        assert len(trail) == 3 * 4 * 4
    assert sorted(submitted) == [0, 1, 2]
    # iteration 1 is generated with version 0: it starts before any agent's step 0 is done
    for agent, times in stepped.items():
        assert len(times) == 3
        assert submitted[1] < times[0], agent
    last = result.records[-1]  # every version reached the replicas by the end
    assert all(last[f"agent/{a}/policy_version"] == 3 for a in cfg.agents)


def test_one_step_off_rejects_checkpoints_naming_the_field():
    with pytest.raises(ConfigError, match="train.checkpoint_every: checkpoints are not "
                                          "supported with pipeline.mode=one_step_off"):
        load_config(EXAMPLES / "relay_chain.yaml",
                    ["pipeline.mode=one_step_off", "train.checkpoint_every=2"])
