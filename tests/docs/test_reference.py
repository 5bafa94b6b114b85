"""The task API reference builds strictly (a broken reference, a missing snippet or a
docstring griffe cannot read fails it), and its example team runs."""

import subprocess
import sys
from pathlib import Path

from flexmarl.config.schema import config_from_dict
from flexmarl.orchestrator.run import train
from flexmarl.policy.tokenizer import BYTE_VOCAB

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "site" / "index.html").read_text()
    for name in ("MEG", "EpisodeContext", "TextPrompt", "NodePrompt", "load_task",
                 "build_answer_judge", "resolve_sizes"):
        assert name in page, name


def test_the_reference_example_team_trains(tmp_path):
    small = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2}
    cfg = config_from_dict({
        "task": {"builder": "flexmarl.tasks.answer_judge:build_answer_judge",
                 "options": {"vocab_size": BYTE_VOCAB}},
        "agents": {"answerer": {"model": small, "sampling": {"max_tokens": 3}},
                   "judge": {"model": small}},
        "train": {"iterations": 1, "inputs_per_iteration": 2, "group_size": 2,
                  "micro_batch_size": 4},
    })
    result = train(cfg, tmp_path / "run")
    record = result.records[-1]
    assert record["episodes/failed"] == 0
    assert record["agent/judge/tokens_generated"] <= 2 * 2 * 2  # its TextPrompt budget
