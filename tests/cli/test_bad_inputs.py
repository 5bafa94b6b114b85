"""Every user error is one clear message with exit code 2 and no traceback; the failure budget
ends a run with exit code 1 and its first error; internal errors keep their traceback.

Each case of `bad_inputs.CASES` runs through the CLI's `main()` in this process (fast: torch is
imported once); one case per group, and the cases that start workers, run as real subprocesses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.cli.main import main
from tests.cli.bad_inputs import CASES, ROOT, Case, run_case


def _ids(cases: list[Case]) -> list[str]:
    return [f"{c.group}: {c.name}" for c in cases]


FAST = [c for c in CASES if not c.slow]
# one case per group as a real subprocess; the groups whose errors come after torch loads
# (folders, task builder, model) share that path with "user functions" and run in-process only,
# which keeps the suite's time down
SUBPROCESS_GROUPS = {"config file", "config fields", "serving", "user functions"}
FIRST_OF_GROUP = [c for i, c in enumerate(FAST) if c.group in SUBPROCESS_GROUPS
                  and c.group not in {d.group for d in FAST[:i]}]
SLOW = [c for c in CASES if c.slow]


@pytest.mark.parametrize("case", FAST, ids=_ids(FAST))
def test_bad_input_in_process(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("FLEXMARL_DEBUG", raising=False)
    code = main(case.argv(tmp_path))
    err = capsys.readouterr().err
    assert code == case.code, err
    assert "Traceback" not in err
    assert case.expect in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, err


@pytest.mark.parametrize("case", FIRST_OF_GROUP + SLOW, ids=_ids(FIRST_OF_GROUP + SLOW))
def test_bad_input_real_subprocess(case, tmp_path):
    code, err = run_case(case, tmp_path)
    assert code == case.code, err
    assert "Traceback" not in err
    assert case.expect in err, err
    if case.group == "failure budget":  # the first error, no "final" checkpoint, a status
        assert "judge unreachable" in err
        run = tmp_path / "run"
        assert not (run / "checkpoints" / "final").exists()
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "failed" and "judge unreachable" in summary["first_error"]
        lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        assert any(ln.get("event") == "failure_budget_exceeded" for ln in lines)
        assert [ln["episodes/failed"] for ln in lines if "event" not in ln] == [4]


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("FLEXMARL_DEBUG", "")  # --debug sets it: undone after the test
    monkeypatch.delenv("FLEXMARL_DEBUG")
    case = next(c for c in CASES if c.name == "raises its own exception")
    assert main(["--debug", *case.argv(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "dataset shard 7 is missing" in err
    assert main([*case.argv(tmp_path), "--debug"]) == 2  # after the subcommand too
    assert "Traceback" in capsys.readouterr().err


def test_internal_error_keeps_its_traceback_and_says_it_is_a_bug(tmp_path, capsys, monkeypatch):
    import flexmarl.cli.main as cli

    def broken(*_a, **_k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "load_config", broken)
    assert main(["train", "whatever.yaml"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err
    assert "this is a bug in FlexMARL" in err


def test_budget_tolerates_failures_under_the_fraction():
    """Unit check of the rule: over the fraction only counts when consecutive."""
    from flexmarl.config.schema import load_config
    from flexmarl.orchestrator.joint import FailureBudgetExceeded, IterationState
    from flexmarl.orchestrator.metrics import FailureBudget

    cfg = load_config(ROOT / "examples" / "referential_game.yaml",
                      ["train.max_failed_fraction=0.25",
                       "train.max_consecutive_failed_iterations=1"])

    class _T:
        def fault(self, *a, **k):
            pass

    budget = FailureBudget(cfg, _T())

    def check(it):
        budget.check(it, "e0")
    check(IterationState(index=0, episodes_total=8, episodes_failed=2))  # 25%: within
    check(IterationState(index=1, episodes_total=8, episodes_failed=3))  # over: 1 tolerated
    check(IterationState(index=2, episodes_total=8, episodes_failed=0))  # resets
    check(IterationState(index=3, episodes_total=8, episodes_failed=8))
    with pytest.raises(FailureBudgetExceeded, match="first error: e0"):
        check(IterationState(index=4, episodes_total=8, episodes_failed=5))


def _children(pid: int) -> list[int]:
    """Child pids of `pid`; threads and children that end while being listed are skipped
    (under load the parent's helper threads come and go)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except OSError:
            continue
        out.extend(int(c) for c in text)
    return out


def _is_spawned_worker(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


# make test budget (13 s measured). Its parts stay in make test: a SIGKILL nobody sent reads as
# the out-of-memory killer naming the agents (tests/faults/test_worker_failure.py::
# test_rollout_worker_killed_mid_iteration; tests/faults/test_lost_reason.py for a later call),
# and the failure budget ends a real CLI run with exit 1, no traceback, no final checkpoint
# (test_bad_input_real_subprocess[failure budget: every episode fails (judge raises)])
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_worker_killed_by_sigkill_reads_as_out_of_memory(tmp_path):
    """A SIGKILL FlexMARL did not send (what the kernel's OOM killer sends) is reported as a
    likely out-of-memory kill, naming the agents the worker held and their estimates; without
    restarts the episodes fail and the failure budget ends the run: exit 1, no traceback."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmarl", "train",
         str(ROOT / "examples" / "referential_game.yaml"),
         "--set", "train.iterations=500", "--set", "train.inputs_per_iteration=4",
         "--set", "runtime.max_worker_restarts=0", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and '"iteration"' in metrics.read_text():
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        workers = [c for c in _children(proc.pid) if _is_spawned_worker(c)]
        assert workers
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "out-of-memory killer" in err and ("holds agents" in err or "trains agents" in err), err
    assert not (out / "checkpoints" / "final").exists()


def test_a_stop_in_any_command_reads_as_interrupted_not_as_a_bug(capsys, monkeypatch):
    """SIGTERM before a run's first iteration (`bench compare` under `timeout` did this on the
    GPU machine) ends the command with 143 and one line, not an internal error."""
    import flexmarl.cli.main as cli
    from flexmarl.orchestrator.checkpointing import RunInterrupted

    def stopped(*_a, **_k):
        raise RunInterrupted("stopped before the first iteration", None)

    monkeypatch.setattr(cli, "load_config", stopped)
    assert main(["train", "whatever.yaml"]) == 143
    err = capsys.readouterr().err
    assert "interrupted: stopped before the first iteration" in err
    assert "Traceback" not in err and "bug" not in err
