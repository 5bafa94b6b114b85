"""The command line as a user meets it: real subprocesses, real files on disk."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl.cli.doctor import load_run
from flexmarl.cli.main import main
from flexmarl.cli.report import _samples_table

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "referential_game.yaml"


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "flexmarl", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


# The five error tests below are slow (make test budget: ~28 s of subprocesses, each
# importing torch). make test runs each of these errors through main() in
# tests/cli/test_bad_inputs.py, which also runs one real subprocess per group of errors;
# the sibling is named at each marker.
@pytest.mark.slow  # sibling: test_bad_input_in_process[config file: malformed YAML]
def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: [\n")
    _assert_clean_error(_cli("train", str(bad)), str(bad), "malformed YAML")


@pytest.mark.slow  # siblings: test_bad_input_real_subprocess[config fields: unknown key
# (typo)], test_bad_input_in_process[config fields: wrong type]
def test_unknown_key_and_wrong_type():
    _assert_clean_error(_cli("train", str(EXAMPLE), "--set", "train.iteratons=3"),
                        "train.iteratons: unknown key")
    _assert_clean_error(_cli("train", str(EXAMPLE), "--set", "train.iterations=lots"),
                        "train.iterations: Input should be a valid integer")


@pytest.mark.slow  # sibling: test_bad_input_in_process[task builder: module missing]
def test_import_path_that_does_not_resolve():
    _assert_clean_error(_cli("train", str(EXAMPLE), "--set", "task.builder=nowhere.mod:fn"),
                        "task.builder: cannot import module 'nowhere.mod'")


@pytest.mark.slow  # sibling: test_bad_input_in_process[task builder: graph with a cycle]
def test_graph_with_a_cycle():
    _assert_clean_error(
        _cli("train", str(EXAMPLE), "--set", "task.builder=tests.orchestrator.faulty_tasks:cyclic"),
        "graph has a cycle: speak -> listen -> speak")


@pytest.mark.slow  # sibling: test_bad_input_in_process[task builder: agent no node uses]
def test_agent_without_node():
    _assert_clean_error(_cli("train", str(EXAMPLE), "--set", "agents.critic={}"),
                        "agents.critic: configured, but no node of the graph uses it")


def assert_samples_shown(stderr: str, run: Path, iterations: int) -> None:
    """`--show-samples 1` on referential_game: one sample per agent and iteration printed
    live, the same in the run's samples.jsonl (which keeps the default 2 per agent and
    iteration)."""
    printed = [line for line in stderr.splitlines() if line.startswith("[")]
    assert sorted(line.split("]")[0] for line in printed) == (
        ["[listener"] * iterations + ["[speaker"] * iterations)
    kept = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(kept) == iterations * 2 * 2
    first = kept[0]
    assert printed[0].startswith(f"[{first['agent']}] it 0 {first['node']}")
    assert f"answer ({first['answer_tokens']} tokens): " in stderr


def test_train_writes_metrics_trace_and_reloadable_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    proc = _cli("train", str(EXAMPLE), "--set", "train.iterations=3", "--set", "seed=1",
                "--set", "pipeline.mode=sync", "--out", str(out), "--show-samples", "1")
    assert proc.returncode == 0, proc.stderr
    assert "final success rate" in proc.stdout and str(out / "metrics.jsonl") in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for key in ("wall_s", "task/success_rate", "agent/speaker/reward_mean",
                "agent/listener/policy_version", "pool/rollout/busy_frac",
                "pool/train/busy_frac", "agent/speaker/loss/policy", "agent/speaker/entropy"):
        assert key in records[-1], key
    assert records[-1]["agent/listener/policy_version"] == 3
    trace = json.loads((out / "trace.json").read_text())
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert {"gen", "acc", "step"} <= cats
    assert_samples_shown(proc.stderr, out, iterations=3)
    # doctor reads the run's folder, the report's table shows what the agents said (the
    # report's page and images: tests/cli/test_doctor_report.py)
    assert main(["doctor", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert "<td>speak</td>" in _samples_table(load_run(out))
    transformers = pytest.importorskip("transformers")
    for agent in ("speaker", "listener"):
        path = out / "checkpoints" / "final" / agent
        assert (path / "model.safetensors").exists()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
        assert model.config.vocab_size == 30
