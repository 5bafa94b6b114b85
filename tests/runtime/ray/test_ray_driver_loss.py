"""The driver lost (SIGKILL of `flexmarl train` alone; its actors on the cluster keep running
until Ray reaps them): Ray frees everything the dead driver held, its worker actors and
placement groups (none is detached, all are owned by the driver's job), and the same command
with `--resume` against the same cluster continues from the last checkpoint, ending equal to
the uninterrupted local run with every row trained on exactly once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from tests.faults.conftest import (
    ITERATIONS,
    assert_final_equal,
    assert_rows_exactly_once,
    audit_from_disk,
    cli,
    cli_args,
    config,
    events,
    reference,  # noqa: F401 - the session fixture: the local fault-free run
    wait_for,
)

RAY = ["runtime.kind=ray", "runtime.ray.rollout_bundle.cpus=0.5"]


def _generation(out) -> int:
    try:
        return int((out / "checkpoints" / "LATEST").read_text().strip().split("-")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _held(address: str) -> dict[str, float]:
    """CPU the cluster has but does not offer: held by actors or placement groups."""
    ray.init(address=address, log_to_driver=False)
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
        return {"CPU": total.get("CPU", 0.0) - free.get("CPU", 0.0)}
    finally:
        ray.shutdown()


@pytest.mark.slow  # two CLI runs on a Ray head, a driver SIGKILLed between: ~1.5 min here
def test_a_killed_driver_is_cleaned_up_and_resumes_exactly(tmp_path, ray_head,
                                                            reference):  # noqa: F811
    out = tmp_path / "run"
    sets = [a for s in [*RAY, f"runtime.address={ray_head}"] for a in ("--set", s)]
    proc = cli(*cli_args(out, *sets))
    wait_for(lambda: _generation(out) >= 1, 240, proc)  # at least one checkpoint
    os.kill(proc.pid, signal.SIGKILL)  # the driver alone: its actors live on the cluster
    proc.wait(timeout=60)
    killed_at = _generation(out)
    assert killed_at < ITERATIONS
    deadline = time.time() + 60
    while (held := _held(ray_head))["CPU"] > 0:  # Ray reaps the dead job's actors and groups
        assert time.time() < deadline, f"the killed driver's run still holds {held}"
        time.sleep(1)
    resumed = cli(*cli_args(out, *sets, "--resume", str(out)))
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert events(out, "resumed")[0]["completed"] == killed_at
    assert_final_equal(out, reference)
    assert_rows_exactly_once(*audit_from_disk(out), config(*RAY))
