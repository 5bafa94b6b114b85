"""One training run end to end: config -> task -> runtime -> orchestrator -> outputs on disk."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from flexmarl.api.runtime import Runtime
from flexmarl.config.schema import RunConfig
from flexmarl.graph import contracts
from flexmarl.graph.meg import GraphError
from flexmarl.graph.task import Task, load_task
from flexmarl.orchestrator.checkpoint import Checkpoint, CheckpointManager, find_checkpoints
from flexmarl.orchestrator.checkpointing import RunInterrupted
from flexmarl.orchestrator.joint import JointOrchestrator
from flexmarl.policy.device import check_slots
from flexmarl.policy.memory import check_memory
from flexmarl.policy.model import check_shapes, checkpoint_shapes, skeleton
from flexmarl.runtime import heap
from flexmarl.runtime.local.runtime import LocalRuntime
from flexmarl.store.experience import Status
from flexmarl.telemetry.gpu import GpuMonitor
from flexmarl.telemetry.loggers import check_installed, make_loggers
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.telemetry.train_stats import SlotStatsSource
from flexmarl.training import lora


class HostedResult(Protocol):
    """What `host_run` reads of a finished run for OUT/summary.json."""

    records: list[dict[str, Any]]
    placement: dict[str, Any]
    faults: dict[str, Any] | None

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The driver's own summary fields (the host adds iterations, wall_s, placement,
        faults)."""
        ...


R = TypeVar("R", bound=HostedResult)


@dataclass
class RunResult:
    out_dir: Path
    records: list[dict[str, Any]]
    checkpoints: dict[str, Path]
    consumed: dict[str, dict[int, list[str]]]
    audit: dict[str, list[tuple[str, int, int]]]
    store_stats: dict[str, dict[str, int]]
    placement: dict[str, Any]
    wall_s: float
    faults: dict[str, Any] | None = None

    @property
    def final_success(self) -> float:
        return self.records[-1]["task/success_rate"] if self.records else 0.0

    def summary(self, wall_s: float) -> dict[str, Any]:
        self.wall_s = wall_s
        return {"final_success_rate": self.final_success,
                "checkpoints": {a: str(p) for a, p in self.checkpoints.items()}}


def prepare(cfg: RunConfig) -> Task:
    """Build and validate everything that can be checked before any worker starts."""
    task = load_task(cfg.task_config.builder, cfg.task_config.options, cfg.agents)
    task.resolve_networks(cfg.agents, f"task.builder {cfg.task_config.builder}")
    task.graph.validate(cfg.agents.keys())
    used = set(task.graph.agents)
    for agent in cfg.agents:
        if agent not in used:
            raise GraphError(f"agents.{agent}: configured, but no node of the graph uses it")
    contracts.dry_run(task, cfg.task_config.builder, cfg.agents)  # user functions' values
    check_models(cfg, task)
    check_installed(cfg.logging.backends)
    check_memory(cfg, task.vocab_size)  # an estimate, before any model is built
    if cfg.runtime.kind != "sim":  # training slots of K ranks: devices, processes, backend
        trainable = sum(a.trainable for a in cfg.agents.values())
        check_slots(cfg.runtime, cfg.runtime.train_slot_sizes(trainable))
    return task


def check_models(cfg: RunConfig, task: Task) -> None:
    """LoRA targets and checkpoint shapes against a meta-device model: no weights loaded."""

    for agent, acfg in cfg.agents.items():
        if acfg.lora is None and acfg.model.checkpoint is None:
            continue
        model = skeleton(agent, acfg.model, task.vocab_size, task.max_seq_len)
        if acfg.lora is not None:
            lora.check_targets(agent, model, acfg.lora)
        if acfg.model.checkpoint:
            shapes = checkpoint_shapes(agent, acfg.model.checkpoint)
            check_shapes(agent, acfg.model.checkpoint, shapes, model)


def quiet_unretrieved(loop: asyncio.AbstractEventLoop, telemetry: Telemetry) -> None:
    """Futures that failed after the run already had its error (a lost worker's pending calls)
    are recorded as `unretrieved_error` events in metrics.jsonl instead of printing asyncio's
    traceback wall; with FLEXMARL_DEBUG set, asyncio prints them as usual."""

    if os.environ.get("FLEXMARL_DEBUG"):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message", "").endswith("never retrieved") and exc is not None:
            telemetry.fault("unretrieved_error", error=f"{type(exc).__name__}: {exc}")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def make_runtime(cfg: RunConfig, task: Task, telemetry: Telemetry) -> Runtime:
    if cfg.runtime.kind == "local":
        return LocalRuntime(cfg, task.vocab_size, task.max_seq_len, telemetry)
    if cfg.runtime.kind == "ray":
        from flexmarl.runtime.ray.runtime import RayRuntime  # optional: ray (the ray extra)

        return RayRuntime(cfg, task.vocab_size, task.max_seq_len, telemetry)
    raise ValueError(f"runtime.kind: unsupported runtime {cfg.runtime.kind!r}")


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
    resume: str | Path | None = None,
    on_runtime: Callable[[Any], None] | None = None,
) -> RunResult:
    """Train; with `resume` (a run folder or its checkpoints/), continue from its LATEST
    generation. `on_runtime(runtime)` is called once the workers run (chaos tests, benches)."""
    out = Path(out_dir)
    task = prepare(cfg)
    ckpt: Checkpoint | None = find_checkpoints(resume).load() if resume is not None else None

    async def body(telemetry: Telemetry, stops: StopRequests) -> RunResult:
        return await _run(cfg, task, telemetry, stops, out, on_iteration, ckpt, on_runtime)

    return host_run(cfg, out, ckpt, body)


class StopRequests:
    """SIGTERM / Ctrl-C during a hosted run: routed to the driver's `request_stop` (a
    checkpoint at the next iteration boundary, then stop; a second request stops at once)
    once the driver has one; before that (workers starting) the run stops at once."""

    def __init__(self) -> None:
        self.body: asyncio.Future | None = None  # the hosted driver's task
        self.handler: Callable[[], None] | None = None
        self.early = False
        # the signals routed here and the loop that catches them (`_hosted`)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals: list[int] = []

    def __call__(self) -> None:
        if self.handler is not None:
            self.handler()
        else:
            self.early = True
            if self.body is not None:
                self.body.cancel()

    def route(self, handler: Callable[[], None]) -> None:
        """Requests go to `handler` from now on. Called once the runtime runs, it also
        takes the signals back: starting a runtime may have replaced their handlers (`ray.init`
        installs a SIGTERM handler in the driver that exits at once, with no checkpoint)."""
        self.handler = handler
        if self.loop is not None:
            for sig in self.signals:
                self.loop.add_signal_handler(sig, self)


def host_run(cfg: Any, out: Path | None, resume: Checkpoint | None,
             body: Callable[[Telemetry, StopRequests], Awaitable[R]]) -> R:
    """What every run does around its driver, an LLM run's orchestrator or an environment
    run's alike: OUT/config.yaml, the telemetry and its logging backends, metrics.jsonl
    restarted from a resumed checkpoint's records, the event loop, SIGTERM / Ctrl-C (routed
    to the driver by `StopRequests`), OUT/summary.json (`status: failed` with the error when
    the body raises: doctor and report read it), the trace. `out` None (tests, benches): no
    files, the records in memory only."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"),
                                                        sort_keys=False))
    telemetry = Telemetry(out, loggers=make_loggers(cfg, out) if out is not None else None,
                          log_every=cfg.train.log_every, last_iteration=cfg.train.iterations - 1)
    if resume is not None:  # metrics.jsonl restarts from the checkpoint's records
        for record in resume.position["records"]:
            telemetry.log(record)
        telemetry.fault("resumed", checkpoint=str(resume.path), completed=resume.completed,
                        rows_restored=len(resume.rows))
    started = time.time()
    status = "failed"
    try:
        with heap.settled():  # the driver's event loop: no full walks of torch's heap
            result = asyncio.run(_hosted(body, telemetry))
    except BaseException as exc:  # a failed run says so on disk (doctor, report read it)
        if out is not None:
            (out / "summary.json").write_text(json.dumps({
                "status": "failed", "error_type": type(exc).__name__, "error": str(exc),
                "first_error": getattr(exc, "first_error", None),
                "wall_s": time.time() - started}, indent=2))
        raise
    else:
        status = "completed"
    finally:
        if out is not None:
            telemetry.write_trace(out / "trace.json")
        telemetry.close(status)
    wall_s = time.time() - started
    done = {"iterations": len(result.records), "wall_s": wall_s,
            **result.summary(wall_s), "placement": result.placement, "faults": result.faults}
    if out is not None:
        (out / "summary.json").write_text(json.dumps({"status": "completed", **done}, indent=2))
    return result


async def _hosted(body: Callable[[Telemetry, StopRequests], Awaitable[R]],
                  telemetry: Telemetry) -> R:
    loop = asyncio.get_running_loop()
    quiet_unretrieved(loop, telemetry)
    stops = StopRequests()
    task = stops.body = asyncio.ensure_future(body(telemetry, stops))
    handled = stops.signals
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stops)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    stops.loop = loop
    try:
        return await task
    except asyncio.CancelledError:
        if not stops.early:
            raise
        raise RunInterrupted("stopped before the first iteration", None) from None
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _run(cfg, task, telemetry, stops: StopRequests, out: Path, on_iteration, ckpt=None,
               on_runtime=None) -> RunResult:
    runtime = make_runtime(cfg, task, telemetry)
    await runtime.start()
    try:
        telemetry.event("placement", **runtime.placement())
        manager = CheckpointManager(out / "checkpoints", cfg.train.keep_checkpoints)
        orch = JointOrchestrator(cfg, task, runtime.rollout, runtime.train, telemetry, on_iteration,
                                 save_checkpoint=manager.save, resume=ckpt)
        stops.route(orch.request_stop)
        tables = orch.store.tables  # rows the store still holds (doctor: a growing store)

        orch.metric_sources.append(lambda: {"store/rows_held": sum(
            t.count(st) for t in tables.values() for st in Status)})
        slots = SlotStatsSource.for_pool(runtime.train, orch.trainable)
        if slots is not None:
            orch.metric_sources.append(slots.collect)
        monitor = GpuMonitor.from_nvml(runtime.pool_devices())
        if monitor.enabled:
            orch.metric_sources.append(monitor.start().collect)
        if on_runtime is not None:
            on_runtime(runtime)
        try:
            records = await orch.run()
        finally:
            monitor.stop()
        checkpoints = {}
        for agent in orch.trainable:
            path = out / "checkpoints" / "final" / agent
            checkpoints[agent] = Path(await runtime.train.save(agent, str(path)))
        return RunResult(out, records, checkpoints, orch.consumed, orch.audit, orch.store.stats(),
                         runtime.placement(), 0.0, runtime.fault_counts())
    finally:
        await runtime.stop()
