"""Learning check of a hybrid graph (issue 28 item 2): every trained agent's reward rises.

    .venv/bin/python benchmarks/hybrid_learning.py [--config examples/hybrid_pursuit.yaml]
        [--seeds 0 1] [--set KEY=VALUE ...]

Trains the hybrid example (an LLM coordinator and MAPPO pursuers in one graph) once per seed,
through the ordinary driver (`orchestrator/run.py`), and prints, per seed and trained agent,
the mean `agent/<name>/reward_mean` over the first and the last fifth of the iterations, and
whether it rose; then the wall time of each run and the machine's load average (the figures
are learning, not speed: the load only says how long it took).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexmarl.config.schema import load_config  # noqa: E402
from flexmarl.orchestrator.run import train  # noqa: E402


def fifths(records: list[dict], agent: str) -> tuple[float, float]:
    """Mean reward_mean of `agent` over the first and the last fifth of the iterations."""
    values = [r[f"agent/{agent}/reward_mean"] for r in records
              if f"agent/{agent}/reward_mean" in r]
    n = max(1, len(values) // 5)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "examples" / "hybrid_pursuit.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    rows, walls, ok = [], [], True
    for seed in args.seeds:
        cfg = load_config(args.config, [*args.overrides, f"seed={seed}"])
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hybrid-") as out:
            result = train(cfg, Path(out) / "run")
        walls.append((seed, time.perf_counter() - start, len(result.records)))
        for agent, acfg in cfg.agents.items():
            if not acfg.trainable:
                continue
            first, last = fifths(result.records, agent)
            ok = ok and last > first
            rows.append((seed, agent, first, last))
    print(f"{'seed':>4}  {'agent':<12} {'first fifth':>12} {'last fifth':>11} {'change':>8}  rose")
    for seed, agent, first, last in rows:
        print(f"{seed:>4}  {agent:<12} {first:>12.3f} {last:>11.3f} {last - first:>+8.3f}  "
              f"{'yes' if last > first else 'NO'}")
    for seed, wall, n in walls:
        print(f"seed {seed}: {n} iterations in {wall:.0f} s")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
