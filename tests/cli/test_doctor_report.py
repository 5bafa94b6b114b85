"""`flexmarl doctor` on recorded metrics of deliberately broken runs (benchmarks/doctor_cases.py
records them), and `flexmarl report` renders a page whose HTML parses and whose images exist."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from flexmarl.cli.doctor import diagnose, load_run
from flexmarl.cli.main import main
from tests.cli.test_cli import assert_samples_shown

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "doctor"

# case -> (the problem the doctor must name first, the metric it must cite)
EXPECTED = {
    "high_lr": ("learning rate too high", "reward_mean"),
    "large_observations": ("exploding gradient norms", "grad_norm"),
    "lazy_agent": ("lazy agent", "agent/speaker/entropy"),
    "one_slot": ("swap thrash", "pool/train/swaps"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_doctor_names_the_cause_of_each_broken_run(case):
    findings = diagnose(load_run(DATA / case))
    assert findings, f"{case}: nothing found"
    problem, metric = EXPECTED[case]
    first = findings[0]
    assert problem in first.problem, [f.problem for f in findings]
    assert metric in first.metric and first.iterations and first.remedy
    if case == "high_lr":
        assert "by 0.8x (from 0.3 to 0.24)" in first.remedy
    # and it does not blame the other causes
    others = {p for c, (p, _) in EXPECTED.items() if c != case}
    assert not any(o in f.problem for f in findings for o in others), \
        [f.problem for f in findings]


def test_doctor_finds_nothing_in_a_healthy_run(capsys):
    assert main(["doctor", str(DATA / "healthy")]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_doctor_json_and_failed_run(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DATA / "healthy", run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec.update({"episodes/failed": 100, "errors": ["node 'listen': reward raised X"]})
    lines[1] = json.dumps(rec)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": "failed", "error_type": "E",
                                                  "error": "budget"}))
    assert main(["doctor", str(run), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    problems = [f["problem"] for f in found]
    assert "the run failed" in problems and "failing episodes" in problems
    failing = next(f for f in found if f["problem"] == "failing episodes")
    assert failing["iterations"] == [rec["iteration"]] and "reward raised X" in failing["evidence"]


@pytest.mark.parametrize("what", ["missing", "file", "no_metrics", "not_json"])
def test_doctor_and_report_bad_run_folders(what, tmp_path, capsys):
    target = tmp_path / "r"
    if what == "file":
        target.write_text("x")
    elif what in ("no_metrics", "not_json"):
        target.mkdir()
        if what == "not_json":
            (target / "metrics.jsonl").write_text("{oops\n")
    expect = {"missing": "no such run folder", "file": "not a folder",
              "no_metrics": "no metrics.jsonl", "not_json": "line 1 is not JSON"}[what]
    for command in ("doctor", "report"):
        assert main([command, str(target)]) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.headings, self._h = [], [], False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        self._h = tag == "h2"

    def handle_data(self, data):
        if self._h:
            self.headings.append(data.strip())
            self._h = False


def test_report_renders_html_with_images(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", str(DATA / "healthy"), "--out", str(out)]) == 0
    page = _Page()
    page.feed((out / "index.html").read_text())
    assert {"Doctor", "Learning curves", "Where the time went", "Plan of each iteration",
            "Config"} <= set(page.headings)
    assert len(page.images) == 5  # learning, training, busy, gantt, throughput
    for src in page.images:
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("learning_curves", "training", "busy", "gantt", "throughput"):
        assert (out / f"{name}.png").stat().st_size > 5000


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="Debian chromium not installed")
def test_report_in_headless_chromium(tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(DATA / "healthy"), "--out", str(out)]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1300,2400",
                    f"--screenshot={shot}", (out / "index.html").as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert shot.exists() and shot.stat().st_size > 20000


# make test budget (22 s measured): each backend reads back the same records in
# tests/telemetry/test_loggers.py; doctor and report on a recorded run above
# (test_doctor_finds_nothing_in_a_healthy_run, test_report_renders_html_with_images);
# --show-samples, samples.jsonl, doctor and the report's samples table on a real CLI run:
# tests/cli/test_cli.py::test_train_writes_metrics_trace_and_reloadable_checkpoints
@pytest.mark.slow
def test_real_run_with_every_logger_then_doctor_and_report(tmp_path):
    """One real CLI run, all four backends: the same metric names in each; doctor and report
    read its folder."""
    from flexmarl.telemetry import loggers as L

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flexmarl", "train",
         str(ROOT / "examples" / "referential_game.yaml"),
         "--set", "train.iterations=2", "--set", "train.inputs_per_iteration=4",
         "--set", "logging.backends=[jsonl, tensorboard, wandb, mlflow]", "--out", str(run),
         "--show-samples", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    names = {k for r in L.read_jsonl(run / "metrics.jsonl") for k in L.scalars(r)}
    assert {"agent/speaker/train_tokens_per_s", "agent/listener/train_samples_per_s",
            "agent/speaker/slot_wait_s", "pool/train/swaps", "pool/train/swap_s",
            "store/rows_held"} <= names
    assert set(L.read_tensorboard(run / "tb")) == names
    assert set(L.read_wandb_offline(next((run / "wandb").glob("offline-run-*")))) == names
    assert set(L.read_mlflow((run / "mlruns").resolve().as_uri())) == names
    for command in ("doctor", "report"):
        p = subprocess.run([sys.executable, "-m", "flexmarl", command, str(run)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert (run / "report" / "index.html").exists()
    assert_samples_shown(proc.stderr, run, iterations=2)
    page = (run / "report" / "index.html").read_text()
    assert "What the agents said" in page and "<td>speak</td>" in page


def test_doctor_store_throughput_and_skipped_steps_rules(tmp_path):
    """The rules no recorded run triggers, on metrics written to a real run folder."""
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for k in range(12):
        lines.append({"iteration": k, "task/success_rate": 0.5, "episodes/total": 8,
                      "episodes/failed": 0, "store/rows_held": 100 * (k + 1),
                      "agent/a/tokens_per_s": 1000.0 if k < 6 else 200.0,
                      "agent/a/reward_mean": 0.5, "agent/a/grad_norm": 1.0})
    lines.append({"event": "step_skipped", "agent": "a", "iteration": 3,
                  "reason": "non-finite loss nan"})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    found = {f.problem: f for f in diagnose(load_run(run))}
    assert found["growing experience store: rows are not evicted"].metric == "store/rows_held"
    drop = found["rollout throughput dropped"]
    assert drop.metric == "agent/a/tokens_per_s" and drop.iterations[-1] == 11
    skipped = found["optimizer steps skipped (non-finite loss or gradient)"]
    assert skipped.iterations == [3] and "non-finite loss" in skipped.evidence


def _collapsed_run(tmp_path: Path, algorithm: dict) -> Path:
    """A run whose judge's entropy fell to nothing while it answered one thing to every input."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps({
        "agents": {"judge": {"algorithm": algorithm}}, "train": {"group_size": 2}}))
    rows = [{"iteration": i, "agent/judge/entropy": 1.0 if i < 2 else 0.01,
             "agent/judge/top_response_frac": 0.3 if i < 2 else 1.0,
             "agent/judge/reward_mean": 0.5} for i in range(8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_doctor_collapse_advice_names_the_option_that_fixes_it(tmp_path):
    run = load_run(_collapsed_run(tmp_path, {"name": "grpo"}))
    found = [f for f in diagnose(run) if f.problem.startswith("entropy collapse")]
    assert found and found[0].agent == "judge"
    remedy = found[0].remedy
    assert remedy.startswith("agents.judge.algorithm.kl_coef: 0.1 (a KL to the frozen ")
    assert "agents.judge.algorithm.balance_labels: true" in remedy
    assert "agents.judge.algorithm.normalize: agent_previous or agent (with group_size 2" \
        in remedy
    assert "agents.judge.algorithm.clip_eps_high: 0.28" in remedy
    # already on the team defaults with clip-higher: the general advice only
    shutil.rmtree(tmp_path / "run")
    run = load_run(_collapsed_run(tmp_path, {"name": "grpo", "normalize": "agent",
                                             "clip_eps_high": 0.28, "kl_coef": 0.1,
                                             "balance_labels": True}))
    remedy = [f for f in diagnose(run) if f.problem.startswith("entropy collapse")][0].remedy
    assert "normalize" not in remedy and remedy.startswith("agents.judge.algorithm.entropy_coef")


def test_doctor_sees_one_verdict_for_every_input_through_the_true_classes(tmp_path):
    """Responses that differ as strings ("No.", "No,") hide a judge's collapse from
    top_response_frac; its reward per true class does not."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps({"agents": {"judge": {"algorithm": {
        "name": "grpo"}}}}))
    rows = [{"iteration": i, "agent/judge/reward_mean": 0.4,
             "agent/judge/top_response_frac": 0.4,
             "agent/judge/reward_mean/False": 1.0 if i >= 3 else 0.6,
             "agent/judge/reward_mean/True": 0.0 if i >= 3 else 0.5} for i in range(9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = [f for f in diagnose(load_run(run)) if f.problem.startswith("one verdict")]
    assert len(found) == 1 and found[0].agent == "judge"
    assert found[0].metric == "agent/judge/reward_mean/True"
    assert "False 1.00, True 0.00" in found[0].evidence
    assert found[0].remedy.startswith("agents.judge.algorithm.kl_coef: 0.1")
    # a judge that was never better than chance on both classes: first, its model's signal
    rows = [{**r, "agent/judge/balanced_reward_mean": 0.5} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = [f for f in diagnose(load_run(run)) if f.problem.startswith("one verdict")]
    assert found[0].remedy.startswith("judge never judged better than chance (balanced reward "
                                      "at most 0.50)"), found[0].remedy
    assert "benchmarks/judge_prior.py" in found[0].remedy
    assert "agents.judge.algorithm.kl_coef: 0.1" in found[0].remedy
    # a judge right on both classes: nothing to say
    rows = [{**r, "agent/judge/reward_mean/True": 0.95} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not [f for f in diagnose(load_run(run)) if f.problem.startswith("one verdict")]


def _swinging_run(tmp_path: Path, std: float, entropy: list[float] | None = None) -> Path:
    """An agent whose reward_mean goes up and down by 0.15 around 0.45 for 20 iterations, with
    32 rows of 8 inputs (group_size 4) per iteration and a per-row reward std of `std`."""
    run = tmp_path / f"std{std}"
    run.mkdir()
    (run / "config.yaml").write_text("train: {group_size: 4}\nagents: {a: {}}\n")
    with (run / "metrics.jsonl").open("w") as f:
        for k in range(20):
            rec = {"iteration": k, "agent/a/reward_mean": 0.45 + (0.075 if k % 2 else -0.075),
                   "agent/a/reward_std": std, "agent/a/rows_trained": 32}
            if entropy is not None and k < len(entropy):
                rec["agent/a/entropy"] = entropy[k]
            f.write(json.dumps(rec) + "\n")
    return run


def test_swings_within_sampling_noise_are_not_blamed_on_the_learning_rate(tmp_path):
    # 8 inputs of 0/1 rewards (std 0.48): a mean moves about 0.16 by sampling alone
    noisy = diagnose(load_run(_swinging_run(tmp_path, 0.48)))
    assert not any("learning rate" in f.problem for f in noisy), [f.problem for f in noisy]
    # the same swings where rewards barely vary within an iteration are the policy's own
    steady = diagnose(load_run(_swinging_run(tmp_path, 0.05)))
    assert "learning rate too high" in steady[0].problem


def test_a_policy_thrown_onto_one_answer_in_its_first_steps_is_a_learning_rate(tmp_path):
    run = _swinging_run(tmp_path, 0.48, entropy=[1.4, 0.4, 0.001] + [0.0] * 17)
    first = diagnose(load_run(run))[0]
    assert "learning rate too high" in first.problem and first.metric == "agent/a/entropy"
    assert first.iterations == [0, 1, 2] and "within 2 steps" in first.evidence


def test_doctor_names_an_environment_runs_lost_rollout_workers(tmp_path):
    """An environment run's `rollout/workers_failed` (a worker lost for good): a warning while
    other workers stepped, an error for an iteration that lost them all, with the error."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("runtime: {rollout_workers: 2}\n")
    lost = {3: 1, 7: 2}
    lines = [{"iteration": k, "episodes/total": 16, "rollout/workers_failed": lost.get(k, 0),
              **({"errors": [f"rollout worker {k % 2} lost: killed by SIGKILL"]}
                 if k in lost else {})} for k in range(10)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    found = {f.problem: f for f in diagnose(load_run(run))}["rollout workers lost"]
    assert found.iterations == [3, 7] and found.severity == "error"
    assert "3 rollout worker losses of 2" in found.evidence
    assert "rollout worker 1 lost: killed by SIGKILL" in found.evidence
    lines[7]["rollout/workers_failed"] = 1
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    found = {f.problem: f for f in diagnose(load_run(run))}["rollout workers lost"]
    assert found.severity == "warning"


def _gpu_run(tmp_path: Path, name: str, mode: str, train_gpus: list[int], mps: bool) -> Path:
    run = tmp_path / name
    run.mkdir()
    records = [{"iteration": k, "pool/rollout/busy_frac": 0.48, "pool/train/busy_frac": 0.79}
               for k in range(5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"pipeline: {{mode: {mode}}}\n")
    placement = {"rollout": [{"worker": 0, "device": "cuda", "gpus": [0]}],
                 "train": [{"worker": 0, "device": "cuda", "gpus": train_gpus}], "mps": mps}
    (run / "summary.json").write_text(json.dumps({"status": "completed",
                                                  "placement": placement}))
    return run


def test_doctor_names_pools_sharing_a_gpu_without_mps(tmp_path):
    """An overlapping run whose rollout and training processes share a GPU with no MPS daemon
    is a warning naming the GPU and the daemon; sync runs, MPS and separate GPUs are not."""
    rule = "rollout and training share a GPU without MPS"
    found = {f.problem: f for f in diagnose(load_run(_gpu_run(tmp_path, "a", "async", [0],
                                                              False)))}
    assert "GPU 0" in found[rule].evidence and "nvidia-cuda-mps-control -d" in found[rule].remedy
    for name, mode, gpus, mps in (("b", "async", [0], True), ("c", "sync", [0], False),
                                  ("d", "async", [1], False)):
        assert rule not in {f.problem for f in diagnose(load_run(_gpu_run(tmp_path, name, mode,
                                                                          gpus, mps)))}

