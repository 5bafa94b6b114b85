"""Chaos run: one config trained fault-free and then with K random SIGKILLs of real worker
processes (rollout replicas and training workers), same seed, in one invocation.

Prints faults injected, recoveries, median and max recovery time (kill -> replacement serving,
with every agent's weights or trainer state restored), rows lost and rows trained on twice
(counted by sample_id from the audit trail), and final success rate against the fault-free run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import RunResult, train


def row_accounting(result: RunResult, cfg: Any) -> tuple[int, int]:
    """(rows lost, rows trained on twice): every node of every episode of every iteration
    should be trained on exactly once."""
    lost = dup = 0
    per_iteration = cfg.train.inputs_per_iteration * cfg.train.group_size
    for trail in result.audit.values():
        ids = [sid for sid, _, _ in trail]
        unique = set(ids)
        dup += len(ids) - len(unique)
        lost += per_iteration * cfg.train.iterations - len(unique)  # one node per agent
    return lost, dup


def _final_success(result: RunResult, last: int = 5) -> float:
    tail = result.records[-last:]
    return sum(r["task/success_rate"] for r in tail) / max(len(tail), 1)


class Killer(threading.Thread):
    """SIGKILLs a random live worker process at each of the given times (seconds from start)."""

    def __init__(self, runtime: Any, times: list[float], seed: int) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.runtime, self.times, self.rng = runtime, times, random.Random(seed)
        self.done = threading.Event()
        self.kills: list[dict[str, Any]] = []

    def run(self) -> None:
        t0 = time.time()
        for at in self.times:
            if self.done.wait(max(0.0, t0 + at - time.time())):
                return
            while True:  # every worker may be restarting: wait for one to kill
                live = [w for w in self.runtime.rollout_workers + self.runtime.train_workers
                        if w.alive and w.process.is_alive()]
                if live:
                    break
                if self.done.wait(0.2):
                    return
            w = self.rng.choice(live)
            self.kills.append({"pool": w.pool, "worker": w.index, "pid": w.process.pid,
                               "time": time.time()})
            os.kill(w.process.pid, signal.SIGKILL)


def bench_chaos(
    config: str, overrides: list[str] | None = None, kills: int = 4, seed: int = 0,
    out: str | None = None,
) -> dict[str, Any]:
    overrides = list(overrides or [])
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="flexmarl-chaos-"))
    cfg = load_config(config, overrides)
    print(f"chaos: {config} {' '.join(overrides)}; {cfg.train.iterations} iterations, "
          f"{cfg.runtime.rollout_workers} rollout + {cfg.runtime.train_workers} train workers, "
          f"{kills} random SIGKILLs -> {base}", flush=True)
    clean = train(cfg, base / "fault_free")
    span = float(clean.records[-1]["time_s"])
    # Kills spread over the fault-free run's training time, jittered, after a short warm-up.
    rng = random.Random(seed)
    times = sorted(span * (i + 0.5 + rng.uniform(-0.3, 0.3)) / kills for i in range(kills))
    holder: dict[str, Killer] = {}

    def on_runtime(runtime: Any) -> None:
        holder["killer"] = Killer(runtime, times, seed)
        holder["killer"].start()

    chaos = train(cfg, base / "chaos", on_runtime=on_runtime)
    killer = holder["killer"]
    killer.done.set()
    recoveries = (chaos.faults or {}).get("recoveries", [])
    failures = (chaos.faults or {}).get("failures", [])
    # kill -> recovered, matched per (pool, worker) in order
    rec_times: list[float] = []
    pending: dict[tuple[str, int], list[float]] = {}
    for k in killer.kills:
        pending.setdefault((k["pool"], k["worker"]), []).append(k["time"])
    for e in chaos_telemetry(base / "chaos"):
        if e.get("event") == "worker_recovered":
            queue = pending.get((e["pool"], e["worker"]))
            if queue:
                rec_times.append(e["time"] - queue.pop(0))
    lost_c, dup_c = row_accounting(chaos, cfg)
    lost_f, dup_f = row_accounting(clean, cfg)
    report = {
        "faults_injected": len(killer.kills),
        "failures_detected": len(failures),
        "recoveries": len(recoveries),
        "recovery_median_s": statistics.median(rec_times) if rec_times else float("nan"),
        "recovery_max_s": max(rec_times) if rec_times else float("nan"),
        "rows_lost": lost_c, "rows_duplicated": dup_c,
        "fault_free_rows_lost": lost_f, "fault_free_rows_duplicated": dup_f,
        "episodes_failed": sum(r["episodes/failed"] for r in chaos.records),
        "success_fault_free": _final_success(clean), "success_chaos": _final_success(chaos),
        "wall_fault_free_s": clean.wall_s, "wall_chaos_s": chaos.wall_s,
        "kills": [f"{k['pool']}#{k['worker']}" for k in killer.kills],
    }
    print_report(report)
    if not killer.kills:  # a clean table without a fault would claim a survival never tested
        raise ChaosError(f"chaos: no fault was injected ({kills} kills asked for, none made: "
                         "no live worker was found at the kill times); the run proves nothing")
    return report


class ChaosError(RuntimeError):
    """A chaos run that injected no fault."""


def chaos_telemetry(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def print_report(r: dict[str, Any]) -> None:
    rows = [
        ("faults injected (SIGKILL)", f"{r['faults_injected']}  ({', '.join(r['kills'])})"),
        ("failures detected", r["failures_detected"]),
        ("recoveries", r["recoveries"]),
        ("recovery time median / max", f"{r['recovery_median_s']:.2f} s / "
                                       f"{r['recovery_max_s']:.2f} s  (target < 30 s)"),
        ("rows lost", f"{r['rows_lost']}  (fault-free run: {r['fault_free_rows_lost']})"),
        ("rows trained on twice", f"{r['rows_duplicated']}  "
                                  f"(fault-free run: {r['fault_free_rows_duplicated']})"),
        ("episodes failed", r["episodes_failed"]),
        ("final success (last 5 it.)", f"chaos {r['success_chaos']:.3f} vs fault-free "
                                       f"{r['success_fault_free']:.3f}"),
        ("wall time", f"chaos {r['wall_chaos_s']:.1f} s vs fault-free "
                      f"{r['wall_fault_free_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
