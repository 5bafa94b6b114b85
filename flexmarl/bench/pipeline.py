"""Sync vs async pipeline on one config, rounds alternating, in one invocation.

Prints the median wall time per iteration of each mode, their ratio, and each pool's busy
fraction. The first iteration of every run is warm-up and is left out of the medians.

Next to the ratio it prints the ideal one, max(R, T) / (R + T), from the sync run's measured
rollout busy time R and training busy time T per iteration (seconds of a worker of each pool):
what a perfect overlap of rollout and training would reach, if neither slowed the other. Also
the training-state swaps per iteration of each mode (agents time-sharing training slots).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train


def run_mode(config: str, overrides: list[str], mode: str, out: Path) -> list[dict[str, Any]]:
    cfg = load_config(config, [*overrides, f"pipeline.mode={mode}"])
    return train(cfg, out).records


def bench_pipeline(
    config: str, overrides: list[str] | None = None, rounds: int = 3, out: str | None = None
) -> dict[str, Any]:
    overrides = list(overrides or [])
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="flexmarl-bench-"))
    per_mode: dict[str, dict[str, list[float]]] = {
        m: {"wall": [], "rollout": [], "train": [], "success": [], "rollout_s": [],
            "train_s": [], "swaps": []} for m in ("sync", "async")
    }
    for r in range(rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for mode in order:
            records = run_mode(config, overrides, mode, base / f"{mode}-{r}")
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
    summary = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in per_mode.items()}
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
    return {"summary": summary, "ratio": ratio, "ideal": ideal}
