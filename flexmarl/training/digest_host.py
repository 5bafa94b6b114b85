"""A training slot without models: `TrainHost`'s slot protocol over digest states.

The calibration mirror (`sim.calibration.mirror`) prices a run's training commands from a
profile and needs only the protocol's bookkeeping (who is resident, versions, pending
micro-batches, what a swap carries); the orchestrator's tests use the same host through
`testing.fakes`. A "weight" here is a digest of everything trained into it, in order, so two
runs that trained the same rows in the same micro-batches end with the same digest.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from typing import Any

import numpy as np

from flexmarl.api.runtime import WorkerError
from flexmarl.types import Bound


def digest(*parts: Any) -> str:
    """A stable hex digest of `repr` of the parts (the fakes' weights and sampling keys)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def weights_of(d: str) -> dict[str, np.ndarray]:
    """The fake weights of a digest: what `publish` and checkpoints carry."""
    return {"digest": np.frombuffer(bytes.fromhex(d), dtype=np.uint8).copy()}


def digest_of(weights: dict[str, np.ndarray]) -> str:
    return bytes(np.asarray(weights["digest"], dtype=np.uint8)).hex()



class DigestSlotHost:
    """One training slot without models: the slot protocol of `training.host.TrainHost`
    (bind, accumulate, step, weights, save, get_state, set_state) over digest states, with
    the same rule that only the resident agent takes commands. A state is
    `(weights digest, version, pending micro-batch digests)`.

    `parks`: like a `TrainHost` whose trainers keep their states, a swapped-out state stays
    here too under a token (`Bound.parked`): `("kept", token)` swaps it back in,
    and with `send_out` False it is the only copy (the driver's restart point plus its
    journal rebuild it)."""

    def __init__(self, parks: bool = False) -> None:
        self.resident: str | None = None
        self.states: dict[str, tuple[str, int, list[str]]] = {}
        self.builds: dict[str, int] = defaultdict(int)  # initial states made, per agent
        self.commands: list[tuple[str, str]] = []  # (command, agent), in order
        self.parks = parks
        self.parked: dict[str, tuple[int, tuple[str, int, list[str]]]] = {}
        self._tokens = itertools.count(1)
        self.kept_in = self.kept_out = 0  # swaps in from a parked state; swaps out kept here

    def _bind(self, agent: str, incoming: Any, send_out: bool = True) -> Bound:
        token: int | None = None
        kept = incoming is not None and incoming[0] == "kept"
        if kept and (agent not in self.parked or self.parked[agent][0] != incoming[1]):
            raise WorkerError(f"agent {agent!r}: no state kept on this slot for token "
                              f"{incoming[1]!r}")  # (`training.host.NOT_KEPT`)
        out_agent: str | None = None
        out_state: tuple[str, Any] | None = None
        if self.resident is not None and self.resident != agent:
            out_agent, state = self.resident, self.states.pop(self.resident)
            out_state = ("host", state)
            if self.parks:
                token = next(self._tokens)
                self.parked[out_agent] = (token, state)
                if not send_out:
                    out_state = ("restart", None)
                    self.kept_out += 1
        parked = self.parked.pop(agent, None)
        if kept:
            assert parked is not None
            self.states[agent] = parked[1]
            self.kept_in += 1
        elif incoming is not None:
            self.states[agent] = incoming[1]
        elif agent not in self.states:
            self.builds[agent] += 1
            self.states[agent] = (digest("init", agent), 0, [])
        self.resident = agent
        return Bound(out_agent, out_state, token, {"swap_in_s": 0.0})

    def _state(self, agent: str) -> tuple[str, int, list[str]]:
        if agent != self.resident:
            raise WorkerError(f"agent {agent!r} is not resident on this model-free slot "
                              f"(resident: {self.resident})")
        return self.states[agent]

    def handle(self, command: str, payload: Any) -> Any:
        agent = payload if isinstance(payload, str) else payload[0]
        self.commands.append((command, agent))
        if command == "bind":
            return self._bind(agent, payload[1], *payload[2:])
        weights, version, pending = self._state(agent)
        if command == "accumulate":
            rows = payload[1]
            self.states[agent] = (weights, version, [*pending, digest([s.sample_id
                                                                      for s in rows])])
            return {"rows": float(len(rows))}
        if command == "step":
            self.states[agent] = (digest(weights, pending), version + 1, [])
            return {"micro_batches": float(len(pending))}, weights_of(self.states[agent][0])
        if command == "weights":
            return weights_of(weights)
        if command == "save":
            return f"{payload[1]}/{agent}"
        if command == "get_state":
            return weights_of(weights), {"version": version, "pending": list(pending)}
        if command == "set_state":
            _, arrays, meta = payload
            self.states[agent] = (digest_of(arrays), int(meta["version"]), list(meta["pending"]))
            return int(meta["version"])
        raise WorkerError(f"model-free slot: unknown command {command!r}")
