"""The checkpoint coordinator: checkpoints at iteration boundaries, resume, stop requests.

`checkpoint.py` is the on-disk format (generations, manifests); this is when and what the
orchestrator saves: the position (iterations done, versions, records, the audit trail) and
the store's rows are taken synchronously at the boundary, the trainer states right after,
before any trainer may step again, and the files are written in a thread while the pipeline
goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from flexmarl.api.runtime import TrainPool
from flexmarl.config.schema import ConfigError, RunConfig
from flexmarl.graph.meg import GraphError
from flexmarl.orchestrator.checkpoint import TrainerState
from flexmarl.orchestrator.episodes import EpisodeRunner
from flexmarl.orchestrator.training import MicroBatchTrainer
from flexmarl.orchestrator.versions import Versions
from flexmarl.store.experience import ExperienceStore, Status
from flexmarl.telemetry.recorder import Telemetry


class SaveCheckpoint(Protocol):
    """The checkpoint writer (`checkpoint.CheckpointManager.save`): writes generation
    `completed` and returns where. Blocking: it runs in a thread while the pipeline goes on.
    `extra` (a driver's own files, `checkpoint.py`) is passed only when the snapshot has
    some."""

    def __call__(self, completed: int, position: dict[str, Any],
                 trainer_states: dict[str, TrainerState], rows: list[dict[str, Any]],
                 extra: dict[str, bytes] | None = None, /) -> Path | str: ...


# snapshot(completed) -> (position, rows, extra): what a boundary holds besides trainer states
Snapshot = Callable[[int], tuple[dict[str, Any], list[dict[str, Any]], dict[str, bytes]]]


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread. A second stop request abandons a checkpoint being
    written and the process exits at once: `asyncio.to_thread`'s executor would be joined at
    exit, finishing the write first. A generation is published by one atomic rename
    (`checkpoint.py`), so an abandoned one leaves only a `.tmp-*` folder, which the next save
    removes."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # abandoned
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: the run ended without this write
            pass

    threading.Thread(target=work, name="checkpoint-write", daemon=True).start()
    return await done


class RunInterrupted(RuntimeError):
    """SIGTERM / Ctrl-C: the run stopped at an iteration boundary (after a checkpoint, when
    checkpointing is configured)."""

    def __init__(self, message: str, checkpoint: str | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class BoundaryCheckpoints:
    """When and how a driver saves, whatever it drives (the LLM orchestrator, a classic
    environment run): a generation every `train.checkpoint_every` iterations and on a stop
    request, at an iteration boundary. `snapshot(completed)` gives what the boundary holds
    besides the trainer states: the position, the store's rows, the driver's extra files.

    `stop` is set when the run should end now (after the requested checkpoint, or at once);
    `step_allowed` is cleared while the trainer states of a boundary are being read."""

    def __init__(self, cfg: RunConfig, telemetry: Telemetry, train: TrainPool,
                 save: SaveCheckpoint | None, snapshot: Snapshot,
                 step_allowed: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.train = train
        self.save = save
        self.snapshot = snapshot
        self.last_checkpoint: str | None = None
        self.step_allowed = step_allowed if step_allowed is not None else asyncio.Event()
        self.step_allowed.set()
        self._writing: asyncio.Future | None = None
        self.stop_requests = 0
        self.stop = asyncio.Event()

    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: checkpoint at the next iteration boundary, then stop. A second
        request, or a run that cannot checkpoint, stops at once."""
        self.stop_requests += 1
        self.telemetry.fault("stop_requested", count=self.stop_requests)
        if self.stop_requests > 1 or self.save is None:
            self.stop.set()

    def due(self, k: int) -> bool:
        """Whether the boundary after iteration k takes a checkpoint."""
        every = self.cfg.train.checkpoint_every
        if self.save is None:
            return False
        return self.stop_requests > 0 or (every is not None and (k + 1) % every == 0)

    def capture(self, k: int, trainable: list[str]) -> None:
        """Checkpoint at the boundary after iteration k: the snapshot is taken now
        (synchronously), the trainer states next, before any trainer may step again, and the
        files are written in a thread while the run goes on."""
        position, rows, extra = self.snapshot(k + 1)
        self.step_allowed.clear()
        previous = self._writing
        save = self.save
        assert save is not None

        async def capture() -> None:
            try:
                if previous is not None:  # generations are written one after another
                    await previous
                states = dict(zip(trainable, await asyncio.gather(
                    *(self.train.get_state(a) for a in trainable)), strict=True))
                for agent, (_, meta) in states.items():
                    if int(meta["version"]) != k + 1:
                        raise RuntimeError(f"checkpoint after iteration {k}: trainer of "
                                           f"{agent!r} is at version {meta['version']}")
            finally:
                self.step_allowed.set()
            t0 = self.telemetry.now()
            args = (k + 1, position, states, rows, extra) if extra else (
                k + 1, position, states, rows)
            path = await _in_daemon_thread(save, *args)
            self.last_checkpoint = str(path)
            self.telemetry.fault("checkpoint", completed=k + 1, path=str(path),
                                 rows_in_flight=len(rows), save_s=self.telemetry.now() - t0)
            if self.stop_requests > 0:
                self.stop.set()

        self._writing = asyncio.ensure_future(capture())
        self._writing.add_done_callback(self._write_done)

    def _write_done(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self.telemetry.fault("checkpoint_failed", error=str(fut.exception()))
            self.stop.set()  # a failed save stops the run loudly (run() re-raises it)

    async def wait_writes(self) -> None:
        if self._writing is not None:
            await self._writing  # re-raises a failed save

    async def restore_trainers(self, trainable: list[str], resume: Any) -> None:
        """Resumed: the trainers get their states from the checkpoint."""
        if resume is not None:
            for agent in trainable:
                await self.train.set_state(agent, resume.trainer_states[agent])

    async def run_until_stop(self, drive: Awaitable[None], done: Callable[[], int]) -> None:
        """Run `drive` (the schedule) until it ends or a stop is due: then the checkpoint, if
        one was requested, is written, and `RunInterrupted` says where to resume from."""
        main = asyncio.ensure_future(drive)
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            main.cancel()
            raise
        finally:
            stop.cancel()
        if main.done():
            main.result()
            await self.wait_writes()
            return
        main.cancel()  # stop requested: the checkpoint (if any) is written, end here
        await asyncio.gather(main, return_exceptions=True)
        abandoned = ""
        if self.stop_requests > 1 and self._writing is not None and not self._writing.done():
            self._writing.cancel()  # a second request: at once, without the write in flight
            await asyncio.gather(self._writing, return_exceptions=True)
            abandoned = "; a second stop abandoned the checkpoint being written"
        else:
            await self.wait_writes()
        last = self.last_checkpoint
        where = f"; resume from {last}" if last else ""
        raise RunInterrupted(f"stopped after {done()} iterations{abandoned}{where}", last)


class CheckpointCoordinator(BoundaryCheckpoints):
    """The LLM orchestrator's checkpoints: its position (versions, records, the rows each
    trainer consumed, the audit, evictions) and the store's rows not yet trained on; restores
    that position from `resume` (a `checkpoint.Checkpoint`)."""

    def __init__(self, cfg: RunConfig, telemetry: Telemetry, trainer: MicroBatchTrainer,
                 records: list[dict[str, Any]], agents: list[str], save: SaveCheckpoint | None,
                 resume: Any) -> None:
        super().__init__(cfg, telemetry, trainer.train, save,
                         lambda done: (self.position(done), trainer.store.snapshot(done), {}),
                         trainer.step_allowed)
        # a position is the training driver's and its parts': their store, versions, episodes
        self.trainer = trainer
        self.store: ExperienceStore = trainer.store
        self.versions: Versions = trainer.versions
        self.episodes: EpisodeRunner = trainer.episodes
        self.records = records
        self.agents = agents
        self.resume = resume
        if self.versions.staleness:
            if resume is not None:
                raise ConfigError(f"resume {getattr(resume, 'path', resume)}: checkpoints are "
                                  "not supported with pipeline.mode=one_step_off")
            # no boundary has a resumable state (iteration k+1 is in flight on version k
            # weights no trainer holds): a stop request stops at once, without a checkpoint
            self.save = None
        if resume is not None:
            self._load_position(resume)

    def position(self, completed: int) -> dict[str, Any]:
        """What a checkpoint after `completed` iterations records besides states and rows."""
        return {
            "completed": completed,
            "versions": dict(self.versions.current),
            "records": list(self.records),
            "consumed": {a: {str(k): list(ids) for k, ids in per.items() if k < completed}
                         for a, per in self.trainer.consumed.items()},
            "audit": {a: [list(t) for t in trail if t[2] < completed]
                      for a, trail in self.trainer.audit.items()},
            "evicted": {a: dict(c) for a, c in self.store.evicted.items()},
            "skipped_steps": self.trainer.skipped_steps,
            "seed": self.cfg.seed,
            "agents": self.agents,
        }

    def _load_position(self, ckpt: Any) -> None:
        pos = ckpt.position
        if sorted(pos["agents"]) != sorted(self.agents):
            raise GraphError(f"resume {ckpt.path}: the checkpoint has agents {pos['agents']}, "
                             f"the config has {self.agents}")
        start = int(pos["completed"])
        self.episodes.start_iteration = start
        self.versions.current.update({a: int(v) for a, v in pos["versions"].items()})
        self.records[:] = list(pos["records"])
        for rec in self.records:  # normalize: agent_previous baselines of past iterations
            stats = {a: (float(rec[f"agent/{a}/reward_mean"]), float(rec[f"agent/{a}/reward_std"]))
                     for a in self.agents if f"agent/{a}/reward_std" in rec}
            stats |= {key[:-len("/reward_std")]: (float(rec[key[:-4] + "_mean"]), float(v))
                      for key, v in rec.items()  # an agent acting at several nodes: per node
                      if key.startswith("node/") and key.endswith("/reward_std")}
            self.episodes.resumed_stats[int(rec["iteration"])] = stats
        for agent, per in pos["consumed"].items():
            for k, ids in per.items():
                self.trainer.consumed[agent][int(k)] = list(ids)
        for agent, trail in pos["audit"].items():
            self.trainer.audit[agent] = [(sid, int(v), int(step)) for sid, v, step in trail]
        for agent, counts in pos["evicted"].items():
            self.store.evicted[agent].update(counts)
        self.trainer.skipped_steps = int(pos.get("skipped_steps", 0))
        # Episodes of the next iteration that had finished (all rows rewarded, payload kept)
        # are restored instead of re-run; the rest are generated again (same keyed sampling).
        by_episode: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for d in ckpt.rows:
            if d["iteration"] == start:
                index = int(d["input_id"].split("-")[1])
                by_episode[(index, int(d["trajectory_id"]))].append(d)
        for key, rows in by_episode.items():
            if rows and all(d["status"] in (Status.REWARDED.value, Status.READY.value)
                            and "logprobs" in d["arrays"] for d in rows):
                self.episodes.restored[key] = rows
