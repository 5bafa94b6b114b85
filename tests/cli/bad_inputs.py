"""Every bad input a new user tried, as data: (group, case, how to make it, what the error must
say, exit code). `test_bad_inputs.py` runs them through the real CLI; `python -m
tests.cli.bad_inputs` prints the table (docs/troubleshooting.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "referential_game.yaml"
TINY = ["--set", "train.iterations=1", "--set", "train.inputs_per_iteration=2",
        "--set", "train.group_size=2"]


@dataclass
class Case:
    group: str
    name: str
    # tmp folder -> argv after `flexmarl`
    argv: Callable[[Path], list[str]]
    expect: str  # a fragment of the one-line message
    code: int = 2
    slow: bool = False  # starts workers (a real run)


def train(*extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", str(EXAMPLE), *TINY, "--out", str(tmp / "run"), *extra]


def with_file(content: bytes | str, *extra: str, name: str = "c.yaml"):
    def make(tmp: Path) -> list[str]:
        path = tmp / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return ["train", str(path), "--out", str(tmp / "run"), *extra]
    return make


def bad_task(kind: str) -> Callable[[Path], list[str]]:
    return train("--set", "task.builder=tests.cli.bad_tasks:build",
                 "--set", f"task.options={{kind: {kind}}}")


def out_is_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("x")
    return ["train", str(EXAMPLE), "--out", str(tmp / "file")]


def out_under_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("x")
    return ["train", str(EXAMPLE), "--out", str(tmp / "file" / "run")]


def resume(setup: Callable[[Path], Path]) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", str(EXAMPLE), "--resume", str(setup(tmp))]


def _empty_dir(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _a_file(tmp: Path) -> Path:
    (tmp / "f").write_text("x")
    return tmp / "f"


def _dangling_latest(tmp: Path) -> Path:
    (tmp / "r" / "checkpoints").mkdir(parents=True)
    (tmp / "r" / "checkpoints" / "LATEST").write_text("gen-4\n")
    return tmp / "r"


def serve(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["serve-model", *[a.replace("TMP", str(tmp)) for a in args]]


CASES = [
    # --- the config file itself ---
    Case("config file", "missing file", lambda t: ["train", str(t / "nope.yaml")],
         "nope.yaml: cannot read config: No such file or directory"),
    Case("config file", "a folder", lambda t: ["train", str(t)],
         "cannot read config: Is a directory"),
    Case("config file", "not text (binary)", with_file(b"\x89PNG\r\n\x1a\n\xff\xfe\x00"),
         "not a text file"),
    Case("config file", "malformed YAML", with_file("agents: [\n"), "malformed YAML (line"),
    Case("config file", "top level a list", with_file("- a\n- b\n"),
         "top level must be a mapping, got list"),
    Case("config file", "empty file", with_file(""), "task / env: a run trains on a task's graph"),
    Case("config fields", "unknown key (typo)", train("--set", "train.iteratons=3"),
         "train.iteratons: unknown key"),
    Case("config fields", "wrong type", train("--set", "train.iterations=lots"),
         "train.iterations: Input should be a valid integer"),
    Case("config fields", "--set without =", train("--set", "train.iterations"),
         "expected key=value"),
    Case("config fields", "--set value not YAML", train("--set", "train.iterations=[1"),
         "value is not valid YAML"),
    Case("config fields", "negative learning rate", train("--set", "agents.speaker.optim.lr=-1"),
         "agents.speaker.optim.lr: Input should be greater than 0"),
    Case("config fields", "unknown algorithm", train("--set", "agents.speaker.algorithm.name=dpo"),
         "algorithm.name must be one of grpo, ppo, reinforce_pp"),
    Case("config fields", "failure budget out of range",
         train("--set", "train.max_failed_fraction=2"),
         "train.max_failed_fraction: Input should be less than or equal to 1"),
    *(Case("config fields", f"environment run given to {' '.join(cmd)}",
           lambda t, cmd=cmd: [*cmd, str(ROOT / "examples" / "mpe_spread.yaml")],
           f"mpe_spread.yaml: env: `flexmarl {' '.join(cmd)}` measures task runs")
      for cmd in (("bench", "compare"), ("bench", "pipeline"),
                  ("simulate", "--profile-local"))),
    # --- output and resume folders ---
    Case("folders", "--out is a file", out_is_file, "exists and is not a folder"),
    Case("folders", "--out under a file", out_under_file, "is not a folder"),
    Case("folders", "--resume missing", resume(lambda t: t / "gone"), "no such folder"),
    Case("folders", "--resume a file", resume(_a_file), "not a folder"),
    Case("folders", "--resume without checkpoints", resume(_empty_dir), "no checkpoints found"),
    Case("folders", "--resume LATEST to nothing", resume(_dangling_latest),
         "missing or unreadable manifest"),
    # --- the task builder ---
    Case("task builder", "no colon", train("--set", "task.builder=flexmarl.tasks.referential"),
         "is not of the form 'package.module:function'"),
    Case("task builder", "module missing", train("--set", "task.builder=nowhere.mod:fn"),
         "cannot import module 'nowhere.mod'"),
    Case("task builder", "attribute missing",
         train("--set", "task.builder=flexmarl.tasks.referential:nope"), "has no attribute 'nope'"),
    Case("task builder", "raises its own exception",
         train("--set", "task.builder=tests.cli.bad_tasks:raises"),
         "raised RuntimeError: dataset shard 7 is missing"),
    Case("task builder", "returns a dict",
         train("--set", "task.builder=tests.cli.bad_tasks:returns_dict"),
         "returned dict, not Task"),
    Case("task builder", "rejects an option", train("--set", "task.options.colour=red"),
         "task.options: flexmarl.tasks.referential:build_referential_game rejected the options"),
    Case("task builder", "option out of range", train("--set", "task.options.num_objects=1"),
         "task.options.num_objects: must be an integer >= 2"),
    Case("task builder", "agent no node uses", train("--set", "agents.critic={}"),
         "agents.critic: configured, but no node of the graph uses it"),
    Case("task builder", "graph with a cycle",
         train("--set", "task.builder=tests.orchestrator.faulty_tasks:cyclic"),
         "graph has a cycle: speak -> listen -> speak"),
    # --- values user functions return ---
    Case("user functions", "token id >= vocab", bad_task("out_of_vocab"),
         "node 'listen' (agent 'listener'): prompt builder: tokens[8] = 35 is outside agent "
         "'listener''s vocabulary [0, 30)"),
    Case("user functions", "negative token id", bad_task("negative_id"),
         "tokens[0] = -1 is outside agent 'speaker''s vocabulary"),
    Case("user functions", "float token ids", bad_task("float_ids"),
         "tokens[0] is 1.0 (float), not an integer token id"),
    Case("user functions", "prompt not a NodePrompt", bad_task("not_a_prompt"),
         "node 'speak' (agent 'speaker'): prompt builder returned a list of token ids, not "
         "NodePrompt"),
    Case("user functions", "prompt an int", bad_task("int_prompt"),
         "node 'speak' (agent 'speaker'): prompt builder returned int; expected a NodePrompt "
         "(token ids), a string, a list of chat messages"),
    Case("user functions", "stop string not a string", bad_task("bad_stop"),
         "node 'speak' (agent 'speaker'): prompt builder: TextPrompt.stop[0] is 3 (int); a "
         "stop string must be a non-empty string"),
    Case("user functions", "chat prompt, vocabulary too small", bad_task("text_small_vocab"),
         "agent 'speaker': its tokenizer has 261 tokens but the model's vocabulary has"),
    Case("user functions", "empty prompt", bad_task("empty_prompt"),
         "prompt builder: tokens is empty"),
    Case("user functions", "zero token budget", bad_task("zero_budget"),
         "max_new_tokens is 0; the token budget must be >= 1"),
    Case("user functions", "over-long prompt", bad_task("too_long"),
         "exceeds the task's max_seq_len 14"),
    Case("user functions", "allowed token outside vocab", bad_task("bad_allowed"),
         "allowed_tokens[0] = 30 is outside"),
    Case("user functions", "reward a string", bad_task("string_reward"),
         "episode reward returned '1.0' (str), not a number"),
    Case("user functions", "condition returns None", bad_task("condition_none"),
         "node 'listen': condition (when=) returned None (NoneType), not a bool"),
    Case("user functions", "inputs not a list", bad_task("inputs_not_list"),
         "sample_inputs returned NoneType, not a list of dicts"),
    Case("user functions", "input sampler raises", bad_task("inputs_raise"),
         "sample_inputs raised KeyError: \"split 'train'\""),
    Case("user functions", "NaN reward (found mid-run)", bad_task("nan_reward"),
         "episode reward returned nan, not a finite number", slow=True),
    # --- models and memory ---
    Case("model", "too big for memory",
         train("--set", "agents.speaker.model={hidden_size: 16384, intermediate_size: 65536, "
               "num_layers: 48, num_heads: 16}"),
         "agents.speaker.model smaller"),
    Case("model", "kind path without path", train("--set", "agents.speaker.model.kind=path"),
         "model.path is required when model.kind is 'path'"),
    Case("model", "heads do not divide hidden", train("--set", "agents.speaker.model.num_heads=5"),
         "model.hidden_size must be divisible by model.num_heads"),
    Case("model", "checkpoint missing",
         train("--set", "agents.speaker.model.checkpoint=/nonexistent/x"),
         "/nonexistent/x"),
    # --- serving options ---
    Case("serving", "openai backend without url",
         train("--set", "agents.listener.backend={kind: openai}", "--set",
               "agents.listener.trainable=false"),
         "agents.listener.backend.url: required"),
    Case("serving", "openai url without scheme",
         train("--set", "agents.listener.backend={kind: openai, url: 'localhost:8000'}",
               "--set", "agents.listener.trainable=false"),
         "expected http://HOST:PORT"),
    Case("serving", "openai backend on a trainable agent",
         train("--set", "agents.listener.backend={kind: openai, url: 'http://127.0.0.1:9'}"),
         "the openai backend serves frozen agents only"),
    Case("serving", "vllm backend (removed)", train("--set", "agents.listener.backend.kind=vllm"),
         "agents.listener.backend.kind"),
    Case("serving", "serve-model port out of range", serve("TMP", "--port", "70000"),
         "--port 70000: must be in 1..65535"),
    Case("serving", "serve-model folder not a model", serve("TMP"),
         "is not a model folder (no config.json)"),
    # --- failure budget (exit code 1) ---
    Case("failure budget", "every episode fails (judge raises)", bad_task("reward_always_raises"),
         "run stopped by its failure budget: iteration 0: 4 of 4 episodes failed", code=1,
         slow=True),
]


def run_case(case: Case, tmp: Path, subprocess_: bool = True) -> tuple[int, str]:
    """(exit code, stderr) of the real CLI."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("FLEXMARL_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "flexmarl", *case.argv(tmp)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stderr


def run_in_process(case: Case, tmp: Path) -> tuple[int, str]:
    """(exit code, stderr) of the CLI's main() in this process (torch imported once)."""
    import contextlib
    import io

    from flexmarl.cli.main import main

    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(case.argv(tmp))
    finally:
        os.chdir(cwd)
    return code, err.getvalue()


if __name__ == "__main__":  # the table of the closing note and docs/troubleshooting.md
    import sys
    import tempfile

    sys.path.insert(0, str(ROOT))
    print("| group | bad input | exit | message |\n|---|---|---|---|")
    for case in CASES:
        if len(sys.argv) > 1 and sys.argv[1] not in case.group:
            continue
        with tempfile.TemporaryDirectory() as d:
            code, err = run_in_process(case, Path(d))
        lines = err.splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.startswith("error:")), None)
        line = " / ".join(ln.strip() for ln in lines[at:]) if at is not None \
            else err.strip()[-200:]
        flag = "" if "Traceback" not in err else " TRACEBACK"
        line = line.replace(d, "TMP").replace("|", "\\|")
        print(f"| {case.group} | {case.name} | {code}{flag} | {line} |", flush=True)
