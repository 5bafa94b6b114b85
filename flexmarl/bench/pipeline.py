"""Sync vs async pipeline on one config, rounds alternating, in one invocation.

Prints the median wall time per iteration of each mode, their ratio, and each pool's busy
fraction. The first iteration of every run is warm-up and is left out of the medians.

Next to the ratio it prints the ideal one, max(R, T) / (R + T), from the sync run's measured
rollout busy time R and training busy time T per iteration (seconds of a worker of each pool):
what a perfect overlap of rollout and training would reach, if neither slowed the other. Also
the training-state swaps per iteration of each mode (agents time-sharing training slots).

Then where each mode's time goes (`idle_breakdown`, from each run's OUT/trace.json): the share
of the wall time the rollout replica sat idle, and of it the share it waited for a new version
(an idle gap that a weight load ends: the on-policy gate, iteration k+1's nodes of agent a wait
for a's step on k), and the share the training slot sat idle. The ideal above
assumes rollout and training independent; the gate is why an on-policy pipeline falls short of
it when the rows that finish last (a long tail) belong to the agents whose steps the next
iteration needs first.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from flexmarl.telemetry.recorder import read_trace


def run_mode(config: str, overrides: list[str], mode: str, out: Path) -> list[dict[str, Any]]:
    cfg = load_config(config, [*overrides, f"pipeline.mode={mode}"])
    return train(cfg, out).records


def idle_breakdown(out: Path) -> dict[str, float]:
    """Shares of a finished run's wall time (OUT/trace.json, from its first iteration's
    rollout done to its last span): `rollout_idle`, of it `version_wait` (idle gaps a weight
    load ends), and `train_idle`; each pool's worker 0. Empty without a trace."""
    trace = read_trace(out / "trace.json")
    if trace is None:
        return {}
    spans = sorted((s.start, s.end, s.pool, s.label) for s in trace[0] if s.worker == 0)
    plans = [e["time"] for e in trace[1] if e["name"] == "rollout_plan"]
    if not plans or not spans:
        return {}
    lo, hi = min(plans), max(end for _, end, _, _ in spans)
    if hi <= lo:
        return {}
    figures = {"rollout_idle": 0.0, "version_wait": 0.0, "train_idle": 0.0}
    for pool, key in (("rollout", "rollout_idle"), ("train", "train_idle")):
        cur = lo
        for start, end, _, name in (s for s in spans if s[2] == pool and s[1] > lo):
            if start > cur:
                figures[key] += start - cur
                if pool == "rollout" and name.startswith("load:"):
                    figures["version_wait"] += start - cur
            cur = max(cur, end)
        figures[key] += max(0.0, hi - cur)
    return {k: v / (hi - lo) for k, v in figures.items()}


def bench_pipeline(
    config: str, overrides: list[str] | None = None, rounds: int = 3, out: str | None = None
) -> dict[str, Any]:
    overrides = list(overrides or [])
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="flexmarl-bench-"))
    per_mode: dict[str, dict[str, list[float]]] = {
        m: {"wall": [], "rollout": [], "train": [], "success": [], "rollout_s": [],
            "train_s": [], "swaps": [], "rollout_idle": [], "version_wait": [],
            "train_idle": []} for m in ("sync", "async")
    }
    for r in range(rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for mode in order:
            records = run_mode(config, overrides, mode, base / f"{mode}-{r}")
            for key, value in idle_breakdown(base / f"{mode}-{r}").items():
                per_mode[mode][key].append(value)
            steady = records[1:] or records
            per_mode[mode]["wall"] += [x["wall_s"] for x in steady]
            per_mode[mode]["rollout"] += [x["pool/rollout/busy_frac"] for x in steady]
            per_mode[mode]["train"] += [x["pool/train/busy_frac"] for x in steady]
            per_mode[mode]["success"].append(records[-1]["task/success_rate"])
            per_mode[mode]["rollout_s"] += [x["pool/rollout/busy_frac"] * x["wall_s"]
                                            for x in steady]
            per_mode[mode]["train_s"] += [x["pool/train/busy_frac"] * x["wall_s"] for x in steady]
            per_mode[mode]["swaps"] += [x.get("pool/train/swaps", 0) for x in steady]
            print(f"  round {r + 1}/{rounds} {mode:5s}: median "
                  f"{statistics.median(x['wall_s'] for x in steady):.3f} s/iteration", flush=True)
    summary = {m: {k: statistics.median(v) if v else 0.0 for k, v in d.items()}
               for m, d in per_mode.items()}
    ratio = summary["async"]["wall"] / summary["sync"]["wall"]
    roll_s, train_s = summary["sync"]["rollout_s"], summary["sync"]["train_s"]
    ideal = max(roll_s, train_s) / (roll_s + train_s) if roll_s + train_s > 0 else 1.0
    print()
    print(f"pipeline benchmark: {config}  ({rounds} rounds, modes alternating)")
    print(f"{'mode':<6} {'s/iteration':>12} {'rollout busy':>13} {'train busy':>11} "
          f"{'swaps/it':>9} {'final success':>14}")
    for m in ("sync", "async"):
        s = summary[m]
        print(f"{m:<6} {s['wall']:>12.3f} {s['rollout']:>13.2f} {s['train']:>11.2f} "
              f"{s['swaps']:>9.1f} {s['success']:>14.3f}")
    print(f"async/sync wall-time ratio: {ratio:.3f}   ideal max(R, T) / (R + T): {ideal:.3f} "
          f"(sync R = {roll_s:.3f} s, T = {train_s:.3f} s per iteration)")
    print("idle share of the wall time (trace, after the first rollout): "
          + "; ".join(f"{m} rollout {summary[m]['rollout_idle']:.2f} (waiting for a version "
                      f"{summary[m]['version_wait']:.2f}), training {summary[m]['train_idle']:.2f}"
                      for m in ("sync", "async")))
    return {"summary": summary, "ratio": ratio, "ideal": ideal}
