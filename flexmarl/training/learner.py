"""The Learner role: what a training slot (`training/host.py`'s `TrainHost`) needs of whatever
it trains, so one host serves the LLM trainer (`training/trainer.py`'s `AgentTrainer`), the
on-policy network learner (MAPPO/IPPO, `marl/learner.py`'s `PolicyLearner`) and the replay
learner (VDN/QMIX, `marl/offpolicy.py`'s `QLearner`) alike.

On- and off-policy learners differ in where their rows come from (iteration k's rows, or a
replay table sampled by priority and age), not in how a slot hosts them: both take an
iteration's rows with `accumulate`, train on `step`, and publish a new version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from safetensors.torch import save_file

from flexmarl.training.state import TrainingState, to_wire

# (sample_id, version, step, epoch): which row a step used, as the learner saw it
Audit = list[tuple[str, int, int, int]]


@runtime_checkable
class Learner(Protocol):
    """One agent's (or one group of agents', for a joint learner such as VDN/QMIX) trainer.

    - `accumulate(rows)` hands it rows of the version it trains; `step()` trains on them and
      moves `version` on; `trained_on` is the last step's audit (None: not recorded);
    - `weights()` is what a rollout worker loads; `save(directory)` writes them to disk;
    - `capture()` / `restore(state)` move an exact state (a swap between slots);
      `get_state()` / `set_state(arrays, meta)` are the same as numpy arrays and JSON-able
      meta (a restart point a restarted slot is restored from);
    - `state_objects()`: the modules and optimizers it holds (the slot's memory figures)."""

    agent: str
    version: int
    trained_on: Audit | None

    def accumulate(self, samples: Any) -> dict[str, float]: ...

    def step(self) -> dict[str, float]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def save(self, directory: str) -> str | Path: ...

    def capture(self) -> TrainingState: ...

    def restore(self, state: TrainingState) -> None: ...

    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...

    def set_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None: ...

    def state_objects(self) -> list[Any]: ...


class CapturedRestartPoint:
    """`get_state` / `set_state` for a learner whose exact state is `capture()`'s: the
    restart point is the captured state as numpy arrays (a network learner's is small)."""

    def capture(self) -> TrainingState:
        raise NotImplementedError

    def restore(self, state: TrainingState) -> None:
        raise NotImplementedError

    def get_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        state = self.capture()
        return {k: v.numpy() for k, v in state.tensors.items()}, state.meta

    def set_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in arrays.items()}
        self.restore(TrainingState(tensors, meta))


class NetworkLearner(CapturedRestartPoint):
    """What the classic-MARL learners (on-policy `PolicyLearner`, replay `QLearner`) share:
    step k takes iteration k's rows of version k only (`accumulate`), ends by moving to
    version k+1 with its audit (`_stepped`), and saves `save_tensors()` as safetensors."""

    agent: str
    version: int
    pending: list[Any]
    trained_on: Audit | None
    error: type[Exception] = RuntimeError
    rows_name: str = "row"  # how a message names one sample ("transitions" for replay)

    def accumulate(self, samples: list[Any]) -> dict[str, float]:
        for s in samples:
            if s.iteration != self.version or s.version != self.version:
                raise self.error(
                    f"policy {self.agent!r}: {self.rows_name} {s.sample_id} of iteration "
                    f"{s.iteration}, version {s.version}; step {self.version} trains on iteration "
                    f"{self.version}'s rows of version {self.version} only")
        self.pending += samples
        return {"rows": float(len(samples))}

    def _held(self) -> int:
        """The step about to run (k = version); it needs rows."""
        if not self.pending:
            raise self.error(f"policy {self.agent!r}: step {self.version} has no rows")
        return self.version

    def _stepped(self, audit: Audit) -> None:
        self.pending = []
        self.version += 1
        self.trained_on = audit

    def _check_state(self, state: TrainingState) -> None:
        """A state is restored only into the learner of the policy it was captured from."""
        if state.meta.get("agent") != self.agent:
            raise ValueError(f"state of policy {state.meta.get('agent')!r} offered to "
                             f"learner {self.agent!r}")

    def save_tensors(self) -> dict[str, torch.Tensor]:
        return self.weights()

    def weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def save(self, directory: str) -> str:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / "model.safetensors"
        save_file({k: v.contiguous() for k, v in self.save_tensors().items()}, str(path))
        return str(path)


def published_form(learner: Learner) -> Any:
    """The learner's weights as published: the state interface's wire form (one flat buffer,
    any dtype; bf16/fp16 have no numpy equivalent); the last step's audit rides along in the
    metadata (`trained_on`)."""
    meta: dict[str, Any] = {"agent": learner.agent, "version": learner.version}
    if learner.trained_on is not None:
        meta["trained_on"] = learner.trained_on
    return to_wire(TrainingState(learner.weights(), meta))
