"""The chaos benchmark cannot print a clean table without having injected a fault."""

from pathlib import Path

import pytest

from flexmarl.bench.chaos import ChaosError, bench_chaos, fault_recovery_times

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "referential_game.yaml"


def test_a_chaos_run_without_a_fault_fails(tmp_path):
    with pytest.raises(ChaosError, match="no fault was injected"):
        bench_chaos(str(EXAMPLE), ["train.iterations=1", "train.inputs_per_iteration=4"],
                    kills=0, out=str(tmp_path))


def test_ray_faults_need_the_ray_runtime(tmp_path):
    with pytest.raises(ChaosError, match="needs runtime.kind=ray"):
        bench_chaos(str(EXAMPLE), ["train.iterations=1"], kills=1, fault="actor",
                    out=str(tmp_path))


def test_an_unknown_fault_is_named(tmp_path):
    with pytest.raises(ChaosError, match="'disk' is not one of process, actor, node"):
        bench_chaos(str(EXAMPLE), [], kills=1, fault="disk", out=str(tmp_path))


def test_a_node_fault_is_recovered_only_when_all_its_workers_are():
    kills = [{"pool": "rollout", "worker": 1, "time": 10.0, "fault": 0},
             {"pool": "train", "worker": 0, "time": 20.0, "fault": 1},
             {"pool": "rollout", "worker": 0, "time": 20.0, "fault": 1}]
    back = [{"event": "worker_recovered", "pool": "train", "worker": 0, "time": 25.0},
            {"event": "worker_recovered", "pool": "rollout", "worker": 1, "time": 13.0}]
    assert fault_recovery_times(kills, back) == [3.0]  # rollout 0 never came back
    back.append({"event": "worker_recovered", "pool": "rollout", "worker": 0, "time": 27.0})
    assert fault_recovery_times(kills, back) == [3.0, 7.0]
