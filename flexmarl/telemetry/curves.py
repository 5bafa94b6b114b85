"""Each agent's reward curve at the end of a run: first iterations against last ones, next to
the signs of a collapsed agent (the share of its most common answer, its entropy), so a
reader sees at once whether every agent learned."""

from __future__ import annotations

from typing import Any

import numpy as np


def _mean(records: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in records if key in r]
    return float(np.mean(values)) if values else float("nan")


def curve_points(values: list[float], points: int = 20) -> list[float]:
    """At most `points` values: one per iteration for short runs; for long ones the mean of
    consecutive, near-equal windows, so a 150-iteration run still prints on one line."""
    if len(values) <= points:
        return list(values)
    return [float(np.mean(w)) for w in np.array_split(np.asarray(values, dtype=float), points)]


def reward_curves(records: list[dict[str, Any]], agents: list[str], k: int = 3,
                  points: int = 20) -> list[str]:
    """Lines of a table: per agent the mean reward of the first `k` and last `k` iterations,
    the change, the most common answer's share and the entropy over the last `k`, and the
    curve (one reward per iteration, or `points` window means for a longer run)."""
    rows = [r for r in records if "iteration" in r and "event" not in r]
    if not rows or not agents:
        return []
    k = max(1, min(k, len(rows) // 2 or 1))
    first, last = rows[:k], rows[-k:]
    width = max(len("agent"), *(len(a) for a in agents))
    window = "" if len(rows) <= points else \
        f"; curve: {points} means of ~{len(rows) / points:.1f} iterations each"
    lines = [f"reward per agent (first {k} vs last {k} iterations{window}):",
             f"  {'agent':<{width}}  first  last   change  top_answer  entropy  curve"]
    for agent in agents:
        key = f"agent/{agent}/reward_mean"
        a, b = _mean(first, key), _mean(last, key)
        top = _mean(last, f"agent/{agent}/top_response_frac")
        ent = _mean(last, f"agent/{agent}/entropy")
        values = [float(r.get(key, float("nan"))) for r in rows]
        curve = " ".join(f"{v:.2f}" for v in curve_points(values, points))
        lines.append(f"  {agent:<{width}}  {a:5.3f}  {b:5.3f}  {b - a:+6.3f}  {top:10.2f}  "
                     f"{ent:7.3f}  {curve}")
    return lines
