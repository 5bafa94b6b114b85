"""The chaos benchmark on Ray: worker actors killed (`ray.kill`) and whole nodes removed from a
`ray.cluster_utils.Cluster`; each fault is detected and recovered, no row lost or trained twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.bench.chaos import bench_chaos

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "referential_game.yaml"
SMALL = ["train.iterations=4", "train.inputs_per_iteration=4", "runtime.rollout_workers=2",
         "runtime.kind=ray", "runtime.ray.rollout_bundle.cpus=0.5",
         "runtime.ray.train_bundle.cpus=0.5"]  # publication: auto (collective)


def assert_survived(report: dict, faults: int) -> None:
    assert report["faults_injected"] == faults
    assert report["faults_recovered"] == faults
    assert report["failures_detected"] == report["recoveries"] >= faults
    assert report["rows_lost"] == 0 and report["rows_duplicated"] == 0
    assert report["episodes_failed"] == 0


@pytest.mark.slow  # two Ray runs, fault-free and with one actor killed: ~1 min here
def test_killed_actors_are_recovered(tmp_path, ray_head):
    report = bench_chaos(str(EXAMPLE), [*SMALL, f"runtime.address={ray_head}"], kills=1,
                         fault="actor", out=str(tmp_path))
    assert_survived(report, 1)


@pytest.mark.slow  # a 3-node cluster, two Ray runs, a node removed and replaced: ~2 min here
def test_removed_nodes_are_recovered(tmp_path):
    # longer: Ray takes ~20 s to declare a removed node dead, the run must outlast that
    report = bench_chaos(str(EXAMPLE), [*SMALL, "runtime.ray.strategy=SPREAD",
                                        "train.iterations=10"], kills=1,
                         fault="node", nodes=2, node_cpus=1, out=str(tmp_path))
    assert_survived(report, 1)
    assert report["workers_taken_down"] >= 1
