"""The classic MARL worker processes' entry points and spec, in a module that imports no LLM
stack (a spawned worker unpickles its spec first: importing the runtime's pools there would
pull in transformers, seconds of start-up per worker for nothing)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from flexmarl.marl.policies import PolicyLayout
from flexmarl.runtime.local.workers import WorkerSpec


@dataclass
class MarlWorkerSpec(WorkerSpec):
    """`WorkerSpec` (threads, heartbeats, swap folder) plus the run's policies, this
    worker's index (which environments it owns) and whether each rollout returns the
    environment state it leaves (for checkpoints and for redoing an iteration on a restarted
    worker)."""

    layouts: dict[str, PolicyLayout] = field(default_factory=dict)
    index: int = 0
    capture_state: bool = False


def marl_rollout_worker_main(conn: Connection, spec: MarlWorkerSpec) -> None:
    """A rollout worker: `load_weights` (policy, version, wire), `rollout` (k), and
    `get_state` / `set_state` (its environments' state, `EnvRollout.get_state`)."""
    from flexmarl.marl.config import MarlRunConfig, VdnConfig
    from flexmarl.marl.offpolicy import QRollout
    from flexmarl.marl.rollout import EnvRollout
    from flexmarl.runtime.local.workers import _error, _setup_torch, from_numpy, start_heartbeat

    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    cfg = MarlRunConfig.model_validate(spec.config)
    # spaces were checked in the driver; VDN / QMIX act epsilon-greedily (marl/offpolicy.py)
    env: EnvRollout | QRollout = (QRollout if isinstance(cfg.algorithm, VdnConfig)
                                  else EnvRollout)(cfg, spec.layouts, spec.index)
    conn.send((-1, True, "ready", []))
    while True:
        msg_id, command, payload = conn.recv()
        t0 = time.time()
        try:
            if command == "stop":
                conn.send((msg_id, True, None, []))
                return
            if command == "load_weights":
                name, version, weights = payload
                env.load(name, version, from_numpy(weights))
                result: Any = version
                label = f"load:{name}"
            elif command == "rollout":
                result = env.run(payload)
                if spec.capture_state:  # the state iteration k+1 starts from
                    result.state = env.get_state()
                label = f"rollout:{payload}"
            elif command == "get_state":
                result, label = env.get_state(), "get_state"
            elif command == "set_state":
                env.set_state(payload)
                result, label = None, "set_state"
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send((msg_id, True, result, [(t0, time.time(), label)]))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send((msg_id, False, _error(exc), []))
