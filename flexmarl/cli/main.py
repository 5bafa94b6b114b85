"""`flexmarl` command line: train, bench, simulate, serve, serve-model, doctor, report.

Exit codes: 0 done; 2 an error the user can fix (config, folders, graph, task, the values user
functions return, model vs memory): one line naming the file, field, node or agent, no traceback
(`--debug` or FLEXMARL_DEBUG=1 shows it); 1 a run stopped by its failure budget
(`train.max_failed_fraction`), with its first error, or an internal error: a bug, printed with
its traceback; 130/143 interrupted.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from flexmarl.config.schema import ConfigError, RunConfig, load_config
from flexmarl.config.systems import system_overrides
from flexmarl.errors import UserError
from flexmarl.serving.cli import add_serve_parser, run_serve
from flexmarl.telemetry.curves import reward_curves
from flexmarl.telemetry.samples import SampleTail, format_sample


@dataclass
class _RunKind:
    """What `flexmarl train` shows of a run: a task run's success, or an environment run's
    return; the rest (folders, resume, progress, stop, exit codes) is one path for both."""

    header: str
    train: Callable[..., Any]  # train(cfg, out, on_iteration, resume=...) -> result
    progress: str  # the progress bar's figure
    figure: Callable[[dict], float]
    speed: Callable[[dict], str]
    final: Callable[[Any], list[str]]


def _task_kind(cfg: RunConfig, out: Path) -> _RunKind:
    # start-up cost: each command loads only its own stack
    from flexmarl.orchestrator.run import prepare, train

    prepare(cfg)  # fail fast, before any worker starts

    def final(result: Any) -> list[str]:
        failed = sum(r["episodes/failed"] for r in result.records)
        n = cfg.task_config.options.get("num_candidates")
        chance = f" (chance {1 / max(n, 1):.3f})" if n is not None else ""
        lines = [f"final success rate: {result.final_success:.3f}{chance}",
                 f"wall time: {result.wall_s:.1f} s, failed episodes: {failed}",
                 *reward_curves(result.records, [a for a in cfg.agents
                                                 if cfg.agents[a].trainable]),
                 f"metrics:     {out / 'metrics.jsonl'}",
                 f"trace:       {out / 'trace.json'}  (open in chrome://tracing or "
                 "ui.perfetto.dev)"]
        for agent, path in result.checkpoints.items():
            # an LLM agent's save is a model folder, a network agent's the safetensors file
            shown = path if path.suffix == ".safetensors" else path / "model.safetensors"
            lines.append(f"checkpoint:  {shown}  [{agent}]")
        return lines

    return _RunKind(f"{len(cfg.agents)} agents, pipeline={cfg.pipeline.mode}, "
                    f"runtime={cfg.runtime.kind}, {cfg.train.iterations} iterations",
                    train, "success", lambda rec: rec["task/success_rate"],
                    lambda rec: f"{rec['wall_s']:.2f}s/it", final)


def _env_kind(cfg: RunConfig, out: Path) -> _RunKind:
    # imported here: the MARL stack (PettingZoo, the networks) is only needed for these runs
    from flexmarl.marl.run import MarlRun, train_marl

    run = MarlRun(cfg)  # environments probed: spaces and agents checked before any worker
    env, n_iter = cfg.environment, cfg.train.iterations
    envs = env.num_envs * cfg.runtime.rollout_workers  # every rollout worker's

    def final(result: Any) -> list[str]:
        # the schedule's wall time, workers' start to stop (a resumed run: this process's)
        steps_here, wall = result.env_steps - result.resumed_env_steps, result.wall_s
        tail = result.records[-max(1, len(result.records) // 10):]
        rets = [r["return_mean"] for r in tail if "return_mean" in r]
        lines = ["final mean episode return per agent (last 10% of iterations): "
                 f"{sum(rets) / max(len(rets), 1):.2f}"]
        for key in sorted({k for r in tail for k in r if k.startswith("task/")}):
            vals = [r[key] for r in tail if key in r]
            lines.append(f"{key}: {sum(vals) / len(vals):.3f}")
        resumed = (f" (resumed after {result.resumed_env_steps})"
                   if result.resumed_env_steps else "")
        lines.append(f"wall time: {wall:.1f} s for {steps_here} env steps{resumed}, "
                     f"{steps_here / wall:.0f} env steps/s")
        failed = sum(r.get("rollout/workers_failed", 0) for r in result.records)
        if failed:  # rollout workers lost for good, within the failure budget
            lines.append(f"failed rollouts: {failed} (rollout workers lost; see `errors` "
                         "in metrics.jsonl)")
        lines += reward_curves(result.records, run.agents)  # episode return per agent
        lines.append(f"metrics:     {out / 'metrics.jsonl'}")
        lines += [f"checkpoint:  {path}" for path in
                  sorted((out / "checkpoints" / "final").glob("*/model.safetensors"))]
        return lines

    return _RunKind(f"{env.id}, {len(run.agents)} agents, {len(run.layouts)} networks, "
                    f"{cfg.env_algorithm.name}, pipeline={cfg.pipeline.mode}, "
                    f"runtime={cfg.runtime.kind}, {envs} envs, {n_iter} iterations "
                    f"({n_iter * envs * cfg.train.rollout_steps} env steps)",
                    functools.partial(train_marl, run=run), "return",
                    lambda rec: rec.get("return_mean", 0.0),
                    lambda rec: f"{rec['env_steps_per_s']:.0f} steps/s", final)


def _train(args: argparse.Namespace) -> int:
    # start-up cost: each command loads only its own stack
    from flexmarl.orchestrator.checkpoint import find_checkpoints
    from flexmarl.orchestrator.joint import FailureBudgetExceeded, RunInterrupted
    from flexmarl.orchestrator.preflight import check_out_dir, check_resume_dir

    cfg = load_config(args.config, args.set)  # config errors surface before torch loads
    if args.system and cfg.env is not None:
        raise ConfigError(f"--system {args.system}: the simulator's systems are presets of "
                          f"task runs; {args.config} is an environment run (`env:`)")
    if args.system:  # a system preset's settings come first, the user's --set after them
        args.set = [*system_overrides(args.system), *args.set]
        cfg = load_config(args.config, args.set)
    if cfg.env is None and args.show_samples > cfg.logging.samples_per_agent:
        cfg = load_config(args.config,  # keep as many samples as are shown
                          [*args.set, f"logging.samples_per_agent={args.show_samples}"])
    console = Console(stderr=True)
    resume = Path(args.resume) if args.resume else None
    if resume is not None:
        check_resume_dir(resume)
    default_out = resume.parent if resume and resume.name == "checkpoints" else resume
    out = Path(args.out or default_out or cfg.out or Path("runs") / cfg.name)
    kind = _task_kind(cfg, out) if cfg.env is None else _env_kind(cfg, out)
    check_out_dir(out, "--out" if args.out else ("--resume" if default_out else
                                                 "out (the run's output folder)"))
    done = 0
    if resume is not None:  # no checkpoint there: say so now (train() verifies the files)
        name = find_checkpoints(resume).latest_name() or "gen-0"
        done = int(name.rsplit("-", 1)[-1] or 0)  # the resumed iterations are done
    console.print(f"[bold]flexmarl[/] training [cyan]{cfg.name}[/]: {kind.header} -> {out}")
    progress = Progress(
        TextColumn("[bold blue]iteration {task.completed}/{task.total}"), BarColumn(),
        TextColumn(f"{kind.progress} {{task.fields[figure]:.3f}}"),
        TextColumn("{task.fields[speed]}"), TimeElapsedColumn(), console=console,
        refresh_per_second=1)  # (rich's 10 a second: the driver's CPU, for a clock in s)
    with progress:
        bar = progress.add_task("train", total=cfg.train.iterations, figure=0.0, speed="",
                                completed=done)
        tail = SampleTail(out / "samples.jsonl")

        def on_iteration(record: dict) -> None:
            progress.update(bar, advance=1, figure=kind.figure(record),
                            speed=kind.speed(record), refresh=True)
            shown: dict[str, int] = {}
            for sample in tail.new():  # --show-samples: what each agent said, N per agent
                if shown.get(sample["agent"], 0) < args.show_samples:
                    shown[sample["agent"]] = shown.get(sample["agent"], 0) + 1
                    progress.console.print(format_sample(sample), markup=False,
                                           highlight=False)

        try:
            result = kind.train(cfg, out, on_iteration, resume=resume)
        except RunInterrupted as exc:  # SIGTERM / Ctrl-C, after the boundary's checkpoint
            progress.stop()
            print(f"interrupted: {exc}", file=sys.stderr)
            return 143
        except FailureBudgetExceeded as exc:
            progress.stop()
            print(f"error: run stopped by its failure budget: {exc}", file=sys.stderr)
            print(f"no final checkpoint was written; metrics: {out / 'metrics.jsonl'}",
                  file=sys.stderr)
            return 1
    for line in kind.final(result):
        print(line)
    print(f"next:        flexmarl doctor {out}   |   flexmarl report {out}")
    return 0


def _refuse_env_run(config: str, sets: list[str], command: str) -> None:
    """The simulator's systems, calibration and the pipeline bench measure task runs (their
    graph, replicas and trainers); an environment run is refused by its field, up front."""
    if load_config(config, sets).env is not None:
        raise ConfigError(f"{config}: env: `flexmarl {command}` measures task runs (`task:`); "
                          "an environment run is measured by `flexmarl train` (env steps/s "
                          "in metrics.jsonl) and benchmarks/mpe.py")


def _bench(args: argparse.Namespace) -> int:
    if not (args.what == "compare" and args.resimulate):
        _refuse_env_run(args.config, args.set, f"bench {args.what}")
    if args.what == "compare":
        # start-up cost: the simulator and the runtime load only for the command that runs
        from flexmarl.sim.calibration.compare import DEFAULT_SYSTEMS, compare, resimulate

        if args.resimulate:
            resimulate(args.config, profile=args.profile, load_model=args.load_model)
            return 0
        systems = [s for arg in args.systems or [] for s in arg.split(",") if s]
        compare(args.config, args.set, systems or DEFAULT_SYSTEMS, rounds=args.rounds,
                iterations=args.iterations, out=args.out, profile=args.profile, pin=args.pin)
        return 0
    # start-up cost: each command loads only its own stack
    from flexmarl.bench.pipeline import bench_pipeline

    bench_pipeline(args.config, args.set, rounds=args.rounds, out=args.out)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    if args.profile_local:
        # start-up cost: each command loads only its own stack
        from flexmarl.sim.calibration.calibrate import calibrate

        _refuse_env_run(args.workload, args.set, "simulate --profile-local")
        calibrate(args.workload, args.set, iterations=args.iterations or 5, out=args.out,
                  profile=args.profile)
        return 0
    # start-up cost: each command loads only its own stack
    from flexmarl.sim.simulate import simulate
    from flexmarl.sim.workload import WorkloadError

    try:
        simulate(args.workload, args.baseline or None, iterations=args.iterations,
                 out=args.out or Path("runs") / "sim" / Path(args.workload).stem,
                 pictures=not args.no_pictures)
    except (WorkloadError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return 0


def _serve_model(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"serve-model --port {args.port}: must be in 1..65535")
    if args.max_batch_seqs <= 0:
        raise ConfigError(f"serve-model --max-batch-seqs {args.max_batch_seqs}: must be >= 1")
    if not (Path(args.path) / "config.json").exists():
        raise ConfigError(f"serve-model: {args.path} is not a model folder (no config.json); "
                          "pass a checkpoint such as runs/<name>/checkpoints/final/<agent>")
    try:
        from flexmarl.serving.app import serve  # fastapi: the `serve` extra
    except ImportError as exc:
        raise ConfigError(f"serve-model: {exc.name} is not installed; pip install "
                          "'flexmarl[serve]'") from None
    # start-up cost: each command loads only its own stack
    from flexmarl.serving.agents import load_model_folder

    serve(load_model_folder(args.path, args.name, args.device), args.host, args.port,
          max_batch_seqs=args.max_batch_seqs)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    # start-up cost: each command loads only its own stack
    from flexmarl.cli.doctor import run_doctor

    return run_doctor(args.run_dir, as_json=args.json)


def _report(args: argparse.Namespace) -> int:
    # start-up cost: each command loads only its own stack
    from flexmarl.cli.report import write_report

    path = write_report(args.run_dir, args.out)
    print(f"report: {path}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    from flexmarl.runtime.ray.drain import drain  # the ray extra, only for this command

    reports = drain(args.address, args.node, timeout_s=args.timeout)
    if not reports:
        print(f"drain: Ray drains node {args.node}; no FlexMARL run reported moving work off "
              f"it within {args.timeout:.0f} s (none had work there, or none is running)")
        return 0
    for r in reports:
        moved = ", ".join(f"{m['worker']} (pool shrunk)" if m.get("retired") else
                          f"{m['worker']} -> node {str(m['to_node'])[:12]}" for m in r["moved"])
        print(f"drain: run {r['run']}: moved {moved or 'nothing'}")
        for why in r["failed"]:
            print(f"drain: run {r['run']}: could not move {why}")
    return 1 if any(r["failed"] for r in reports) else 0


def _serve(args: argparse.Namespace) -> int:
    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of an error too")
    parser = argparse.ArgumentParser(prog="flexmarl", description=__doc__, parents=[common],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add = sub.add_parser

    def add_parser(*a, **kw):  # every subcommand takes --debug too
        return _add(*a, parents=[common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]
    p = sub.add_parser("train", help="train the agents of a run config")
    p.add_argument("config", help="run config YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set pipeline.mode=sync")
    p.add_argument("--out", help="output folder (default runs/<name>, or the resumed run's)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR (a run folder or its checkpoints/) from LATEST")
    p.add_argument("--system", metavar="NAME",
                   help="run as one of the simulator's systems (e.g. sync-disaggregated, "
                        "flexmarl-sync; config/systems.py): its settings, then --set")
    p.add_argument("--show-samples", type=int, default=0, metavar="N",
                   help="print N sampled episodes per agent each iteration (prompt, answer, "
                        "reward, advantage; at most logging.samples_per_agent)")
    p.set_defaults(fn=_train)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    b.add_argument("what", choices=["pipeline", "compare"],
                   help="pipeline: sync vs async; compare: the simulator's systems as real runs "
                        "side by side, with the simulator's prediction for each")
    b.add_argument("config")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--out", default=None)
    b.add_argument("--systems", action="append", metavar="NAME[,NAME]",
                   help="compare: systems to run (default flexmarl, flexmarl-sync, "
                        "flexmarl-static-balance, sync-disaggregated)")
    b.add_argument("--iterations", type=int, default=None, help="compare: iterations per run")
    b.add_argument("--profile", default=None, metavar="FILE",
                   help="compare: reuse a profile.json instead of profiling the agents")
    b.add_argument("--pin", action="store_true",
                   help="compare: pin rollout and training workers to separate CPU halves")
    b.add_argument("--resimulate", action="store_true",
                   help="compare: CONFIG is a finished comparison's folder (its --out): "
                        "simulate its real runs again, with its profile or --profile")
    b.add_argument("--load-model", choices=["mean", "series"], default="mean",
                   help="compare --resimulate: the others' runnable work level over each run's "
                        "iterations (mean) or following their sampled load window by window "
                        "(series, where the comparison sampled it)")
    b.set_defaults(fn=_bench)
    m = sub.add_parser("simulate", help="the real orchestrator on a simulated cluster, with "
                                         "baselines side by side")
    m.add_argument("workload", help="workload YAML (see examples/sim/); with --profile-local, a "
                                    "run config (e.g. examples/relay_chain.yaml)")
    m.add_argument("--baseline", action="append", default=[],
                   help="system to compare (marti, marti-2025-05, mas-rl-like, "
                        "sync-disaggregated, one-step-off, flexmarl-sync, flexmarl-stage, "
                        "flexmarl-static-balance, flexmarl-static-alloc); repeatable")
    m.add_argument("--iterations", type=int, default=None)
    m.add_argument("--out", default=None)
    m.add_argument("--no-pictures", action="store_true")
    m.add_argument("--profile-local", action="store_true",
                   help="calibration: profile this machine for the run config, run it for real "
                        "(sync and async, --iterations, default 5) and simulate it; prints "
                        "measured vs simulated s/iteration")
    m.add_argument("--profile", metavar="JSON", help="with --profile-local: reuse this profile")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --profile-local: override a config field")
    m.set_defaults(fn=_simulate)
    s = sub.add_parser("serve-model", help="serve one model folder on the OpenAI-compatible "
                                            "endpoints of `flexmarl serve` (token ids, log-probs)")
    s.add_argument("path", help="model folder (config.json + model.safetensors)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--max-batch-seqs", type=int, default=32)
    s.add_argument("--name", help="the model name requests ask for (default: the folder's)")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    s.set_defaults(fn=_serve_model)
    d = sub.add_parser("doctor", help="read a run's metrics and name likely problems, with "
                                      "the remedy")
    d.add_argument("run_dir", help="a run folder (the --out of flexmarl train)")
    d.add_argument("--json", action="store_true", help="findings as JSON")
    d.set_defaults(fn=_doctor)
    r = sub.add_parser("report", help="an HTML page of a run: learning curves, busy fractions, "
                                      "a Gantt chart of the trace, plans, the config")
    r.add_argument("run_dir", help="a run folder (the --out of flexmarl train)")
    r.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    r.set_defaults(fn=_report)
    dr = sub.add_parser("drain", help="move the work of the runs on a Ray cluster off a node "
                                      "before it leaves (docs/ray.md)")
    dr.add_argument("address", help="the cluster's HOST:PORT (runtime.address)")
    dr.add_argument("node", help="the node's hex id (ray list nodes, or the run's placement)")
    dr.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for the runs to report (default 300)")
    dr.set_defaults(fn=_drain)

    add_serve_parser(sub).set_defaults(fn=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or bool(os.environ.get("FLEXMARL_DEBUG"))
    if debug:
        os.environ["FLEXMARL_DEBUG"] = "1"  # the run's asyncio handler and workers see it too
    try:
        return args.fn(args)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - not the user's fault: keep the traceback, say so
        stops = sys.modules.get("flexmarl.orchestrator.checkpointing")  # loaded by runs only
        if stops is not None and isinstance(exc, stops.RunInterrupted):
            # SIGTERM / Ctrl-C in any command that runs training (bench, simulate, ...), also
            # before a run's first iteration: a stop the user asked for, not a bug
            print(f"interrupted: {exc}", file=sys.stderr)
            return 143
        base = sys.modules.get("flexmarl.api.runtime")  # not imported for config errors
        if base is not None and isinstance(exc, base.WorkerError):
            # workers lost beyond runtime.max_worker_restarts (e.g. out-of-memory kills): the
            # reason is in the message
            if debug:
                traceback.print_exc()
            print(f"error: run failed: {exc}", file=sys.stderr)
            return 1
        traceback.print_exc()
        print("internal error: this is a bug in FlexMARL, not in your config; please report it "
              "with the traceback above", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
