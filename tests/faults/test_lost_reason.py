"""A call to a worker whose death was already noticed names why it died (the out-of-memory
hint with its agents), as a call in flight at its death does: which of the two a run meets
depends on timing (it made `tests/cli/test_bad_inputs.py`'s SIGKILL test flaky under load)."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl.api.runtime import NullSink, WorkerLost
from flexmarl.runtime.local.runtime import WorkerProxy


def test_a_call_to_a_dead_worker_names_the_reason_it_died() -> None:
    proxy = WorkerProxy("train", 0, print, None, NullSink())  # never started: no process
    proxy.lost_reason = "killed by SIGKILL (exit code -9), most likely by the kernel's " \
        "out-of-memory killer; it trains agents speaker"

    async def call() -> None:
        await proxy.call("step", "speaker")

    with pytest.raises(WorkerLost, match="not running: killed by SIGKILL .* trains agents"):
        asyncio.run(call())
