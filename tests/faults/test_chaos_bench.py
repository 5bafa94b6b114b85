"""The chaos benchmark cannot print a clean table without having injected a fault."""

from pathlib import Path

import pytest

from flexmarl.bench.chaos import ChaosError, bench_chaos

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "referential_game.yaml"


def test_a_chaos_run_without_a_fault_fails(tmp_path):
    with pytest.raises(ChaosError, match="no fault was injected"):
        bench_chaos(str(EXAMPLE), ["train.iterations=1", "train.inputs_per_iteration=4"],
                    kills=0, out=str(tmp_path))
