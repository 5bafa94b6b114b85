"""Rollout benchmark: static vs hierarchical balancing on one skewed config, in one invocation;
and batched vs one-at-a-time generation on the tiny model.

Iteration 0 of each run is cold (nothing measured yet, so both start from the equal split);
the steady-state figures are the medians over the later iterations.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flexmarl.config.schema import ModelConfig, load_config
from flexmarl.orchestrator.run import train
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import generate
from flexmarl.types import GenerationRequest


def run_balance(config: str, overrides: list[str], balance: str, out: Path) -> list[dict]:
    cfg = load_config(config, [*overrides, f"rollout.balance={balance}"])
    return train(cfg, out).records


def _queue_waits(record: dict[str, Any]) -> tuple[float, float]:
    p50 = [v for k, v in record.items() if k.endswith("/queue_wait_p50_s")]
    p95 = [v for k, v in record.items() if k.endswith("/queue_wait_p95_s")]
    return max(p50, default=0.0), max(p95, default=0.0)


def batching_speedup(n: int = 32, new_tokens: int = 48, prompt: int = 8) -> dict[str, float]:
    """Tokens/s of one 32-request continuous batch vs the same requests one at a time."""
    import torch  # start-up cost: torch only where it runs


    torch.set_num_threads(1)
    model = build_model("bench", ModelConfig(), vocab_size=64, max_seq_len=prompt + new_tokens + 8,
                        run_seed=0)
    reqs = [GenerationRequest(f"b-{i}_0_0", "bench", 0, [1] + [4 + (i + j) % 60
                              for j in range(prompt - 1)], new_tokens) for i in range(n)]
    generate(model, reqs[:2])  # warm-up
    t0 = time.perf_counter()
    for r in reqs:
        generate(model, [r])
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(model, reqs)
    batched = time.perf_counter() - t0
    tokens = n * new_tokens
    return {"alone_tok_s": tokens / alone, "batched_tok_s": tokens / batched,
            "speedup": alone / batched}


def bench_rollout(config: str, overrides: list[str] | None = None,
                  out: str | None = None) -> dict[str, Any]:
    overrides = list(overrides or [])
    base = Path(out) if out else Path(tempfile.mkdtemp(prefix="flexmarl-rollout-"))
    runs = {}
    for balance in ("static", "hierarchical"):
        runs[balance] = run_balance(config, overrides, balance, base / balance)
        print(f"  {balance}: done", flush=True)
    print()
    print(f"rollout benchmark: {config}")
    print(f"{'balance':<13} {'iter':>4} {'makespan s':>11} {'imbalance':>10} "
          f"{'queue p50 s':>12} {'queue p95 s':>12}  plan")
    for balance, records in runs.items():
        plan: dict = {}  # iteration k runs on the plan made when k-1's rollout ended
        for r in records:
            p50, p95 = _queue_waits(r)
            print(f"{balance:<13} {r['iteration']:>4} {r['rollout/makespan_s']:>11.3f} "
                  f"{r['rollout/imbalance']:>10.2f} {p50:>12.3f} {p95:>12.3f}  "
                  f"{plan or 'equal split'}")
            plan = r.get("rollout/plan", {}).get("replicas", {})
    summary = {}
    for balance, records in runs.items():
        steady = records[1:] or records
        summary[balance] = {
            "makespan_s": statistics.median(r["rollout/makespan_s"] for r in steady),
            "imbalance": statistics.median(r["rollout/imbalance"] for r in steady),
            "queue_p95_s": statistics.median(_queue_waits(r)[1] for r in steady),
        }
    ratio = summary["hierarchical"]["makespan_s"] / summary["static"]["makespan_s"]
    print()
    print("steady state (median over iterations >= 1):")
    for balance, s in summary.items():
        print(f"  {balance:<13} makespan {s['makespan_s']:.3f} s  imbalance "
              f"{s['imbalance']:.2f}  queue wait p95 {s['queue_p95_s']:.3f} s")
    print(f"  makespan ratio hierarchical/static: {ratio:.3f}  (target <= 0.7)")
    print(f"  imbalance with hierarchical balancing: {summary['hierarchical']['imbalance']:.2f}"
          "  (target <= 1.15)")
    speed = batching_speedup()
    print(f"batched vs one-at-a-time, 32 requests x 48 tokens on the tiny model: "
          f"{speed['batched_tok_s']:.0f} vs {speed['alone_tok_s']:.0f} tokens/s = "
          f"{speed['speedup']:.1f}x  (target >= 5x)")
    return {"summary": summary, "ratio": ratio, "batching": speed, "runs": runs}
