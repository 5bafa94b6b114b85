"""Workload schema: the examples load, bad input names the file and the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from flexmarl.sim.cost import CostModel
from flexmarl.sim.models import get_model
from flexmarl.sim.workload import (
    EpisodeNode,
    Workload,
    WorkloadError,
    load_workload,
    parse_workload,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"
REQUIRED = ["math_debate", "planner_coder_reviewer", "customer_service", "star_hub"]

BASE: dict[str, Any] = {
    "name": "tiny",
    "iterations": 2,
    "cluster": {"nodes": 1, "accelerators_per_node": 8, "accelerator": "H800"},
    "agents": [
        {"name": "solver", "model": "7B", "prompt_length": 128, "output_length": 256},
        {
            "name": "verifier",
            "model": "1.5B",
            "prompt_length": 64,
            "output_length": {"kind": "lognormal", "mean": 100, "sigma": 0.5, "max": 400},
        },
    ],
    "graph": {"rounds": 1, "edges": [{"src": "solver", "dst": "verifier"}]},
    "rollout": {"prompts_per_iteration": 4, "group_size": 2},
}


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("name", REQUIRED + ["solver_verifier"])
def test_every_example_loads(name: str) -> None:
    workload = load_workload(EXAMPLES / f"{name}.yaml")
    assert workload.name == name
    nodes = workload.episode_nodes()
    assert nodes and all(isinstance(n, EpisodeNode) for n in nodes)
    # Topological order: each node's inputs appear before it.
    seen: set[str] = set()
    for node in nodes:
        assert set(node.inputs) <= seen
        seen.add(node.id)
    assert isinstance(workload.cost_model(), CostModel)


def test_all_yaml_in_examples_load_and_one_is_48_nodes() -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert {p.stem for p in paths} >= set(REQUIRED)
    workloads = [load_workload(p) for p in paths]
    assert max(w.cluster.nodes for w in workloads) == 48
    # 8 per node, but the paper-shaped workloads: 16 per node as in the FlexMARL paper
    assert all(w.cluster.accelerators_per_node == (16 if w.name.startswith("paper_") else 8)
               for w in workloads)


def test_example_shapes() -> None:
    debate = load_workload(EXAMPLES / "math_debate.yaml")
    assert [a.model.name for a in debate.agents] == ["qwen2.5-7b"] * 3
    assert debate.graph.rounds == 2
    round2 = [n for n in debate.episode_nodes() if n.round == 2]
    assert len(round2) == 3 and all(len(n.inputs) == 3 for n in round2)

    pcr = load_workload(EXAMPLES / "planner_coder_reviewer.yaml")
    sizes = {a.name: a.model.name for a in pcr.agents}
    assert sizes == {"planner": "qwen2.5-72b", "coder": "qwen2.5-7b", "reviewer": "qwen2.5-1.5b"}
    coder, reviewer = pcr.agent("coder"), pcr.agent("reviewer")
    assert coder.output_length.mean == 4 * reviewer.output_length.mean
    x = coder.output_length.sample(np.random.default_rng(0), 20_000)
    assert np.percentile(x, 99) / np.median(x) > 5  # long-tailed

    service = load_workload(EXAMPLES / "customer_service.yaml")
    assert len(service.agents) == 8
    assert max(len(e.dst) for e in service.graph.edges) >= 1
    router_children = [n for n in service.episode_nodes() if "router@1" in n.inputs]
    assert len(router_children) >= 5  # fan-out to the specialists
    assert service.calls_per_episode("tech_support") == 2

    star = load_workload(EXAMPLES / "star_hub.yaml")
    leaves = [a for a in star.agents if a.name != "hub"]
    assert len(leaves) >= 8
    assert all(a.model.params < star.agent("hub").model.params for a in leaves)
    hub2 = next(n for n in star.episode_nodes() if n.id == "hub@2")
    assert len(hub2.inputs) == len(leaves) + 1  # every leaf plus its own round-1 breakdown


def test_conditional_edges_prune_nodes_deterministically() -> None:
    service = load_workload(EXAMPLES / "customer_service.yaml")
    full = {n.id for n in service.episode_nodes()}
    draws = [
        [n.id for n in service.episode_nodes(np.random.default_rng(seed))] for seed in range(50)
    ]
    again = [
        [n.id for n in service.episode_nodes(np.random.default_rng(seed))] for seed in range(50)
    ]
    assert draws == again
    assert all(set(d) <= full and "router@1" in d for d in draws)
    assert any(len(d) < len(full) for d in draws)
    # A supervisor only runs when at least one specialist ran.
    for d in draws:
        specialists = {i.split("@")[0] for i in d} - {"router", "supervisor", "summariser"}
        assert ("supervisor@1" in d) == bool(specialists)


def test_derived_counts() -> None:
    workload = parse_workload(BASE)
    assert workload.episodes_per_iteration == 8
    assert workload.cluster.total_accelerators == 8
    assert workload.calls_per_episode("solver") == 1
    assert [n.id for n in workload.episode_nodes()] == ["solver@1", "verifier@1"]


def test_custom_model_and_accelerator_specs() -> None:
    data = _with(
        ["agents", 0, "model"],
        {
            "name": "mine",
            "params": 2e9,
            "layers": 20,
            "hidden": 2048,
            "kv_heads": 4,
            "head_dim": 128,
        },
    )
    workload = parse_workload(data)
    assert workload.agents[0].model.params == 2e9
    assert workload.agents[1].model == get_model("1.5B")


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (["agents", 0, "tp"], 0, "agents[0] (solver).tp"),
        (["agents", 1, "output_length", "sigma"], -1, "agents[1] (verifier).output_length.sigma"),
        (["agents", 0, "model"], "13B", "agents[0] (solver).model"),
        (["cluster", "accelerator"], "TPUv5", "cluster.accelerator"),
        (["cluster", "nodes"], "many", "cluster.nodes"),
        (["rollout", "group_size"], -2, "rollout.group_size"),
        (["agents", 0, "tpp"], 2, "agents[0] (solver).tpp"),
        (["graph", "edges", 0, "dst"], "critic", "graph.edges[0].dst[0]"),
        (["graph", "edges", 0, "lag"], 1, "graph.edges[0].lag"),
        (["agents", 0, "tp"], 16, "agents[0] (solver).tp"),
        (["agents", 1, "name"], "solver", "agents[1].name"),
    ],
)
def test_bad_field_is_named(tmp_path: Path, path: list[Any], value: Any, field: str) -> None:
    bad = _write(tmp_path, _with(path, value))
    with pytest.raises(WorkloadError) as info:
        load_workload(bad)
    message = str(info.value)
    assert message.startswith(f"{bad}: ")
    assert f"{bad}: {field}: " in message
    assert any(f == field for f, _ in info.value.problems)


def test_error_messages_explain(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="unknown accelerator 'TPUv5'; known: H800"):
        parse_workload(_with(["cluster", "accelerator"], "TPUv5"))
    with pytest.raises(WorkloadError, match="unknown agent 'critic'; agents are: solver"):
        parse_workload(_with(["graph", "edges", 0, "dst"], "critic"))
    with pytest.raises(WorkloadError, match="unknown field"):
        parse_workload(_with(["agents", 0, "tpp"], 2))
    with pytest.raises(WorkloadError, match=r"weights need .* GB per device at tp=1"):
        parse_workload(_with(["agents", 0, "model"], "72B"))


def test_graph_errors() -> None:
    cycle = _with(
        ["graph", "edges"],
        [{"src": "solver", "dst": "verifier"}, {"src": "verifier", "dst": "solver"}],
    )
    with pytest.raises(WorkloadError, match="cycle: solver -> verifier -> solver"):
        parse_workload(cycle)
    self_loop = _with(["graph", "edges"], [{"src": "solver", "dst": "solver"}])
    with pytest.raises(WorkloadError, match="feeds itself in the same round; use lag: 1"):
        parse_workload(self_loop)
    two_rounds = _with(["graph", "rounds"], 2)
    two_rounds["agents"][0]["calls_per_episode"] = 3
    with pytest.raises(WorkloadError, match=r"agents\[0\] \(solver\)\.calls_per_episode"):
        parse_workload(two_rounds)
    beyond = _with(["agents", 0, "rounds"], [1, 3])
    with pytest.raises(WorkloadError, match="round 3 is beyond graph.rounds = 1"):
        parse_workload(beyond)
    big = _with(["cluster", "accelerators_per_node"], 1)
    with pytest.raises(WorkloadError, match="needs 2 accelerators, the cluster has 1"):
        parse_workload(big)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read file"):
        load_workload(tmp_path / "missing.yaml")
    with pytest.raises(WorkloadError, match="invalid YAML"):
        load_workload(_write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(WorkloadError, match="expected a mapping at top level, got list"):
        load_workload(_write(tmp_path, "- 1\n- 2\n"))
    missing = copy.deepcopy(BASE)
    del missing["rollout"]
    with pytest.raises(WorkloadError, match="rollout: Field required"):
        load_workload(_write(tmp_path, missing))


def test_workload_is_a_pydantic_model() -> None:
    workload = parse_workload(BASE)
    assert isinstance(workload, Workload)
    assert Workload.model_validate(workload.model_dump()) == workload


def test_training_spec_sets_forward_passes_and_micro_batch() -> None:
    from flexmarl.sim.task import workload_config

    wl = load_workload(EXAMPLES / "solver_verifier.yaml")
    assert wl.training.forward_passes == 2  # GRPO: old-policy and reference log-probs
    assert wl.micro_batch_size == max(wl.rollout.group_size, wl.episodes_per_iteration // 32)
    data = yaml.safe_load((EXAMPLES / "solver_verifier.yaml").read_text())
    data["training"] = {"micro_batch_size": 16, "reference_forward": False}
    wl = parse_workload(data)
    assert wl.training.forward_passes == 1 and wl.micro_batch_size == 16
    assert workload_config(wl, mode="async").train.micro_batch_size == 16
