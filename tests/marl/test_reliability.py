"""Reliability of classic MARL runs: checkpoints and exact resume (in process, and a real
`flexmarl train` SIGKILLed and resumed with `--resume`), and the supervisor: a real rollout
worker or training slot process SIGKILLed mid-iteration is restarted, the iteration redone,
and the run ends bit-identical to an unkilled one, every row trained on exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

pytest.importorskip("mpe2")

from flexmarl.marl.learner import PolicyLearner  # noqa: E402
from flexmarl.marl.rollout import EnvRollout  # noqa: E402
from flexmarl.marl.run import MarlRun, train_marl  # noqa: E402
from flexmarl.orchestrator.checkpoint import CheckpointError  # noqa: E402
from flexmarl.orchestrator.metrics import FailureBudgetExceeded  # noqa: E402
from tests.marl.configs import marl_cfg, shaped  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 4
ENVS = 4
# what must be equal between an interrupted and an uninterrupted run (timings are not)
COMPARED = ("return_mean", "agent/speaker_0/return_mean", "agent/listener_0/return_mean",
            "agent/speaker_0/loss/policy", "agent/listener_0/loss/value",
            "agent/listener_0/entropy", "task/final_distance", "env_steps")


def raw(**over) -> dict:
    """speaker_listener, two policies time-sharing one training slot, a checkpoint every
    iteration."""
    out: dict = {"name": "sl_reliability", "seed": 3,
                 "env": {"id": "mpe2.simple_speaker_listener_v4",
                         "options": {"max_cycles": 25}, "num_envs": ENVS},
                 "share": False,
                 "algorithm": {"name": "mappo", "epochs": 2, "minibatches": 2},
                 "train": {"env_steps": ITERATIONS * ENVS * 25, "rollout_steps": 25,
                           "checkpoint_every": 1}}
    return shaped(out, **over)


def cfg(**over):
    return marl_cfg(raw(**over))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted, fault-free run."""
    out = tmp_path_factory.mktemp("reference")
    return train_marl(cfg(), out)


def final_weights(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return {p.name: load_file(str(p / "model.safetensors"))
            for p in sorted((out / "checkpoints" / "final").iterdir())}


def assert_same_run(out: Path, records: list[dict], audit: dict, reference) -> None:
    """Bit-identical final weights and per-iteration results; the same rows trained on."""
    ref_w = final_weights(reference.out_dir)
    got_w = final_weights(out)
    assert ref_w.keys() == got_w.keys()
    for policy, tensors in ref_w.items():
        for key, value in tensors.items():
            assert np.array_equal(value, got_w[policy][key]), (policy, key)
    assert len(records) == len(reference.records) == ITERATIONS
    for a, b in zip(records, reference.records, strict=True):
        for key in COMPARED:
            assert a[key] == b[key], (a["iteration"], key)
    assert_rows_once(audit)
    for policy, trail in reference.audit.items():
        assert sorted(map(tuple, audit[policy])) == sorted(map(tuple, trail)), policy


def assert_rows_once(audit: dict) -> None:
    """Each row of iteration k trained on by step k only, in each of its epochs once."""
    for policy, trail in audit.items():
        per = Counter((sid, step, epoch) for sid, _, step, epoch in trail)
        assert set(per.values()) == {1}, f"{policy}: a row trained on twice in an epoch"
        rows = {(sid, step) for sid, _, step, _ in trail}
        assert len(rows) == ENVS * ITERATIONS, f"{policy}: rows lost"
        assert all(int(sid.split("-")[0]) == step for sid, step in rows)


def events(out: Path, name: str) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == name]


def records_on_disk(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "event" not in x]


# --- the rollout worker's state --------------------------------------------------------------
def test_a_rollout_workers_environment_state_round_trips_exactly() -> None:
    """Captured after an iteration, restored into a fresh worker: the next iterations (GRU
    hidden states, episodes ending and resetting mid-iteration) are bit-identical."""
    c = cfg(**{"network.kind": "gru", "train.rollout_steps": 15})
    run = MarlRun(c)
    weights = {n: PolicyLearner(c, lay).weights() for n, lay in run.layouts.items()}

    def load(env: EnvRollout, k: int) -> None:
        for name, w in weights.items():
            env.load(name, k, w)

    a = EnvRollout(c, run.layouts)
    load(a, 0)
    a.run(0)
    b = EnvRollout(c, run.layouts)  # a fresh worker, its environments at their first reset
    b.set_state(a.get_state())
    for k in (1, 2):  # 15-step iterations: episodes of 25 steps end inside iteration 1
        load(a, k)
        load(b, k)
        ra, rb = a.run(k), b.run(k)
        assert [e["returns"] for e in ra.episodes] == [e["returns"] for e in rb.episodes]
        for x, y in zip(ra.rows, rb.rows, strict=True):
            assert x.payload.keys() == y.payload.keys()
            for name in x.payload:
                assert np.array_equal(x.payload[name], y.payload[name]), (k, name)
    other = EnvRollout(c, run.layouts, index=1)
    with pytest.raises(ValueError, match="worker 1: offered the environment state of worker 0"):
        other.set_state(a.get_state())


# --- checkpoint and resume -------------------------------------------------------------------
def test_stopped_after_two_iterations_then_resumed_equals_uninterrupted(tmp_path, reference):
    """Also: the records reach TensorBoard (`logging.backends`), the resumed ones included."""
    pytest.importorskip("tensorboard")
    from flexmarl.telemetry.loggers import read_tensorboard

    tb = {"logging.backends": ["jsonl", "tensorboard"]}
    out = tmp_path / "run"
    first = train_marl(cfg(**tb), out, iterations=2)
    assert len(first.records) == 2
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "gen-000002"
    gen = out / "checkpoints" / "gen-000002"
    assert (gen / "extra" / "rollout-0.pkl").is_file()
    assert {p.name for p in (gen / "agents").iterdir()} == {"speaker_0", "listener_0"}
    resumed = train_marl(cfg(**tb), out, resume=out)
    assert [r["iteration"] for r in resumed.records] == list(range(ITERATIONS))
    times = [r["time_s"] for r in resumed.records]  # the clock carries on across the resume
    assert times == sorted(times) and times[2] > times[1] == first.records[1]["time_s"]
    scalars = read_tensorboard(out / "tb")
    assert scalars["return_mean"] == pytest.approx(
        {r["iteration"]: r["return_mean"] for r in resumed.records})
    assert set(scalars["agent/listener_0/loss/value"]) == set(range(ITERATIONS))
    assert events(out, "resumed")[0]["completed"] == 2
    assert [r["iteration"] for r in records_on_disk(out)] == list(range(ITERATIONS))
    assert_same_run(out, resumed.records, resumed.audit, reference)
    with pytest.raises(CheckpointError, match="has policies"):  # a config that does not fit
        train_marl(cfg(**{"share": True}), tmp_path / "x", resume=out)


def _generation(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "LATEST").read_text().strip().split("-")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cli(config: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl", "train", str(config),
                             "--out", str(out), *extra], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _resume_and_check(config: Path, out: Path, completed: int, reference) -> None:
    """Resume (a generation every iteration from here: the last one's audit is checked)."""
    resumed = _cli(config, out, "--resume", str(out), "--set", "train.checkpoint_every=1")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert events(out, "resumed")[0]["completed"] == completed
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    pos = json.loads((out / "checkpoints" / latest / "position.json").read_text())
    assert pos["completed"] == ITERATIONS
    assert_same_run(out, records_on_disk(out), pos["audit"], reference)
    summary = json.loads((out / "summary.json").read_text())  # speed of this process's part
    assert summary["env_steps"] == ITERATIONS * ENVS * 25
    assert summary["env_steps_this_process"] == (ITERATIONS - completed) * ENVS * 25


@pytest.mark.slow  # two CLI runs, each starting its worker processes
def test_sigkill_of_the_driver_then_resume_equals_uninterrupted(tmp_path, reference):
    """A real `flexmarl train` process group SIGKILLed after its second checkpoint (with
    slowed checkpoint writes, so the kill may land mid-write), then `--resume`."""
    config = tmp_path / "sl.yaml"
    config.write_text(yaml.safe_dump(raw()))
    out = tmp_path / "run"
    proc = _cli(config, out, env={"FLEXMARL_CHAOS_SLOW_CHECKPOINT_S": "0.3"})
    deadline = time.time() + 300
    while _generation(out) < 2:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.time() < deadline, "no second checkpoint"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its workers
    proc.wait(timeout=60)
    killed_at = _generation(out)
    assert killed_at < ITERATIONS and not (out / "checkpoints" / "final").exists()
    _resume_and_check(config, out, killed_at, reference)


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_boundary_stops_and_resumes(tmp_path, reference):
    config = tmp_path / "sl.yaml"
    config.write_text(yaml.safe_dump(raw(**{"train.checkpoint_every": 100})))
    out = tmp_path / "run"
    proc = _cli(config, out)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or '"iteration": 0' not in (
            out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "interrupted" in stderr and "resume from" in stderr
    stopped = _generation(out)
    assert 1 <= stopped < ITERATIONS and events(out, "stop_requested")
    _resume_and_check(config, out, stopped, reference)


# --- the supervisor --------------------------------------------------------------------------
def _kill_during(pool: str, method: str, n: int, state: dict):
    """on_runtime hook: at the n-th call (from 0) of `method` of the pool, SIGKILL worker 0
    of `pool` while the call is in flight."""

    def hook(runtime) -> None:
        target = runtime.rollout if pool == "rollout" else runtime.train
        workers = runtime.rollout_workers if pool == "rollout" else runtime.train_workers
        original = getattr(target, method)
        calls = [0]

        async def wrapped(*args):
            calls[0] += 1
            task = asyncio.ensure_future(original(*args))
            if calls[0] - 1 == n:
                await asyncio.sleep(0.01)  # the command is on its way or running
                state["pid"] = workers[0].process.pid
                os.kill(state["pid"], signal.SIGKILL)
            return await task

        setattr(target, method, wrapped)

    return hook


def test_rollout_worker_killed_mid_iteration_redoes_it_exactly(tmp_path, reference):
    out, state = tmp_path / "run", {}
    res = train_marl(cfg(), out, on_runtime=_kill_during("rollout", "rollout_on", 1, state))
    assert "pid" in state  # iteration 1's rollout
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed[0]["pool"] == "rollout" and failed[0]["pid"] == state["pid"]
    assert recovered[0]["pool"] == "rollout" and recovered[0]["recovery_s"] > 0
    assert res.faults is not None and res.faults["iterations_redone"] == 1
    assert_same_run(out, res.records, res.audit, reference)


def test_training_slot_killed_mid_step_is_restored_exactly(tmp_path, reference):
    """The slot time-shares both policies: the restarted slot gets the bound policy's restart
    point (after step 0) and replays its accumulated rows; the swapped-out one is untouched."""
    out, state = tmp_path / "run", {}
    # the third step: iteration 1's first policy
    res = train_marl(cfg(), out, on_runtime=_kill_during("train", "step", 2, state))
    failed, recovered = events(out, "worker_failed"), events(out, "worker_recovered")
    assert failed[0]["pool"] == "train" and failed[0]["pid"] == state["pid"]
    assert recovered[0]["pool"] == "train"
    assert_same_run(out, res.records, res.audit, reference)


def test_without_restarts_a_killed_worker_fails_the_run(tmp_path):
    """Its only rollout worker lost for good: 1 of 1 failed is over the failure budget."""
    with pytest.raises(FailureBudgetExceeded, match=r"iteration 0: 1 of 1 rollout workers "
                       r"failed .*first error: rollout worker 0 lost"):
        train_marl(cfg(**{"runtime.max_worker_restarts": 0, "train.checkpoint_every": None}),
                   tmp_path / "run", on_runtime=_kill_during("rollout", "rollout_on", 0, {}))
    # hosted like an LLM run: the failure is on disk for doctor and report
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_type"] == "FailureBudgetExceeded"
    assert "rollout worker 0 lost" in summary["first_error"]
    assert events(tmp_path / "run", "failure_budget_exceeded")[0]["failed"] == 1


@pytest.mark.slow  # a run of 2 rollout workers (about 15 s)
def test_a_lost_rollout_worker_counts_against_the_failure_budget(tmp_path):
    """Rollout worker 0 lost for good in iteration 1 (no restarts): iteration 1 trains on
    worker 1's rows (1 of 2 failed, over the 0.4 fraction: tolerated once), iteration 2 fails
    again and stops the run with the budget's message."""
    out = tmp_path / "run"
    c = cfg(**{"runtime.max_worker_restarts": 0, "train.checkpoint_every": None,
               "runtime.rollout_workers": 2, "env.num_envs": ENVS // 2,
               "train.max_failed_fraction": 0.4,
               "train.max_consecutive_failed_iterations": 1})
    seen: list[dict] = []
    # rollout_on calls: (iteration 0: worker 0, 1), (iteration 1: worker 0, ...)
    with pytest.raises(FailureBudgetExceeded, match=r"iteration 2: 1 of 2 rollout workers "
                       r"failed \(50% > train.max_failed_fraction=0.4\) in 2 consecutive"):
        train_marl(c, out, on_iteration=seen.append,
                   on_runtime=_kill_during("rollout", "rollout_on", 2, {}))
    assert [r["rollout/workers_failed"] for r in seen] == [0, 1]
    assert "rollout worker 0" in seen[1]["errors"][0]
    assert seen[1]["episodes/total"] == seen[0]["episodes/total"] // 2  # worker 1's only
    failed = events(out, "rollout_failed")
    assert [(e["iteration"], e["worker"]) for e in failed] == [(1, 0), (2, 0)]
