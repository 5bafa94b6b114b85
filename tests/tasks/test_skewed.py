"""The long-tailed fan-out workloads: lengths per agent, the conditional expert, and the
paper-shaped example (examples/paper_workload.yaml) in a short real run."""

from pathlib import Path

import pytest

from flexmarl.config.schema import load_config
from flexmarl.graph.meg import EpisodeContext
from flexmarl.graph.task import TaskLoadError
from flexmarl.orchestrator.run import train
from flexmarl.tasks.skewed import build_skewed_fanout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_conditional_expert_runs_only_when_the_router_asks():
    task = build_skewed_fanout({"router": 2, "a": 3, "b": 3}, conditional=["b"], vocab_size=64)
    when = task.graph.nodes["b"].when
    assert task.graph.nodes["a"].when is None and when is not None
    ctx = EpisodeContext(input_id="0-0", trajectory_id=0, data={"query": [5] * 8})
    ctx.outputs["router"] = [60, 7]
    assert when(ctx)
    ctx.outputs["router"] = [5, 7]
    assert not when(ctx)
    with pytest.raises(TaskLoadError, match=r"options.conditional: 'c' is not an expert"):
        build_skewed_fanout({"router": 2, "a": 3}, conditional=["c"])


def test_paper_workload_trains_five_agents_on_two_slots(tmp_path):
    cfg = load_config(EXAMPLES / "paper_workload.yaml",
                      ["train.iterations=2", "train.inputs_per_iteration=4", "train.group_size=2"])
    trainable = [a for a in cfg.agents if cfg.agents[a].trainable]
    assert len(trainable) == 5 > cfg.runtime.train_workers
    result = train(cfg, tmp_path / "run")
    last = result.records[-1]
    assert all(last[f"agent/{a}/policy_version"] == 2 for a in trainable)
    # the conditional branch: the verbose expert answered in some episodes, not in all
    verbose = sum(r["agent/verbose/rows_trained"] for r in result.records)
    brief = sum(r["agent/brief/rows_trained"] for r in result.records)
    assert 0 < verbose < brief
    assert sum(r["pool/train/swaps"] for r in result.records) > 0  # slots time-shared
