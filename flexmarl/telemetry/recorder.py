"""Spans, busy fractions, metrics.jsonl and a Chrome trace: where the time goes, per worker.

Metric names are fixed across algorithms (see `METRIC_NAMES` in the README): a dashboard built
for one run works for every run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.telemetry.loggers import scalars


@dataclass(slots=True)
class Span:
    pool: str
    worker: int
    start: float
    end: float
    label: str


class Telemetry:
    def __init__(
        self, out_dir: Path | None = None, clock: Callable[[], float] = time.time,
        loggers: list[Any] | None = None, log_every: int = 1, last_iteration: int | None = None,
    ) -> None:
        """`clock` is wall time for real runtimes and the virtual clock for the simulator;
        `loggers` (telemetry.loggers) get the scalars of every `log_every`-th iteration's
        record and of `last_iteration`'s (`train.log_every`), besides metrics.jsonl, which
        gets every record."""
        self.out_dir = out_dir
        self.now = clock
        self.t0 = clock()
        self.spans: list[Span] = []
        self.events: list[dict[str, Any]] = []
        self._metrics_file = None
        self._samples_file: Any = None
        self.loggers = list(loggers or [])
        self.log_every, self.last_iteration = log_every, last_iteration
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._metrics_file = (out_dir / "metrics.jsonl").open("w")

    # --- spans --------------------------------------------------------------------------------
    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        self.spans.append(Span(pool, worker, start, end, label))

    def event(self, name: str, **fields: Any) -> None:
        self.events.append({"name": name, "time": self.now(), **fields})

    def fault(self, name: str, **fields: Any) -> None:
        """A failure, recovery or checkpoint: an event in the trace *and* a line
        `{"event": name, "time": ..., ...}` in metrics.jsonl, so a run's faults are auditable
        from its metrics alone."""
        self.event(name, **fields)
        if self._metrics_file is not None:
            line = {"event": name, "time": self.now(), **fields}
            self._metrics_file.write(json.dumps({k: _json_safe(v) for k, v in line.items()}) + "\n")
            self._metrics_file.flush()

    # `first`: the index of the first span that may matter (a caller whose windows only move
    # forward skips the spans that ended before them)
    def busy_seconds(self, pool: str, t0: float, t1: float, first: int = 0) -> float:
        total = 0.0
        for s in self.spans[first:]:
            if s.pool == pool and s.end > t0 and s.start < t1:
                total += min(s.end, t1) - max(s.start, t0)
        return total

    def busy_by_worker(self, pool: str, n_workers: int, t0: float, t1: float,
                       first: int = 0) -> list[float]:
        """Busy seconds of each worker of `pool` within [t0, t1]."""
        out = [0.0] * n_workers
        for s in self.spans[first:]:
            if s.pool == pool and s.end > t0 and s.start < t1 and 0 <= s.worker < n_workers:
                out[s.worker] += min(s.end, t1) - max(s.start, t0)
        return out

    def labelled(self, pool: str, prefix: str, t0: float, t1: float, first: int = 0
                 ) -> dict[str, tuple[int, float]]:
        """Spans of `pool` whose label starts with `prefix` and that ended within (t0, t1]:
        per agent (the label's second field), their count and their seconds."""
        out: dict[str, tuple[int, float]] = {}
        for s in self.spans[first:]:
            if s.pool == pool and t0 < s.end <= t1 and s.label.startswith(prefix):
                parts = s.label.split(":")
                agent = parts[1] if len(parts) > 1 else ""
                n, secs = out.get(agent, (0, 0.0))
                out[agent] = (n + 1, secs + s.end - s.start)
        return out

    def busy_frac(self, pool: str, n_workers: int, t0: float, t1: float,
                  first: int = 0) -> float:
        if t1 <= t0 or n_workers <= 0:
            return 0.0
        return self.busy_seconds(pool, t0, t1, first) / ((t1 - t0) * n_workers)

    # --- metrics -----------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _json_safe(v) for k, v in record.items()}
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(clean) + "\n")
            self._metrics_file.flush()
        step = int(record.get("iteration", 0))
        if self.loggers and ((step + 1) % self.log_every == 0 or step == self.last_iteration):
            values = scalars(clean)
            for logger in self.loggers:
                logger.log(step, values)

    def samples(self, samples: list[dict[str, Any]]) -> None:
        """Sampled rows as the agents saw and said them, one JSON line each in
        OUT/samples.jsonl (appended: a resumed run keeps the lines before it)."""
        if self.out_dir is None or not samples:
            return
        if self._samples_file is None:
            self._samples_file = (self.out_dir / "samples.jsonl").open("a")
        for sample in samples:
            self._samples_file.write(json.dumps({k: _json_safe(v) for k, v in sample.items()})
                                     + "\n")
        self._samples_file.flush()

    def write_trace(self, path: Path) -> Path:
        """Chrome trace format (chrome://tracing, Perfetto): one process per pool, one thread
        per worker, one complete event per span."""
        pools = sorted({s.pool for s in self.spans})
        pid = {p: i + 1 for i, p in enumerate(pools)}
        events: list[dict[str, Any]] = []
        for p in pools:
            events.append({"ph": "M", "name": "process_name", "pid": pid[p], "args": {"name": p}})
        for s in self.spans:
            parts = s.label.split(":")
            events.append({
                "ph": "X",
                "name": s.label,
                "cat": parts[0],
                "pid": pid[s.pool],
                "tid": s.worker,
                "ts": (s.start - self.t0) * 1e6,
                "dur": max(s.end - s.start, 0.0) * 1e6,
                "args": {"agent": parts[1] if len(parts) > 1 else ""},
            })
        for e in self.events:
            events.append({"ph": "i", "s": "g", "name": e["name"], "pid": 0, "tid": 0,
                           "ts": (e["time"] - self.t0) * 1e6,
                           "args": {k: _json_safe(v) for k, v in e.items() if k != "time"}})
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def close(self, status: str = "completed") -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self._samples_file is not None:
            self._samples_file.close()
            self._samples_file = None
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close(status)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def read_trace(path: Path) -> tuple[list[Span], list[dict[str, Any]]] | None:
    """A trace `Telemetry.write_trace` wrote, back as its spans (times in seconds on the
    trace's clock) and its instant events (`name`, `time`, and their args); None when the
    file is missing or not such a trace."""
    try:
        events = json.loads(path.read_text())["traceEvents"]
        pools = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        spans = [Span(pools.get(e["pid"], ""), int(e.get("tid", 0)), e["ts"] / 1e6,
                      (e["ts"] + e.get("dur", 0.0)) / 1e6, e["name"])
                 for e in events if e.get("ph") == "X"]
        instants = [{**(e.get("args") or {}), "name": e["name"], "time": e["ts"] / 1e6}
                    for e in events if e.get("ph") == "i"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return spans, instants
