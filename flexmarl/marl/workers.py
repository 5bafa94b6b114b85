"""The classic MARL worker processes' entry points and spec, in a module that imports no LLM
stack (a spawned worker unpickles its spec first: importing the runtime's pools there would
pull in transformers, seconds of start-up per worker for nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from flexmarl.config.schema import RunConfig
from flexmarl.marl.offpolicy import QRollout
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.rollout import EnvRollout
from flexmarl.runtime.local.workers import (
    WorkerSpec,
    _setup_torch,
    from_numpy,
    serve_slot,
    start_heartbeat,
)
from flexmarl.training.algorithms.vdn import VdnConfig


@dataclass
class MarlWorkerSpec(WorkerSpec):
    """`WorkerSpec` (threads, heartbeats, swap folder) plus the run's policies, this
    worker's index (which environments it owns) and whether each rollout returns the
    environment state it leaves (for checkpoints and for redoing an iteration on a restarted
    worker)."""

    layouts: dict[str, PolicyLayout] = field(default_factory=dict)
    index: int = 0
    capture_state: bool = False


class RolloutHost:
    """A rollout worker's commands over its environments (`EnvRollout`, or VDN/QMIX's
    epsilon-greedy `QRollout`): `load_weights`
    (policy, version, wire), `rollout` (k), and `get_state` / `set_state` (its environments'
    state). The same host is served by a local worker process (`marl_rollout_worker_main`)
    and, on Ray, by the same main in an actor (`runtime.ray.transport.PipeActor`)."""

    def __init__(self, spec: MarlWorkerSpec) -> None:
        cfg = RunConfig.model_validate(spec.config)
        # spaces were checked in the driver; VDN / QMIX act epsilon-greedily (marl/offpolicy.py)
        self.env: EnvRollout | QRollout = (
            QRollout if isinstance(cfg.env_algorithm, VdnConfig)
            else EnvRollout)(cfg, spec.layouts, spec.index)
        self.capture_state = spec.capture_state

    def handle(self, command: str, payload: Any) -> tuple[Any, str]:
        """One command -> (result, span label)."""

        if command == "load_weights":
            name, version, weights = payload
            self.env.load(name, version, from_numpy(weights))
            return version, f"load:{name}"
        if command == "rollout":
            result = self.env.run(payload)
            if self.capture_state:  # the state iteration k+1 starts from
                result.state = self.env.get_state()
            return result, f"rollout:{payload}"
        if command == "get_state":
            return self.env.get_state(), "get_state"
        if command == "set_state":
            self.env.set_state(payload)
            return None, "set_state"
        raise ValueError(f"unknown command {command!r}")


def marl_rollout_worker_main(conn: Connection, spec: MarlWorkerSpec) -> None:
    """A rollout worker process: the shared command loop (`serve_slot`) over a
    `RolloutHost`."""

    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    serve_slot(conn, RolloutHost(spec).handle, pool="rollout")
