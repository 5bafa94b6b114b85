"""`bench pipeline`'s idle breakdown, read from a run's trace and metrics files."""

import json
from pathlib import Path

import pytest

from flexmarl.bench.pipeline import idle_breakdown


def write_run(out: Path, spans: list[tuple[str, float, float, str]], plans: list[float],
              iterations: int) -> None:
    pid = {"rollout": 1, "train": 2}
    events = [{"ph": "M", "name": "process_name", "pid": i, "args": {"name": p}}
              for p, i in pid.items()]
    events += [{"ph": "X", "name": name, "pid": pid[pool], "tid": 0, "ts": start * 1e6,
                "dur": (end - start) * 1e6} for pool, start, end, name in spans]
    events += [{"ph": "i", "name": "rollout_plan", "pid": 0, "tid": 0, "ts": t * 1e6}
               for t in plans]
    (out / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"iteration": k}) + "\n"
                                               for k in range(iterations)))


def test_idle_gaps_split_into_version_waits_and_training_idle(tmp_path: Path) -> None:
    # after the first rollout (plan at t=1): the replica idles 1.0-1.5 until a weight load,
    # then 2.0-2.2 before a generation; the slot idles 1.0-1.2 and 2.5-3.0 (the end)
    write_run(tmp_path, [
        ("rollout", 0.0, 1.0, "gen:a"), ("rollout", 1.5, 1.6, "load:a"),
        ("rollout", 1.6, 2.0, "gen:a"), ("rollout", 2.2, 3.0, "gen:a"),
        ("train", 0.5, 0.9, "acc:a:4"), ("train", 1.2, 2.5, "acc:a:4"),
    ], plans=[1.0, 2.0], iterations=3)
    got = idle_breakdown(tmp_path)
    # shares of the 2 s from the first plan to the last span
    assert got["rollout_idle"] == pytest.approx(0.7 / 2, abs=1e-9)
    assert got["version_wait"] == pytest.approx(0.5 / 2, abs=1e-9)
    assert got["train_idle"] == pytest.approx(0.7 / 2, abs=1e-9)


def test_no_trace_no_breakdown(tmp_path: Path) -> None:
    assert idle_breakdown(tmp_path) == {}

