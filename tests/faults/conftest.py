"""Shared by the fault tests: one small deterministic run config, its fault-free reference run,
and the row accounting every fault test asserts (no row lost, none trained on twice)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "referential_game.yaml"
ITERATIONS = 3
OVERRIDES = [
    "runtime.deterministic=true", f"train.iterations={ITERATIONS}", "train.inputs_per_iteration=4",
    "train.group_size=8", "train.micro_batch_size=16", "train.checkpoint_every=1",
    "runtime.rollout_workers=2",
]


def config(*extra: str):
    return load_config(EXAMPLE, [*OVERRIDES, *extra])


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted, fault-free run every faulty run must end equal to."""
    out = tmp_path_factory.mktemp("reference")
    return train(config(), out)


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def assert_final_equal(out: Path, reference) -> None:
    for agent, path in reference.checkpoints.items():
        diff = max_diff(out / "checkpoints" / "final" / agent, path)
        assert diff <= 1e-5, f"{agent}: max abs difference {diff} to the uninterrupted run"


def assert_rows_exactly_once(audit: dict, consumed: dict, cfg) -> None:
    """Count by sample_id: every row of every iteration trained on once, by the step of its
    iteration; its version is that step's (one less in one_step_off, never below 0)."""
    per_iteration = cfg.train.inputs_per_iteration * cfg.train.group_size
    lag = cfg.pipeline.max_staleness
    for agent, trail in audit.items():
        ids = [sid for sid, _, _ in trail]
        assert len(ids) == len(set(ids)), f"{agent}: a row was trained on twice"
        assert len(ids) == per_iteration * cfg.train.iterations, f"{agent}: rows lost"
        for sid, version, step in trail:
            assert version == max(0, step - lag) and sid.startswith(f"{step}-"), \
                (agent, sid, version, step)
        for k in range(cfg.train.iterations):
            got = consumed[agent][k] if k in consumed[agent] else consumed[agent][str(k)]
            assert len(got) == per_iteration


def audit_from_disk(out: Path) -> tuple[dict, dict]:
    """The committed audit trail, from the last checkpoint generation of a CLI run."""
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    pos = json.loads((out / "checkpoints" / latest / "position.json").read_text())
    assert pos["completed"] == ITERATIONS
    return pos["audit"], pos["consumed"]


def events(out: Path, name: str) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == name]


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexmarl", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True, **kw)


def cli_args(out: Path, *extra: str) -> list[str]:
    args = ["train", str(EXAMPLE), "--out", str(out)]
    for o in OVERRIDES:
        args += ["--set", o]
    return [*args, *extra]


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()}")
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """SIGKILL the run and its worker processes (a node going down takes all of them)."""
    os.killpg(proc.pid, sig)
    proc.wait(timeout=60)
