"""Stop requests at an iteration boundary (`orchestrator/checkpointing.py`), on fakes: the
first checkpoints and stops, a second stops at once. The real-process case (two SIGTERMs to
`flexmarl train` while a slowed generation is written) is `tests/faults/test_resume.py`'s."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.checkpointing import BoundaryCheckpoints, RunInterrupted
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.testing.fakes import FakeTrainPool

ROOT = Path(__file__).resolve().parents[2]


def _stopping(second: bool) -> tuple[str, threading.Event, list[int]]:
    """Run a boundary that gets one stop request, or a second one while its checkpoint is
    still being written (the writer blocks until released); what `RunInterrupted` says, the
    writer's release and the generations written."""
    cfg = load_config(str(ROOT / "examples" / "relay_chain.yaml"))
    release, written = threading.Event(), []

    def save(completed: int, *_: object) -> str:
        release.wait(30)  # a slow write (a large model's generation)
        written.append(completed)
        return f"gen-{completed:06d}"

    async def scenario() -> str:
        train = FakeTrainPool(["speaker"])
        ck = BoundaryCheckpoints(cfg, Telemetry(None), train, save,
                                 lambda done: ({"completed": done}, [], {}))

        async def drive() -> None:
            await train.step("speaker")  # iteration 0 trained: version 1
            ck.request_stop()  # the first request: a checkpoint at this boundary
            assert ck.due(0)
            ck.capture(0, ["speaker"])
            if second:
                while not ck.step_allowed.is_set():  # the trainer states are being read
                    await asyncio.sleep(0.01)
                ck.request_stop()  # the second, while the generation is being written
            else:
                release.set()
            await asyncio.Event().wait()  # the schedule would go on

        with pytest.raises(RunInterrupted) as stopped:
            await asyncio.wait_for(ck.run_until_stop(drive(), lambda: 1), timeout=20)
        return str(stopped.value)

    message = asyncio.run(scenario())
    return message, release, written


def test_the_first_stop_checkpoints_at_the_boundary_then_stops():
    message, _, written = _stopping(second=False)
    assert written == [1] and "resume from gen-000001" in message


def test_a_second_stop_abandons_the_checkpoint_being_written():
    """Nothing waits for the write in flight (a large model's takes tens of seconds); the
    generation was never published, so the run resumes from the one before."""
    message, release, written = _stopping(second=True)
    try:
        assert written == [] and "abandoned the checkpoint being written" in message
        assert "resume from" not in message
    finally:
        release.set()  # the daemon writer ends (its result goes nowhere)


def test_a_runtime_that_replaces_the_sigterm_handler_does_not_keep_it():
    """`ray.init` installs its own SIGTERM handler in the driver (it exits at once, no
    checkpoint). Once the runtime runs, the driver routes its stop requests and takes SIGTERM
    back (`StopRequests.route`): the signal reaches the driver's handler."""
    import os
    import signal

    from flexmarl.orchestrator.run import _hosted

    got: list[str] = []

    async def body(telemetry: Telemetry, stops) -> str:
        signal.signal(signal.SIGTERM, lambda *_: got.append("runtime's"))  # as ray.init does
        stops.route(lambda: got.append("driver's"))
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        return "done"

    assert asyncio.run(_hosted(body, Telemetry(None))) == "done"
    assert got == ["driver's"]
