"""The arithmetic tasks' graphs and rule-based rewards, without a model (fast)."""

import numpy as np
import pytest

from flexmarl.graph.meg import EpisodeContext, GraphError
from flexmarl.tasks.math import build_math_pair


def _ctx(data, texts):
    return EpisodeContext("0-0", 0, data, {n: [1] for n in texts}, texts)


def test_recompute_judge_computes_then_compares_two_numbers_alone():
    task = build_math_pair(max_operand=9, ops="+", judge="recompute")
    g = task.graph
    assert g.nodes["recompute"].agent == g.nodes["check"].agent == "checker"
    assert set(g.nodes["check"].inputs) == {"solve", "recompute"}
    assert not g.nodes["recompute"].inputs  # runs beside the solver, not after it
    data = task.sample_inputs(np.random.default_rng(0), 1)[0]
    right, wrong = str(data["answer"]), str(data["answer"] + 1)
    ctx = _ctx(data, {"solve": wrong, "recompute": right, "check": "No"})
    content = g.nodes["check"].prompt(ctx).prompt[-1]["content"]
    assert content.startswith(f"Answer 1: {right}\nAnswer 2: {wrong}\n")
    assert "Compute" not in content  # the comparison alone: the prior a small model has
    assert g.nodes["recompute"].reward(ctx) == 1.0 and g.nodes["solve"].reward(ctx) == 0.0
    assert g.nodes["check"].reward(ctx) == 1.0 and g.nodes["check"].label(ctx) is False
    # the verdict is scored against the truth, not against the checker's own number
    ctx = _ctx(data, {"solve": right, "recompute": wrong, "check": "No"})
    assert g.nodes["check"].reward(ctx) == 0.0 and g.nodes["recompute"].reward(ctx) == 0.0
    ctx = _ctx(data, {"solve": "no idea", "recompute": "", "check": "Yes"})
    assert "Answer 1: none\nAnswer 2: none\n" in g.nodes["check"].prompt(ctx).prompt[-1][
        "content"]


def test_unknown_judge_is_refused_naming_the_option():
    with pytest.raises(GraphError, match="task.options.judge"):
        build_math_pair(judge="vote")
