"""A machine profile's data: small named linear cost models (`Fit`) and the profile JSON
(`LocalProfile`) that the profiler writes and the mirror reads."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_VERSION = 1


# --- fitting ---------------------------------------------------------------------------------
@dataclass
class Fit:
    """time = sum(coef[t] * x[t]) over named terms; the term `1` is the fixed overhead."""

    terms: list[str]
    coef: dict[str, float]
    rmse: float = 0.0
    n: int = 0
    unit: str = "s"

    def __call__(self, **x: float) -> float:
        return float(sum(c * (1.0 if t == "1" else float(x.get(t, 0.0)))
                         for t, c in self.coef.items()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fit:
        return cls(list(d["terms"]), {k: float(v) for k, v in d["coef"].items()},
                   float(d.get("rmse", 0.0)), int(d.get("n", 0)), d.get("unit", "s"))


def fit_linear(terms: Sequence[str], xs: Sequence[Mapping[str, float]],
               ys: Sequence[float]) -> Fit:
    """Least squares of ys on the named terms; a term whose coefficient comes out negative is
    dropped (a cost cannot shrink with more work) and the rest refitted."""
    if len(xs) != len(ys) or not ys:
        raise ValueError("fit_linear: need as many measurements as inputs, at least one")
    y = np.asarray(ys, dtype=float)
    active = list(terms)
    while True:
        a = np.array([[1.0 if t == "1" else float(x[t]) for t in active] for x in xs])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None) if active else (np.zeros(0),)
        neg = [t for t, c in zip(active, coef, strict=True) if c < 0]
        if not neg:
            break
        worst = min(zip(active, coef, strict=True), key=lambda tc: tc[1])[0]
        active.remove(worst)
    pred = a @ coef if active else np.zeros_like(y)
    rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
    out = dict.fromkeys(terms, 0.0)
    out.update({t: float(c) for t, c in zip(active, coef, strict=True)})
    return Fit(list(terms), out, rmse, len(ys))


def constant(ys: Sequence[float], how: str = "median") -> Fit:
    """A cost that does not depend on size: the median (or `min`) of its measurements."""
    ys = list(ys)
    value = float(min(ys) if how == "min" else statistics.median(ys))
    return Fit(["1"], {"1": value}, float(np.std(ys)), len(ys))


# --- the profile ----------------------------------------------------------------------------
@dataclass
class AgentProfile:
    fits: dict[str, Fit]
    # measured output lengths of the agent's nodes, and whether its requests had stop tokens
    output_lengths: list[int] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    stops: bool = False
    weights_bytes: int = 0  # published weights in wire form, pickled


@dataclass
class LocalProfile:
    config: str
    torch_threads: int
    agents: dict[str, AgentProfile]
    ipc: dict[str, Fit]
    parent_per_request_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    measured_s: float = 0.0
    parent_per_train_call_s: float = 0.0
    # worker scale: measured cost in the run's own worker processes, in the run's order of
    # work (agents interleaved, states swapped, payloads over the pipe), over the in-process
    # fits' prediction; by command (`bind`, `accumulate`, `step`; `rollout`: a replica's turn)
    worker_scale: dict[str, float] = field(default_factory=dict)
    # the machine's speed curve (`measure_contention`): contention[k-1] is how fast each of k
    # busy processes runs, relative to one alone; empty (an older profile): processor sharing,
    # cores / n
    contention: list[float] = field(default_factory=list)
    # how much the repeated measurements of a quantity differed: (max - min) / median over
    # the profiler's rounds, by quantity (`rollout`, `train_accumulate`, ..., `contention_2`)
    spread: dict[str, float] = field(default_factory=dict)
    # what the costs count: "cpu", CPU seconds of the process doing the work (other users'
    # preemption left out; `contention` then is the speed of a CPU second with k busy), or
    # "wall" (an older profile: wall seconds at the profile's load)
    clock: str = "wall"
    # a training slot's CPU seconds a command with another of the run's processes busy next to
    # it (a rollout replica decoding), over the same command's alone, by command (`train_bind`,
    # `train_accumulate`, `train_step`): shared caches and memory bandwidth; empty: none
    overlap: dict[str, float] = field(default_factory=dict)
    # the driver's CPU as a real run of the config spends it (`profile.measure_driver`):
    # `per_request_s` / `per_train_call_s` from a sync run's rollout and training phases, and
    # `pipelined` its CPU an iteration in an async run over what those charge the same work
    # (1.0 where it was not measured); `echo_*` the zero-cost-worker measure beside them
    driver: dict[str, float] = field(default_factory=dict)
    # the profile's own real sync run against its mirror (`profile.in_situ_scales`): the real
    # busy seconds of each kind of work over the mirror's, by `worker_scale` key; already
    # multiplied into `worker_scale` (kept to show how far the fits were off in situ)
    in_situ: dict[str, float] = field(default_factory=dict)

    def driver_scale(self, mode: str) -> float:
        """The driver's CPU per request and training call in `pipeline.mode` `mode` over the
        sync run's: measured in an async run (overlapped rollout and training)."""
        return 1.0 if mode == "sync" else float(self.driver.get("pipelined", 1.0))

    def scale(self, kind: str) -> float:
        return float(self.worker_scale.get(kind, 1.0))

    def agent(self, name: str) -> AgentProfile:
        return self.agents[name]

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalProfile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, expected {PROFILE_VERSION}")
        agents = {
            a: AgentProfile({k: Fit.from_dict(f) for k, f in p["fits"].items()},
                            [int(v) for v in p.get("output_lengths", [])],
                            [int(v) for v in p.get("prompt_lengths", [])],
                            bool(p.get("stops", False)), int(p.get("weights_bytes", 0)))
            for a, p in d["agents"].items()
        }
        return cls(d["config"], int(d["torch_threads"]), agents,
                   {k: Fit.from_dict(f) for k, f in d["ipc"].items()},
                   float(d.get("parent_per_request_s", 0.0)), dict(d.get("machine", {})),
                   float(d.get("measured_s", 0.0)), float(d.get("parent_per_train_call_s", 0.0)),
                   {k: float(v) for k, v in d.get("worker_scale", {}).items()},
                   [float(v) for v in d.get("contention", [])],
                   {k: float(v) for k, v in d.get("spread", {}).items()},
                   str(d.get("clock", "wall")),
                   {k: float(v) for k, v in d.get("overlap", {}).items()},
                   {k: float(v) for k, v in d.get("driver", {}).items()},
                   {k: float(v) for k, v in d.get("in_situ", {}).items()})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> LocalProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))

