"""`flexmarl serve RUN_DIR`: the arguments (no heavy imports here: the parser is built on every
`flexmarl` invocation)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from flexmarl.config.schema import ConfigError

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """Seconds from `900`, `90s`, `15m`, `1.5h` or `1d` (an argparse type)."""
    t = text.strip().lower()
    scale = DURATION_UNITS.get(t[-1:], None)
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: seconds or a number with s, m, h or d "
            "(e.g. 15m)") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite duration")
    return value


def add_serve_parser(sub) -> argparse.ArgumentParser:  # noqa: ANN001 - argparse's subparsers
    s = sub.add_parser("serve", help="serve every agent of a run on one OpenAI-compatible "
                                     "server (chat, completions, streaming, episodes)")
    s.add_argument("run_dir", help="run folder (`flexmarl train --out`): config.yaml and "
                                   "checkpoints/")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 (default: "
                        "$FLEXMARL_API_KEY if set)")
    s.add_argument("--tenants", default=None, metavar="FILE",
                   help="YAML file of tenants: each with its own key (api_key or api_key_env), "
                        "requests_per_minute / requests_per_day, admin, train (docs/serving.md); "
                        "not with --api-key")
    s.add_argument("--agent", action="append", default=None,
                   help="serve only this agent (repeatable; default every agent of the run)")
    s.add_argument("--device", default="auto", help="auto (cuda when visible), cpu, cuda:N")
    s.add_argument("--max-batch-seqs", type=int, default=None,
                   help="sequences per continuous batch (default rollout.max_batch_seqs)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=8192)
    s.add_argument("--max-tokens", type=int, default=4096,
                   help="the largest max_tokens a request may ask for")
    s.add_argument("--max-pending", type=int, default=1024,
                   help="requests queued or running before new ones get HTTP 429")
    s.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="poll the run folder for newer weights and hot-reload them")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads on the CPU (default runtime.torch_threads of the run)")
    s.add_argument("--capture", default=None, metavar="DB",
                   help="record every served interaction durably (SQLite, WAL, fsync) before "
                        "answering; enables /v1/feedback")
    s.add_argument("--drift-window", type=int, default=200, metavar="N",
                   help="with --capture: feedback rewards per rolling window of the drift "
                        "monitor, per agent and per team (default 200; 0: off)")
    s.add_argument("--drift-drop", type=float, default=0.25, metavar="FRACTION",
                   help="a rolling mean this far below its peak (relative) is drift: alert, "
                        "and roll back to the peak's versions (default 0.25)")
    d = s.add_argument_group("triple-buffer deployment and online learning (docs/serving.md)")
    d.add_argument("--deploy", action="store_true",
                   help="shadow / canary per agent: canaries through /v1/admin/canary, events in "
                        "RUN_DIR/serving/events.jsonl (implied by --learn)")
    d.add_argument("--learn", action="append", default=None, metavar="AGENT",
                   help="train this agent online from captured, rewarded interactions "
                        "(repeatable; needs --capture)")
    d.add_argument("--canary-share", type=float, default=0.05,
                   help="share of new requests a canary gets (default 0.05)")
    d.add_argument("--promote-margin", type=float, default=0.0,
                   help="promote a canary when its score >= the shadow's + this (default 0)")
    add_online_update_options(d)
    d.add_argument("--canary-min-feedback", type=int, default=20,
                   help="feedback rewards on canary responses before it is scored (default 20)")
    d.add_argument("--canary-max-s", type=float, default=300.0,
                   help="score a canary after this long whatever the feedback (default 300)")
    d.add_argument("--heldout", type=int, default=256,
                   help="held-out task inputs a version is scored on (0: feedback only)")
    d.add_argument("--feedback-weight", type=float, default=0.5,
                   help="weight of traffic feedback in a version's score (default 0.5)")
    d.add_argument("--snapshot-url", default=None, metavar="URL",
                   help="where training snapshots go, through fsspec: a folder (default "
                        "RUN_DIR/serving), file://..., memory://..., s3://... (with s3fs)")
    add_serve_learn_parser(sub)
    return s


def add_online_update_options(group) -> None:  # noqa: ANN001 - a parser or an argument group
    """The online learner's settings: `serve --learn` and `serve-learn` take the same ones."""
    group.add_argument("--kl-max", type=float, default=0.5,
                       help="undo an online update whose KL to the shadow exceeds this "
                            "(nats per token, default 0.5)")
    group.add_argument("--online-algorithm", choices=["auto", "grpo", "ppo"], default="auto",
                       help="the online loss: GRPO (the batch is the group) or PPO (a critic, GAE; "
                            "the clipped ratio to the served log-probs); auto: the agent's "
                            "algorithm (default)")
    group.add_argument("--is-max", type=float, default=2.0,
                       help="truncation of the off-policy importance weights (default 2)")
    group.add_argument("--online-lr", type=float, default=None,
                       help="learning rate of online updates (default: the agent's optim.lr)")
    group.add_argument("--online-batch", type=int, default=64,
                       help="captured rows per online update (default 64)")
    group.add_argument("--update-every", type=duration, default=0.0, metavar="DURATION",
                       help="at most one online update per this long: seconds or 30s / 15m / 1h "
                            "(default 0: whenever a batch is ready; the enterprise document's "
                            "cadence is 15m)")
    group.add_argument("--canary-every", type=int, default=10,
                       help="applied online updates between canary candidates (default 10)")
    group.add_argument("--snapshot-every", type=duration, default=300.0, metavar="DURATION",
                       help="snapshot the training policy's state this often: seconds or 30s / "
                            "5m / 1h (default 300)")


def add_serve_learn_parser(sub) -> argparse.ArgumentParser:  # noqa: ANN001 - argparse's
    """`flexmarl serve-learn`: the online trainer in its own process (trainer_process.py)."""
    t = sub.add_parser("serve-learn", help="train a served agent online in its own process, "
                                           "from the server's capture store, publishing "
                                           "canaries to it (docs/serving.md)")
    t.add_argument("run_dir", help="the run folder the server serves")
    t.add_argument("--capture", required=True, metavar="DB",
                   help="the server's capture store (its --capture)")
    t.add_argument("--agent", required=True, help="the agent to train")
    t.add_argument("--server", required=True, metavar="URL",
                   help="the server, e.g. http://127.0.0.1:8000 (started with --deploy)")
    t.add_argument("--api-key", default=None,
                   help="an admin key of the server (default $FLEXMARL_API_KEY)")
    add_online_update_options(t)
    t.add_argument("--snapshot-url", default=None, metavar="URL",
                   help="fsspec URL of the trainer's snapshots (default RUN_DIR/serving/trainer)")
    t.add_argument("--threads", type=int, default=None, help="torch threads of the trainer")
    t.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the trainer as a Ray actor: on a private local cluster, or on "
                        "the cluster at ADDRESS (on the server's node: the capture store is "
                        "its local file)")
    t.set_defaults(fn=run_serve_learn)
    return t


def run_serve_learn(args: argparse.Namespace) -> int:

    if not (Path(args.run_dir) / "config.yaml").is_file():
        raise ConfigError(f"serve-learn: {args.run_dir} is not a run folder (no config.yaml)")
    if not Path(args.capture).is_file():
        raise ConfigError(f"serve-learn: --capture {args.capture}: no such file (start the "
                          "server with --capture first)")
    if args.online_batch < 2 or args.canary_every < 1 or args.kl_max <= 0:
        raise ConfigError("serve-learn: --online-batch must be >= 2, --canary-every >= 1, "
                          "--kl-max > 0")
    import torch  # start-up cost: torch and the learner load only for serve-learn

    # start-up cost: torch and the learner load only for serve-learn
    from flexmarl.serving.trainer_process import OnlineTrainer, TrainerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainerConfig(batch=args.online_batch, canary_every=args.canary_every,
                        kl_max=args.kl_max, is_max=args.is_max, lr=args.online_lr,
                        update_every_s=args.update_every, snapshot_every_s=args.snapshot_every,
                        algorithm=args.online_algorithm)
    api_key = args.api_key or os.environ.get("FLEXMARL_API_KEY")
    if args.ray is not None:
        return _serve_learn_on_ray(args, cfg, api_key)
    OnlineTrainer(args.run_dir, args.capture, args.agent, args.server, cfg, args.snapshot_url,
                  api_key).run_forever()
    return 0


def _serve_learn_on_ray(args: argparse.Namespace, cfg: Any, api_key: str | None) -> int:
    """The online trainer as a Ray actor (trainer_actor.py) until Ctrl-C."""
    import ray  # the Ray extra, imported only for --ray

    # start-up cost: the session and the learner's actor load only for --ray
    from flexmarl.runtime.ray.session import RayRuntimeError, RaySession
    from flexmarl.serving.trainer_actor import start_trainer_actor

    session = RaySession(None if args.ray == "local" else args.ray)
    try:
        session.start()
    except RayRuntimeError as exc:  # it names runtime.address: say which flag it was
        raise ConfigError(f"serve-learn: --ray {args.ray}: "
                          f"{str(exc).split(': ', 1)[-1]}") from None
    try:
        actor = start_trainer_actor(args.run_dir, args.capture, args.agent, args.server, cfg,
                                    args.snapshot_url, api_key, args.threads)
        info = ray.get(actor.status.remote())
        print(f"online trainer of {args.agent} in Ray actor (pid {info['pid']}, node "
              f"{info['node'][:12]}) -> {args.server}", flush=True)
        try:
            ray.get(actor.run.remote())
        except KeyboardInterrupt:
            ray.get(actor.stop.remote())
    finally:
        session.stop()
    return 0


def deploy_config(args: argparse.Namespace):  # noqa: ANN201 - DeployConfig, imported lazily
    """The deployment's settings from the flags (None when neither --deploy nor --learn)."""

    if not args.deploy and not args.learn:
        return None
    if args.learn and not args.capture:
        raise ConfigError("serve: --learn trains on captured interactions: add --capture DB")
    # start-up cost: the server's stack (torch, fastapi) loads only for the command that runs
    from flexmarl.serving.deploy import DeployConfig

    return DeployConfig(
        learn=list(args.learn or []), canary_share=args.canary_share,
        margin=args.promote_margin, kl_max=args.kl_max, is_max=args.is_max, lr=args.online_lr,
        batch=args.online_batch, update_every_s=args.update_every,
        canary_every=args.canary_every,
        canary_min_feedback=args.canary_min_feedback, canary_max_s=args.canary_max_s,
        heldout=args.heldout, feedback_weight=args.feedback_weight,
        snapshot_every_s=args.snapshot_every, snapshot_url=args.snapshot_url,
        online_algorithm=args.online_algorithm).validate()


def run_serve(args: argparse.Namespace) -> int:

    rd = Path(args.run_dir)
    if not (rd / "config.yaml").is_file():
        raise ConfigError(f"serve: {rd} is not a run folder (no config.yaml); pass the folder "
                          "`flexmarl train --out` wrote, e.g. runs/demo (to serve one model "
                          "folder, use `flexmarl serve-model`)")
    for name in ("max_body_bytes", "max_prompt_tokens", "max_tokens", "max_pending"):
        if getattr(args, name) < 1:
            raise ConfigError(f"serve: --{name.replace('_', '-')} must be >= 1")
    if args.watch is not None and args.watch <= 0:
        raise ConfigError("serve: --watch must be > 0 seconds")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"serve: {exc.name} is not installed; pip install "
                          "'flexmarl[serve]'") from None
    api_key = args.api_key or os.environ.get("FLEXMARL_API_KEY")
    tenants = None
    if args.tenants is not None:
        if args.api_key:
            raise ConfigError("serve: --tenants and --api-key together: each tenant's key is "
                              "in the tenants file; drop --api-key")
        # start-up cost: the server's stack (torch, fastapi) loads only for the command that runs
        from flexmarl.serving.tenants import load_tenants

        tenants = load_tenants(args.tenants)
        api_key = None  # $FLEXMARL_API_KEY is not a tenant: the file names every key
        if args.learn and not tenants.trainers:
            raise ConfigError(f"serve: --learn with {args.tenants}: no tenant has train: true, "
                              "so no traffic may train the online policy")
    deploy = deploy_config(args)
    if args.drift_window < 0:
        raise ConfigError("serve: --drift-window must be >= 0 (0: off)")
    if not 0 < args.drift_drop < 1:
        raise ConfigError("serve: --drift-drop must be in (0, 1)")
    # start-up cost: the server's stack (torch, fastapi) loads only for the command that runs
    from flexmarl.serving.drift import DriftConfig

    drift = DriftConfig(window=args.drift_window, drop=args.drift_drop)
    # start-up cost: the server's stack (torch, fastapi) loads only for the command that runs
    from flexmarl.serving.app import serve
    from flexmarl.serving.protocol import Limits

    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens, max_pending=args.max_pending)
    serve(rd, args.host, args.port, api_key=api_key,
          device=args.device, limits=limits, watch_s=args.watch, agents=args.agent,
          max_batch_seqs=args.max_batch_seqs, capture=args.capture, torch_threads=args.threads,
          deploy=deploy, tenants=tenants, drift=drift)
    return 0
