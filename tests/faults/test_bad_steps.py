"""A run whose updates blow up (a huge learning rate drives the weights to inf, the loss to
NaN): the poisoned steps are skipped with their reason logged, and the run stops with a clear
error once more than `train.max_skipped_steps` were skipped."""

import pytest

from flexmarl.orchestrator.joint import TrainingDiverged
from flexmarl.orchestrator.run import train
from tests.faults.conftest import config, events


def test_nan_steps_are_skipped_then_the_run_stops(tmp_path):
    cfg = config("agents.speaker.optim.lr=1e20", "agents.speaker.optim.max_grad_norm=null",
                 "agents.listener.optim.lr=1e20", "agents.listener.optim.max_grad_norm=null",
                 "train.max_skipped_steps=1", "train.iterations=6",
                 "runtime.deterministic=false", "train.checkpoint_every=null")
    with pytest.raises(TrainingDiverged, match="exceed train.max_skipped_steps=1") as info:
        train(cfg, tmp_path / "run")
    assert "non-finite" in str(info.value)
    skipped = events(tmp_path / "run", "step_skipped")
    assert len(skipped) == 2 and all("non-finite" in e["reason"] for e in skipped)
