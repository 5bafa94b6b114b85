"""trace.json written by `Telemetry.write_trace` reads back as the same spans and events."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.telemetry.recorder import Span, Telemetry, read_trace


def test_a_written_trace_reads_back_as_its_spans_and_events(tmp_path: Path) -> None:
    clock = iter([100.0, 101.25]).__next__
    tel = Telemetry(clock=clock)  # t0 = 100.0
    tel.span("rollout", 0, 100.5, 101.0, "generate:listener")
    tel.span("train", 1, 100.75, 102.0, "step:speaker")
    tel.event("rollout_plan", iteration=3)  # at 101.25
    trace = read_trace(tel.write_trace(tmp_path / "trace.json"))
    assert trace is not None
    spans, events = trace
    assert spans == [Span("rollout", 0, pytest.approx(0.5), pytest.approx(1.0),
                          "generate:listener"),
                     Span("train", 1, pytest.approx(0.75), pytest.approx(2.0), "step:speaker")]
    assert events == [{"name": "rollout_plan", "time": pytest.approx(1.25), "iteration": 3}]


def test_a_missing_or_foreign_file_is_no_trace(tmp_path: Path) -> None:
    assert read_trace(tmp_path / "absent.json") is None
    (tmp_path / "other.json").write_text('{"events": []}')
    assert read_trace(tmp_path / "other.json") is None
