"""`flexmarl train` for a `kind: marl` config: progress bar, then where the outputs are."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from flexmarl.marl.config import is_marl


def is_marl_file(path: str) -> bool:
    """True when the YAML at `path` is a classic MARL run (`env:`, or the old `kind: marl`,
    whose loader says what changed); unreadable files: the LLM loader names the problem."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return is_marl(raw) or (isinstance(raw, dict) and raw.get("kind") == "marl")


def train_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flexmarl.marl.config import load_marl_config
    from flexmarl.orchestrator.checkpoint import Checkpoint, find_checkpoints
    from flexmarl.orchestrator.preflight import check_out_dir, check_resume_dir

    cfg = load_marl_config(args.config, args.set)
    resume = Path(args.resume) if args.resume else None
    if resume is not None:
        check_resume_dir(resume)
    default_out = resume.parent if resume and resume.name == "checkpoints" else resume
    out = Path(args.out or default_out or cfg.out or Path("runs") / cfg.name)
    check_out_dir(out, "--out" if args.out else ("--resume" if default_out else
                                                 "out (the run's output folder)"))
    # every file of the generation verified against its manifest before any worker starts
    ckpt: Checkpoint | None = find_checkpoints(resume).load() if resume is not None else None
    from flexmarl.marl.run import make_run

    trainer = make_run(cfg)  # environments probed: spaces checked
    console = Console(stderr=True)
    envs = cfg.env.num_envs * cfg.runtime.rollout_workers  # every rollout worker's
    console.print(f"[bold]flexmarl[/] training [cyan]{cfg.name}[/]: {cfg.env.id}, "
                  f"{len(trainer.agents)} agents, {cfg.algorithm.name}, "
                  f"{envs} envs, {cfg.iterations} iterations "
                  f"({cfg.iterations * envs * cfg.train.rollout_steps} env steps) "
                  f"-> {out}")
    progress = Progress(TextColumn("[bold blue]iteration {task.completed}/{task.total}"),
                        BarColumn(), TextColumn("return {task.fields[ret]:.2f}"),
                        TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
                        console=console)
    with progress:
        bar = progress.add_task("train", total=cfg.iterations, ret=0.0, speed="",
                                completed=ckpt.completed if ckpt is not None else 0)

        def on_iteration(rec: dict) -> None:
            progress.update(bar, advance=1, ret=rec.get("return_mean", 0.0),
                            speed=f"{rec['env_steps_per_s']:.0f} steps/s")

        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"),
                                                        sort_keys=False))
        from flexmarl.orchestrator.checkpointing import RunInterrupted

        try:
            result = trainer.run(out, on_iteration, resume=ckpt)
        except RunInterrupted as exc:  # SIGTERM / Ctrl-C, after the boundary's checkpoint
            progress.stop()
            print(f"interrupted: {exc}", file=sys.stderr)
            return 143
    import json

    # a resumed run's wall time covers only the iterations run here
    done_before = ckpt.completed * envs * cfg.train.rollout_steps if ckpt is not None else 0
    steps_here = result.env_steps - done_before
    (out / "summary.json").write_text(json.dumps({
        "status": "completed", "iterations": len(result.records), "env_steps": result.env_steps,
        "env_steps_this_process": steps_here, "wall_s": result.wall_s,
        "algorithm": cfg.algorithm.name}, indent=2))
    tail = result.records[-max(1, len(result.records) // 10):]
    rets = [r["return_mean"] for r in tail if "return_mean" in r]
    print(f"final mean episode return per agent (last 10% of iterations): "
          f"{sum(rets) / max(len(rets), 1):.2f}")
    for key in sorted({k for r in tail for k in r if k.startswith("task/")}):
        vals = [r[key] for r in tail if key in r]
        print(f"{key}: {sum(vals) / len(vals):.3f}")
    resumed = f" (resumed after {done_before})" if done_before else ""
    print(f"wall time: {result.wall_s:.1f} s for {steps_here} env steps{resumed}, "
          f"{steps_here / result.wall_s:.0f} env steps/s")
    print(f"metrics:     {out / 'metrics.jsonl'}")
    for path in sorted((out / "checkpoints" / "final").glob("*/model.safetensors")):
        print(f"checkpoint:  {path}")
    return 0
