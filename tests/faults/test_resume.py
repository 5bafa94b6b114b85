"""A real `flexmarl train` process killed (SIGKILL, SIGTERM) and resumed with `--resume` ends
with final checkpoints equal to an uninterrupted run's, every row trained on exactly once."""

import random
import signal

import pytest

from tests.faults.conftest import (
    ITERATIONS,
    assert_final_equal,
    assert_rows_exactly_once,
    audit_from_disk,
    cli,
    cli_args,
    config,
    events,
    kill_group,
    wait_for,
)


def _resume(out):
    proc = cli(*cli_args(out, "--resume", str(out)))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    return proc


def _generation(out) -> int:
    try:
        return int((out / "checkpoints" / "LATEST").read_text().strip().split("-")[1])
    except (OSError, ValueError, IndexError):
        return 0


@pytest.mark.slow  # two CLI runs: ~75 s on the shared 2-core machine
def test_sigkill_at_a_random_point_then_resume_equals_uninterrupted(tmp_path, reference):
    out = tmp_path / "run"
    proc = cli(*cli_args(out))
    wait_for(lambda: _generation(out) >= 1, 240, proc)  # at least one checkpoint
    target = random.Random().randint(1, ITERATIONS - 1)
    wait_for(lambda: _generation(out) >= target, 240, proc)
    kill_group(proc)  # the run and all its workers, wherever they were
    killed_at = _generation(out)
    assert killed_at < ITERATIONS or not (out / "summary.json").exists()
    _resume(out)
    resumed = events(out, "resumed")
    assert resumed and resumed[0]["completed"] == killed_at
    assert_final_equal(out, reference)
    assert_rows_exactly_once(*audit_from_disk(out), config())


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_generation(tmp_path, reference):
    out = tmp_path / "run"
    proc = cli(*cli_args(out), env={"FLEXMARL_CHAOS_SLOW_CHECKPOINT_S": "0.5"})
    wait_for(lambda: _generation(out) >= 1, 240, proc)
    wait_for(lambda: any((out / "checkpoints").glob(".tmp-gen-*")), 120, proc)
    kill_group(proc)  # mid-write: a half-written .tmp generation is left behind
    published = _generation(out)
    assert any((out / "checkpoints").glob(".tmp-gen-*"))
    _resume(out)
    assert events(out, "resumed")[0]["completed"] == published
    assert not any((out / "checkpoints").glob(".tmp-gen-*"))
    assert_final_equal(out, reference)
    assert_rows_exactly_once(*audit_from_disk(out), config())


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_boundary_and_stops(tmp_path, reference):
    out = tmp_path / "run"
    proc = cli(*cli_args(out, "--set", "train.checkpoint_every=100"))
    wait_for(lambda: (out / "metrics.jsonl").exists()
             and '"iteration": 0' in (out / "metrics.jsonl").read_text(), 240, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "interrupted" in stderr and "resume from" in stderr
    stopped = _generation(out)
    assert 1 <= stopped < ITERATIONS
    _resume(out)
    assert_final_equal(out, reference)


@pytest.mark.slow
def test_a_second_sigterm_during_a_checkpoint_write_stops_at_once(tmp_path):
    """The first SIGTERM checkpoints at the next boundary; a second one while that generation
    is being written (slowed to 2 s a file, so it takes over 20 s) ends the process without
    finishing it: exit 143, and nothing published."""
    import time

    out = tmp_path / "run"
    proc = cli(*cli_args(out, "--set", "train.checkpoint_every=100"),
               env={"FLEXMARL_CHAOS_SLOW_CHECKPOINT_S": "2"})
    wait_for(lambda: (out / "metrics.jsonl").exists()
             and '"iteration": 0' in (out / "metrics.jsonl").read_text(), 240, proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: any((out / "checkpoints").glob(".tmp-gen-*")), 120, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "a second stop abandoned the checkpoint being written" in stderr
    assert not (out / "checkpoints" / "LATEST").exists()  # never published
    print(f"second SIGTERM to exit: {time.monotonic() - sent:.1f} s")


@pytest.mark.slow
def test_full_disk_during_a_run_stops_it_loudly_and_keeps_the_old_generation(tmp_path,
                                                                             monkeypatch):
    import errno

    from flexmarl.orchestrator import checkpoint as ck
    from flexmarl.orchestrator.checkpoint import CheckpointError
    from flexmarl.orchestrator.run import train

    real = ck._write_bytes

    def full_disk(path, data):  # the disk is full when generation 2 is written
        if path.name == "store.msgpack" and "gen-000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ck, "_write_bytes", full_disk)
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="gen-000001 is intact"):
        train(config(), out)
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "gen-000001"
    assert ck.CheckpointManager(out / "checkpoints").load().completed == 1
    assert events(out, "checkpoint_failed")
