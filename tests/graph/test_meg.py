import pytest

from flexmarl.graph.meg import MEG, GraphError, NodePrompt
from flexmarl.graph.task import TaskLoadError, load_task, resolve_import


def _p(ctx):
    return NodePrompt([1], 1)


def test_topological_order_follows_dependencies():
    g = MEG().node("c", agent="x", prompt=_p, inputs=["b"]).node("b", agent="x", prompt=_p,
                                                                  inputs=["a"])
    g.node("a", agent="y", prompt=_p)
    assert g.validate(["x", "y"]) == ["a", "b", "c"]
    assert g.turn_of() == {"a": 0, "b": 1, "c": 2}
    assert g.agents == ["x", "y"]


def test_cycle_is_named():
    g = (MEG().node("a", agent="x", prompt=_p, inputs=["c"])
         .node("b", agent="x", prompt=_p, inputs=["a"])
         .node("c", agent="x", prompt=_p, inputs=["b"]))
    with pytest.raises(GraphError, match=r"graph has a cycle: a -> c -> b -> a"):
        g.validate(["x"])


def test_self_loop_is_a_cycle():
    g = MEG().node("a", agent="x", prompt=_p, inputs=["a"])
    with pytest.raises(GraphError, match="graph has a cycle: a -> a"):
        g.validate(["x"])


def test_unknown_agent_is_named():
    g = MEG().node("a", agent="ghost", prompt=_p)
    with pytest.raises(GraphError, match="node 'a' uses unknown agent 'ghost' "
                                         r"\(configured agents: x\)"):
        g.validate(["x"])


def test_missing_input_is_named():
    g = MEG().node("a", agent="x", prompt=_p, inputs=["nope"])
    with pytest.raises(GraphError, match="node 'a' has missing input 'nope'"):
        g.validate(["x"])


def test_duplicate_and_bad_names():
    g = MEG().node("a", agent="x", prompt=_p)
    with pytest.raises(GraphError, match="node 'a' is defined twice"):
        g.node("a", agent="x", prompt=_p)
    with pytest.raises(GraphError, match="must be non-empty and contain no '_'"):
        g.node("a_b", agent="x", prompt=_p)
    with pytest.raises(GraphError, match="graph has no nodes"):
        MEG().validate([])


def test_import_path_errors():
    with pytest.raises(TaskLoadError, match="not of the form 'package.module:function'"):
        resolve_import("flexmarl.tasks.referential")
    with pytest.raises(TaskLoadError, match="cannot import module 'no_such_module'"):
        resolve_import("no_such_module:fn")
    with pytest.raises(TaskLoadError, match="has no attribute 'nope'"):
        resolve_import("flexmarl.tasks.referential:nope")
    with pytest.raises(TaskLoadError, match="rejected the options"):
        load_task("flexmarl.tasks.referential:build_referential_game", {"bogus": 1})
    with pytest.raises(GraphError, match="task.options.num_candidates"):
        load_task("flexmarl.tasks.referential:build_referential_game",
                  {"num_objects": 3, "num_candidates": 4})
