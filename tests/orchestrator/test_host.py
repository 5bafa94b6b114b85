"""`host_run` owns SIGTERM / Ctrl-C for every driver: before the driver routes them (workers
still starting) a stop ends the run at once; after, each goes to the driver's request_stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.checkpointing import RunInterrupted
from flexmarl.orchestrator.run import StopRequests, host_run

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Done:
    records: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] | None = None

    def summary(self, wall_s: float) -> dict[str, Any]:
        return {"mine": 1}


def test_a_stop_before_the_driver_routes_it_ends_the_run_at_once(tmp_path) -> None:
    cfg = load_config(ROOT / "examples" / "referential_game.yaml")

    async def starting(telemetry, stops: StopRequests) -> Done:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)  # workers starting: never reached
        return Done()

    with pytest.raises(RunInterrupted, match="before the first iteration"):
        host_run(cfg, tmp_path / "run", None, starting)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_type"] == "RunInterrupted"


def test_signals_go_to_the_driver_once_routed_and_the_summary_is_one(tmp_path) -> None:
    cfg = load_config(ROOT / "examples" / "referential_game.yaml")
    requests: list[int] = []

    async def driver(telemetry, stops: StopRequests) -> Done:
        stops.route(lambda: requests.append(1))
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)
        return Done([{"iteration": 0}])

    host_run(cfg, tmp_path / "run", None, driver)
    assert requests == [1, 1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == 1
    assert summary["mine"] == 1 and summary["faults"] is None
    # the handlers are gone with the run: Python's own are back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
