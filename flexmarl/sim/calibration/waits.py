"""Where a run's wall time goes between its workers' busy spans: the same figures from a real
run's trace.json and from the mirror's spans of the same config (`benchmarks/critical_path.py`
prints them side by side).

The spans are the workers' own (`gen:` / `load:` of a replica, `swap:` / `acc:` / `step:` /
`publish:` of a training slot), so what they leave out is what the workers waited for. Over
the iterations after the first (from the first `rollout_plan` event, else the first span, to
the last span's end), in seconds an iteration:

- `state`: the wall time by which pools were busy at once: `both`, `rollout` only, `train`
  only, `none` (no worker busy: the driver's own work, messages in flight, or a wait on the
  driver);
- `replica_wait:KIND`: a replica's idle gaps by the span that ended them (`gen`: it waited
  for requests; `load`: for a version); `slot_wait:KIND` alike for the training slots
  (`swap`: a `bind`, `acc`: a micro-batch, `step`, `publish`), with their counts
  (`n_replica_wait:KIND`, `n_slot_wait:KIND`);
- `busy:POOL:KIND`: the busy seconds by span kind.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any


def _kind(label: str) -> str:
    return label.split(":", 1)[0]


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def window(spans: Sequence[Any], events: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """The iterations after the first: from the first `rollout_plan` event (the first
    iteration's rollout done), else the first span's start, to the last span's end."""
    plans = [float(e["time"]) for e in events if e.get("name") == "rollout_plan"]
    lo = min(plans) if plans else min((s.start for s in spans), default=0.0)
    hi = max((s.end for s in spans), default=lo)
    return lo, hi


def waits(spans: Sequence[Any], lo: float, hi: float, iterations: float) -> dict[str, float]:
    """The figures of the module docstring over [lo, hi], in seconds over `iterations`
    (counts too)."""
    per = max(iterations, 1e-9)
    out: dict[str, float] = defaultdict(float)
    inside = [s for s in spans if s.end > lo and s.start < hi]
    busy: dict[str, list[tuple[float, float]]] = {}
    for pool in ("rollout", "train"):
        busy[pool] = _union((max(s.start, lo), min(s.end, hi)) for s in inside
                            if s.pool == pool)
    # the state timeline: every boundary of either pool's busy intervals
    cuts = sorted({lo, hi, *(t for iv in busy.values() for a, b in iv for t in (a, b))})

    def on(pool: str, t: float) -> bool:
        return any(a <= t < b for a, b in busy[pool])

    for a, b in zip(cuts, cuts[1:], strict=False):
        if b <= a:
            continue
        mid = (a + b) / 2
        r, t = on("rollout", mid), on("train", mid)
        out["state:" + ("both" if r and t else "rollout" if r else "train" if t else "none")] \
            += (b - a) / per
    for s in inside:
        out[f"busy:{s.pool}:{_kind(s.label)}"] += (min(s.end, hi) - max(s.start, lo)) / per
    for pool, name in (("rollout", "replica_wait"), ("train", "slot_wait")):
        workers = sorted({s.worker for s in spans if s.pool == pool})
        for w in workers:
            mine = sorted((s for s in spans if s.pool == pool and s.worker == w),
                          key=lambda s: s.start)
            cur = lo
            for s in mine:
                if s.end <= lo:
                    continue
                if s.start >= hi:
                    break
                if s.start > cur:
                    out[f"{name}:{_kind(s.label)}"] += (s.start - cur) / per
                    out[f"n_{name}:{_kind(s.label)}"] += 1 / per
                cur = max(cur, s.end)
    return dict(out)


def figures(spans: Sequence[Any], events: Sequence[dict[str, Any]],
            iterations: int) -> dict[str, float]:
    """`waits` over the iterations after the first of a run with `iterations` iterations."""
    lo, hi = window(spans, events)
    return waits(spans, lo, hi, max(1, iterations - 1))
