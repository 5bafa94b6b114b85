"""DAPO's dynamic sampling on real runs: groups whose rewards all agree are dropped for the
agent that asks for it and replaced by fresh inputs; sync and async stay equal (with the
other agent running two optimisation passes per iteration); every row is trained at most once
and no dropped row is trained."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import config_from_dict, load_config
from flexmarl.orchestrator.run import train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTINGS = ["runtime.deterministic=true", "train.iterations=2", "train.inputs_per_iteration=6",
            "train.group_size=2", "train.resample_rounds=1",
            "agents.listener.algorithm.dynamic_sampling=true", "agents.speaker.algorithm.epochs=2"]


def _run(tmp_path: Path, mode: str):
    cfg = load_config(EXAMPLES / "referential_game.yaml", [f"pipeline.mode={mode}", *SETTINGS])
    return cfg, train(cfg, tmp_path / mode)


def test_agreeing_groups_are_replaced_and_sync_equals_async(tmp_path):
    results = {mode: _run(tmp_path, mode) for mode in ("sync", "async")}
    cfg, res = results["async"]
    resampled = [r["episodes/groups_resampled"] for r in res.records]
    filtered = [r.get("agent/listener/rows_filtered", 0) for r in res.records]
    assert sum(resampled) > 0 and sum(filtered) > 0  # chance 1/4: many groups agree
    assert all("agent/speaker/rows_filtered" not in r for r in res.records)
    assert all(r["agent/speaker/epochs"] == 2.0 for r in res.records)
    per_input = cfg.train.group_size
    for k, rec in enumerate(res.records):
        episodes = (cfg.train.inputs_per_iteration + rec["episodes/groups_resampled"]) * per_input
        assert rec["episodes/total"] == episodes
        # the speaker trains on every episode's row, replacements included; the listener on
        # all but the rows of groups that agreed
        assert len(res.consumed["speaker"][k]) == episodes - rec["episodes/failed"]
        assert len(res.consumed["listener"][k]) == (episodes - rec["episodes/failed"]
                                                    - rec.get("agent/listener/rows_filtered", 0))
        # reward and success are reported over the iteration's own inputs only
        assert 0.0 <= rec["task/success_rate"] <= 1.0
    for agent, audit in res.audit.items():
        ids = [sid for sid, _, _ in audit]
        assert len(ids) == len(set(ids)), f"{agent}: a row was trained on twice"
    assert res.store_stats["listener"]["failed"] == sum(filtered)
    assert res.store_stats["listener"]["ready"] == 0
    sync_cfg, sync_res = results["sync"]
    assert [r["episodes/groups_resampled"] for r in sync_res.records] == resampled
    for agent, path in sync_res.checkpoints.items():
        x = load_file(str(path / "model.safetensors"))
        y = load_file(str(res.checkpoints[agent] / "model.safetensors"))
        assert max(float((x[k] - y[k]).abs().max()) for k in x) <= 1e-5


@pytest.mark.parametrize("train_opts,algo,message", [
    ({"group_size": 1}, {}, r"agents.a.algorithm.dynamic_sampling: needs train.group_size >= 2"),
    ({}, {"normalize": "agent"}, r"needs normalize: group \(got 'agent'\)"),
])
def test_dynamic_sampling_settings_that_cannot_work_are_refused(train_opts, algo, message):
    with pytest.raises(Exception, match=message):
        config_from_dict({"task": {"builder": "x:y"}, "train": train_opts,
                          "agents": {"a": {"algorithm": {"name": "grpo",
                                                         "dynamic_sampling": True, **algo}}}})
