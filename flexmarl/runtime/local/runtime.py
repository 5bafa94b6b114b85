"""The local runtime: the embedded default. Worker processes on this machine, no services.

The rollout pool and the training pool are separate sets of processes (sized by
`runtime.rollout_workers` / `runtime.train_workers`), each with its own torch thread count.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import fcntl
import itertools
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch.distributed as dist

from flexmarl.api.runtime import (
    NullSink,
    RolloutPool,
    Runtime,
    RuntimeSink,
    SpanSink,
    Unsupported,
    Weights,
    WorkerError,
    WorkerLost,
    load_latest,
)
from flexmarl.config.schema import RunConfig
from flexmarl.planning.planner import Plan, bind_slots
from flexmarl.policy.device import (
    Placement,
    mps_active,
    plan_placements,
    rollout_nice,
    slot_placements,
)
from flexmarl.policy.memory import memory_hints
from flexmarl.policy.model import approx_params
from flexmarl.rollout.backends.openai import OpenAIBackend
from flexmarl.rollout.balancer import Balancer
from flexmarl.runtime.local.publication import PublishedRef, Publisher
from flexmarl.runtime.local.turns import AgentTurns, time_shared
from flexmarl.runtime.local.workers import (
    HEARTBEAT,
    BeatingPipe,
    WorkerSpec,
    rollout_worker_main,
    train_worker_main,
)
from flexmarl.training.host import SlotPool
from flexmarl.types import GenerationRequest, GenerationResult

_GENERATIONS = itertools.count()


class RunTempFolder(tempfile.TemporaryDirectory):
    """A run's private temporary folder, removed at `stop`, holding a lock (`.lock`, flock)
    for as long as its run lives. A driver killed with SIGKILL never removes its own, and one
    in /dev/shm holds memory until the machine restarts: a new run sweeps the folders of its
    prefix whose lock nobody holds (the kernel frees a dead process's locks; pids would not
    do, another container may share the folder)."""

    def __init__(self, prefix: str, where: str | None = None) -> None:
        base = where if where is not None else tempfile.gettempdir()
        with contextlib.suppress(OSError):
            for entry in os.scandir(base):
                if entry.name.startswith(prefix) and entry.is_dir() and _unlocked(entry.path):
                    shutil.rmtree(entry.path, ignore_errors=True)
        super().__init__(prefix=prefix, dir=where)
        self._lock = open(os.path.join(self.name, ".lock"), "w")  # noqa: SIM115 - held
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def cleanup(self) -> None:
        self._lock.close()
        super().cleanup()


def _unlocked(folder: str) -> bool:
    """Whether `folder`'s run is gone: its `.lock` exists and nobody holds it."""
    try:
        with open(os.path.join(folder, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # no lock file (being made, or not ours), or held
        return False
    return True


class Launcher(Protocol):
    """Where a worker main runs: `launch` gives the parent's end of its pipe (`send`, `recv`)
    and a process-like handle (`start`, `is_alive`, `kill`, `join`, `pid`, `exitcode`), not
    started yet. Local: a spawned process; Ray: an actor (`runtime.ray.transport`)."""

    def launch(self, pool: str, index: int, target: Any, spec: Any) -> tuple[Any, Any]: ...


class ProcessLauncher(Launcher):
    """A spawned process on this machine with a duplex pipe."""

    def launch(self, pool: str, index: int, target: Any, spec: Any) -> tuple[Any, Any]:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        beat = ctx.Value("d", time.monotonic(), lock=False)  # the worker's heartbeat clock
        process = ctx.Process(target=target, args=(BeatingPipe(child, beat), spec),
                              name=f"flexmarl-{pool}-{index}", daemon=True)
        process.beat = beat  # type: ignore[attr-defined]
        return conn, process


class WorkerProxy:
    """Parent side of one worker: futures by message id, a reader thread per pipe."""

    # named in the loss reason of an out-of-memory kill (set by the runtime)
    memory_hint: str = ""

    def __init__(self, pool: str, index: int, target: Any, spec: Any, sink: SpanSink,
                 launcher: Launcher | None = None):
        """`target(conn, spec)` is the worker's main (`spec`: a `WorkerSpec` for the pools'
        workers, the calibration's echo workers take their own payload); `launcher`: where it
        runs (default: a local process)."""
        self.pool, self.index, self.sink = pool, index, sink
        self.target, self.spec = target, spec
        self.launcher = launcher or ProcessLauncher()
        self.conn, self.process = self.launcher.launch(pool, index, target, spec)
        self._ids = itertools.count()
        # distinct for every process, a restarted one included (collective publication keys
        # its pair groups by both ends' generations)
        self.generation = next(_GENERATIONS)
        self._futures: dict[int, asyncio.Future] = {}
        # calls that wait on another worker (a collective publication's send): bounded by
        # their own timeout, left out of the progress check (`outstanding`)
        self._unwatched: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._outbox: list[tuple] = []
        # Sends go through a queue and a sender thread: a frozen worker that stops reading
        # fills its pipe, and a blocking send must never stall the event loop (the heartbeat
        # monitor runs there).
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self.outstanding_tokens = 0
        self.resident: dict[str, Any] = {}  # a replica's models and their memory, from "ready"
        self.alive = False
        self.stopping = False
        self.last_beat = time.monotonic()  # any message counts as a heartbeat
        self.last_progress = time.monotonic()  # the last answer, or the first call since idle
        self.lost_reason: str | None = None
        self.lost_in_flight = 0
        self.on_death: Callable[[WorkerProxy], None] | None = None

    def fresh(self) -> WorkerProxy:
        """A new worker in this one's place (the supervisor's restart), not started yet."""
        new = WorkerProxy(self.pool, self.index, self.target, self.spec, self.sink,
                          self.launcher)
        new.memory_hint = self.memory_hint
        return new

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.process.start()
        self.alive = True
        threading.Thread(target=self._read, name=f"reader-{self.pool}-{self.index}",
                         daemon=True).start()
        threading.Thread(target=self._write, name=f"sender-{self.pool}-{self.index}",
                         daemon=True).start()
        await self._ready
        self.last_beat = time.monotonic()

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                try:
                    self._loop.call_soon_threadsafe(self._died)
                except RuntimeError:  # the event loop is already closed: nobody is waiting
                    pass
                return
            self.last_beat = time.monotonic()
            if msg[0] == HEARTBEAT:
                continue
            self.last_progress = self.last_beat
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:
                return

    def kill(self, reason: str) -> None:
        """SIGKILL the process (e.g. it missed its heartbeats); the pipe's EOF then runs the
        normal death path, so a hung worker and a crashed one are recovered the same way."""
        self.lost_reason = reason
        if self.process.is_alive():
            self.process.kill()

    def _died(self) -> None:
        if not self.alive and self._ready is not None and self._ready.done():
            return
        self.alive = False
        self.process.join(timeout=1)
        reason = (self.lost_reason or getattr(self.process, "exit_reason", None)
                  or f"process exited (code {self.process.exitcode})")
        if self.lost_reason is None and self.process.exitcode == -9:  # nobody here killed it
            reason = ("killed by SIGKILL (exit code -9), most likely by the kernel's "
                      "out-of-memory killer" + self.memory_hint)
        self.lost_reason = reason
        self.lost_in_flight = sum(1 for f in self._futures.values() if not f.done())
        err = WorkerLost(f"{self.pool} worker {self.index} lost: {reason}")
        if self.on_death is not None and not self.stopping:
            self.on_death(self)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(err)
        self._futures.clear()

    def _dispatch(self, msg: tuple) -> None:
        msg_id, ok, result, spans = msg
        for span in spans:
            if span is not None:
                self.sink.span(self.pool, self.index, *span)
        if msg_id == -1:
            if isinstance(result, dict):  # a replica's ready message: what it holds
                self.resident = result.get("memory", {})
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(True)
            return
        if msg_id == -2:  # a batch of sub-replies
            for sub_id, sub_ok, sub_result in result:
                self._resolve(sub_id, sub_ok, sub_result)
            return
        self._resolve(msg_id, ok, result)

    def _resolve(self, msg_id: int, ok: bool, result: Any) -> None:
        self._unwatched.discard(msg_id)
        fut = self._futures.pop(msg_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(result)
        else:
            fut.set_exception(WorkerError(f"{self.pool} worker {self.index}: {result}"))

    def _new_future(self) -> tuple[int, asyncio.Future]:
        if not self.alive:
            # why it is gone (an out-of-memory kill names its agents), also for a call made
            # after its death was noticed rather than one in flight then
            why = f": {self.lost_reason}" if self.lost_reason else ""
            raise WorkerLost(f"{self.pool} worker {self.index} is not running{why}")
        assert self._loop is not None
        msg_id = next(self._ids)
        if not self._futures:  # idle until now: the wait for an answer starts here (O(1):
            # answered futures are popped; this runs for every request)
            self.last_progress = time.monotonic()
        fut = self._loop.create_future()
        self._futures[msg_id] = fut
        return msg_id, fut

    def outstanding(self) -> int:
        """Calls sent and not answered yet (those waiting on a peer left out)."""
        return sum(1 for i, f in self._futures.items()
                   if not f.done() and i not in self._unwatched)

    def _send(self, msg: tuple) -> None:
        self._sendq.put(msg)

    def _write(self) -> None:
        while True:
            msg = self._sendq.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # dead: the reader's EOF fails the futures
                return

    async def call(self, command: str, payload: Any, watched: bool = True) -> Any:
        """`watched=False`: a call that waits on another worker, not a sign of this one's
        progress (`runtime.progress_timeout_s` would kill a healthy slot whose replica hangs)."""
        msg_id, fut = self._new_future()
        if not watched:
            self._unwatched.add(msg_id)
        try:
            self._send((msg_id, command, payload))
        except OSError as exc:  # the process died and its pipe's EOF is not processed yet
            self._futures.pop(msg_id, None)
            raise WorkerLost(f"{self.pool} worker {self.index} lost: {exc}") from exc
        return await fut

    def submit(self, item: Any, priority: tuple) -> asyncio.Future:
        """Queue a generate request; requests queued in one loop tick travel as one message."""
        msg_id, fut = self._new_future()
        if not self._outbox:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._outbox.append((msg_id, item, priority))
        return fut

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.alive:
            try:
                self._send((next(self._ids), "generate", batch))
            except OSError:  # dead: the pipe's EOF fails these futures with WorkerLost
                pass

    async def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.alive:
            try:
                await asyncio.wait_for(self.call("stop", None), timeout)
            except (WorkerError, TimeoutError, OSError):
                pass
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.alive = False
        self._sendq.put(None)


def publication_mode(asked: str, pipeline_mode: str = "async") -> str:
    """`runtime.publication` resolved: `auto` is collective wherever torch.distributed is
    built in, except under `pipeline.mode: one_step_off`, whose held publications have a
    failure window the pipes do not (docs/gpu.md, "Weight publication"). Measured on 2 CPU
    cores (docs/gpu.md), gloo from the slot straight to the replicas publishes 3.5-8x faster
    than the pipes through the driver; between GPUs NCCL also skips host memory. On a GPU
    shared by both pools the pair uses gloo (through host memory, as the pipes do, with no
    driver in the path)."""

    if asked != "auto":
        return asked
    if pipeline_mode == "one_step_off":
        return "pipe"
    return "collective" if dist.is_available() else "pipe"


class LocalRolloutPool(RolloutPool):
    """Replicas (each able to host every agent's model) behind the hierarchical balancer;
    agents served by an OpenAI-compatible endpoint bypass the replicas."""

    n_workers: int

    def __init__(
        self,
        workers: list[WorkerProxy],
        balancer: Balancer,
        remote: dict[str, OpenAIBackend] | None = None,
    ) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        self.balancer = balancer
        self.remote = remote or {}
        # The last weights published per agent: what a restarted replica must load.
        self.latest: dict[str, tuple[int, Weights]] = {}
        # Set by the runtime's supervisor: waits until a live replica exists (or raises).
        self.on_lost: Callable[[], Awaitable[None]] | None = None
        # Called as each iteration's rollout ends (Ray: an elastic pool looks for room).
        self.on_iteration_end: Callable[[int], None] | None = None
        # runtime.publication collective: weights arrive as `PublishedRef`s and go from the
        # training slot to the replicas directly
        self.publisher: Publisher | None = None
        # runtime.colocate with rollout.balance shared: one agent holds the pool at a time
        self.turns: AgentTurns | None = None
        self.asleep = False  # runtime.colocate: between `sleep` and `wake`

    def take_turns(self, agents: list[str]) -> None:
        """Time-share the pool among `agents`, one at a time (`runtime.local.turns`)."""
        self.turns = AgentTurns(agents, self._switch_turn)

    async def match_sleep(self, replica: WorkerProxy) -> None:
        """A replica restarted in place (the supervisor's) starts awake: it sleeps what the
        pool's replicas sleep now (all of it while training runs; under turns, every agent
        but the holder)."""
        if self.turns is not None:
            asleep = sorted(set(self.turns.agents) - self.turns.awake)
            if asleep:
                await replica.call("sleep", asleep)
        elif self.asleep:
            await replica.call("sleep", None)

    async def _switch_turn(self, sleep: list[str], wake: list[str]) -> float:
        t0 = time.perf_counter()
        if sleep:
            await self._every_replica("sleep", sleep)
        if wake:
            await self._every_replica("wake", wake)
        return time.perf_counter() - t0

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        """Dispatch; a request whose replica is lost goes again to a live one (sampling is keyed
        by (seed, sample_id, version), so the re-run produces the same tokens)."""
        remote = self.remote.get(request.agent)
        if remote is not None:
            return await remote.generate(request)
        turns = self.turns
        if turns is not None:
            await turns.enter(request.agent)
        try:
            while True:
                try:
                    return await self._dispatch(request, priority)
                except WorkerLost:
                    if self.on_lost is None:
                        raise
                    await self.on_lost()
        finally:
            if turns is not None:
                turns.leave(request.agent)

    async def _dispatch(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        cost = self.balancer.expected_cost(request.agent, len(request.prompt),
                                           request.max_new_tokens)
        if len(self.workers) == 1:  # one replica: nothing to choose (every request's path)
            worker = self.workers[0]
            if not worker.alive:
                raise WorkerLost("no live rollout replica")
        else:
            live = [w for w in self.workers if w.alive]
            if not live:
                raise WorkerLost("no live rollout replica")
            load = [w.outstanding_tokens if w.alive else float("inf") for w in self.workers]
            worker = self.workers[self.balancer.pick(request.agent, load, request.sample_id)]
            if not worker.alive:  # its planned replicas are down: any live one will do
                worker = min(live, key=lambda w: (w.outstanding_tokens, w.index))
        worker.outstanding_tokens += cost
        submitted = time.time()
        try:
            result = await worker.submit(request, priority)
        finally:
            worker.outstanding_tokens -= cost
        result.queue_s = max(0.0, result.admitted_at - submitted)
        self.balancer.observe(request.agent, len(result.tokens))
        return result

    async def publish(self, agent: str, version: int, weights: Weights) -> None:
        if agent in self.remote:
            raise WorkerError(f"agent {agent!r} is served by an external endpoint: its weights "
                              "cannot be published")
        self.latest[agent] = (version, weights)
        if isinstance(weights, PublishedRef):
            assert self.publisher is not None
            self._keep(agent, version, await self.publisher.publish(weights, self.workers))
            return
        results = await asyncio.gather(
            *(w.call("load_weights", (agent, version, weights)) for w in self.workers if w.alive),
            return_exceptions=True,
        )
        for r in results:  # a lost replica gets `latest` when it is restarted
            if isinstance(r, BaseException) and not isinstance(r, WorkerLost):
                raise r

    def _keep(self, agent: str, version: int, weights: Any) -> None:
        """What a restart loads: the pipe form, once a lost slot's weights were refetched."""
        if self.latest.get(agent, (None,))[0] == version:
            self.latest[agent] = (version, weights)

    async def load_into(self, replica: WorkerProxy, agent: str, version: int,
                        weights: Any) -> None:
        """Load one version into a restarted replica (before it is in `workers`)."""
        if isinstance(weights, PublishedRef):
            assert self.publisher is not None
            self._keep(agent, version, await self.publisher.load_into(replica, weights))
            if not replica.alive:
                raise WorkerLost(f"rollout worker {replica.index} lost while loading "
                                 f"{agent!r} version {version}")
            return
        await replica.call("load_weights", (agent, version, weights))

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any]:
        """Re-plan agents onto replicas from iteration k's measured demand."""
        if self.on_iteration_end is not None:
            self.on_iteration_end(k)
        plan = self.balancer.replan(k + 1, self.balancer.demand_from(stats))
        return plan.to_dict()

    def add_replica(self, replica: WorkerProxy) -> None:
        """A started replica holding every agent's latest weights joins the pool; the
        balancer's next plan (and the planner's) counts it."""
        self.workers.append(replica)
        self.n_workers = len(self.workers)
        self.balancer.n_replicas = len(self.workers)

    def remove_replica(self, index: int) -> WorkerProxy:
        """Replica `index` leaves the pool (an elastic pool shrinking): the replicas above it
        move down one index, and the balancer plans again (the planner counts `n_workers`
        from the next iteration on). Its requests in flight were re-dispatched when it was
        lost."""
        replica = self.workers.pop(index)
        for w in self.workers[index:]:
            w.index -= 1
        self.n_workers = len(self.workers)
        self.balancer.remove_replica(index)
        return replica

    def follow_plan(self, plan: Plan) -> None:
        """The planner's replicas per agent (critical path), over the demand plan."""
        self.balancer.follow(plan.iteration, plan.replica_indices())

    async def sleep(self) -> dict[str, float]:
        """`runtime.colocate`: every live replica frees its KV cache and moves its weights to
        host memory (`HFEngine.sleep`; on a CPU the weights stay, only the KV cache goes);
        publications while asleep load into the host copy. Time-shared by turns: also the
        turns' switches during the rollout just done (`switches`, `switch_s`)."""
        self.asleep = True
        out = await self._every_replica("sleep")
        if self.turns is not None:
            self.turns.asleep()
            out.update(self.turns.take_counts())
        return out

    async def wake(self) -> dict[str, float]:
        """`runtime.colocate`: every live replica loads its weights back onto its device and
        allocates its KV cache again, before the next rollout. Time-shared by turns: nothing
        here; each agent's engines wake when its turn comes."""
        self.asleep = False
        if self.turns is not None:
            return {"seconds": 0.0, "kv_bytes": 0.0, "weight_bytes": 0.0}
        return await self._every_replica("wake")

    async def _every_replica(self, command: str,
                             agents: list[str] | None = None) -> dict[str, float]:
        """`command` on every live replica at once, for the engines of `agents` (None: all):
        the wall seconds until the last one is done, and the bytes summed over them. A
        replica lost meanwhile is skipped (its restart comes up awake, with the latest
        weights)."""
        t0 = time.perf_counter()
        results = await asyncio.gather(*(w.call(command, agents) for w in self.workers
                                         if w.alive), return_exceptions=True)
        out = {"seconds": time.perf_counter() - t0, "kv_bytes": 0.0, "weight_bytes": 0.0}
        for r in results:
            if isinstance(r, WorkerLost):
                continue
            if isinstance(r, BaseException):
                raise r
            for key, n in r.items():
                out[key] = out.get(key, 0.0) + n
        return out


def fixed_binding(trainable: list[str], slot_sizes: list[int],
                  slot_of: dict[str, int]) -> dict[str, int]:
    """`runtime.train_binding: fixed`: agents dealt to the slots in turn (config order); slots
    of different sizes keep the planner's binding (`slot_of`, heaviest on the largest)."""
    if len(set(slot_sizes)) > 1:
        return dict(slot_of)
    return {a: i % len(slot_sizes) for i, a in enumerate(trainable)}


class LocalTrainPool(SlotPool):
    """Training slots as worker processes (`train_worker_main`, each a `TrainHost`), bound to
    agents on demand by the shared `SlotPool`. A slot lost meanwhile is restarted by the
    supervisor (`on_lost(slot)` returns once it runs again, restored) and the call runs again."""

    def __init__(self, workers: list[WorkerProxy], slot_sizes: list[int] | None = None,
                 restart_dir: str | None = None) -> None:
        """`restart_dir`: a folder of this machine the slots write their restart points to
        (`keep_restart`), so a step's restart point is a file name on the pipe, not its
        state (weights and optimizer moments) pickled, piped and unpickled by the driver
        while the slot waits; None: `get_state` through the pipe."""
        super().__init__(len(workers), slot_sizes)
        self.workers = workers
        self.on_lost: Callable[[int], Awaitable[None]] | None = None
        self.restart_dir = restart_dir
        self._restart_names = itertools.count()

    def _keep_command(self, agent: str) -> Any:
        if self.restart_dir is None:
            return super()._keep_command(agent)
        # a new name for every restart point: a slot lost after writing one but before its
        # answer leaves the previous file, which the journal since is relative to, intact
        path = os.path.join(self.restart_dir, f"{next(self._restart_names)}.safetensors")
        return ("keep_restart", (agent, path))

    def _restore_command(self, agent: str, saved: Any) -> Any:
        if isinstance(saved, str):
            return ("restore_restart", (agent, saved))
        return super()._restore_command(agent, saved)

    def _kept(self, agent: str, saved: Any) -> None:
        before = self.saved_state.get(agent)
        super()._kept(agent, saved)
        if isinstance(before, str) and before != saved:  # superseded: no restore reads it
            with contextlib.suppress(OSError):
                os.unlink(before)

    async def _run(self, slot: int, command: str, payload: Any) -> Any:
        worker = self.workers[slot]
        result = await worker.call(command, payload)
        if command in ("step", "weights"):  # a collective publication's ref: where it is
            ref = result[1] if command == "step" else result
            if isinstance(ref, PublishedRef):
                ref = dataclasses.replace(ref, slot=slot, generation=worker.generation)
                result = (result[0], ref) if command == "step" else ref
        return result

    def _recovers(self) -> bool:
        return self.on_lost is not None

    async def _recover(self, slot: int, lost: WorkerLost) -> None:
        assert self.on_lost is not None
        await self.on_lost(slot)

    def _slot_generation(self, slot: int) -> Any:
        """The slot's worker process (a restarted one is another generation): an agent
        swapped back in to the process it left comes back from its kept trainer."""
        return getattr(self.workers[slot], "generation", None)  # (a test's stand-in: none)


class LocalRuntime(Runtime):
    def __init__(
        self, cfg: RunConfig, vocab_size: int, max_seq_len: int, sink: RuntimeSink | None = None
    ) -> None:
        self.cfg = cfg
        sink = sink or NullSink()
        self.sink: RuntimeSink = sink
        rt = cfg.runtime
        config = cfg.model_dump(mode="json")
        agents = list(cfg.agents)
        trainable = [a for a in agents if cfg.agents[a].trainable]
        self.trainable = trainable

        swap_dir = self._swap_dir()
        # agents served by an external endpoint need no model in the replicas, nor network
        # agents (hybrid graphs: they act in the episodes, orchestrator/networks.py)
        local_agents = [a for a in agents if cfg.agents[a].backend.kind != "openai"
                        and cfg.agents[a].network is None]
        # the ranks (devices) of each training slot, largest first; rank 0 is the slot's worker
        self.slot_sizes = rt.train_slot_sizes(len(trainable))
        n_train = len(self.slot_sizes)
        # each worker process sees only its pool's devices (CUDA_VISIBLE_DEVICES)
        rollout_at, slot_at = self._placements(rt.rollout_workers, self.slot_sizes)
        train_at = [ranks[0] for ranks in slot_at]
        self._shard_tmp = None
        shard_dir = None
        if max(self.slot_sizes) > 1:  # sharded slots swap and restart per rank through files
            self._shard_tmp = RunTempFolder("flexmarl-shards-")
            shard_dir = self._shard_tmp.name
        self.publication = publication_mode(rt.publication, cfg.pipeline.mode)
        self._store: Any = None
        publication: tuple[str, int, float] | None = None
        if self.publication == "collective" and trainable:
            # the rendezvous of every pair group (workers connect as clients)
            host = self._rendezvous_host()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(
                                            seconds=rt.publication_timeout_s))
            publication = (host, self._store.port, rt.publication_timeout_s)

        rank_launcher = self._slot_rank_launcher()

        def spec(names: list[str], placement: Placement,
                 slot_ranks: tuple[Placement, ...] = ()) -> WorkerSpec:
            return WorkerSpec(config, vocab_size, max_seq_len, names, rt.torch_threads,
                              rt.deterministic, cfg.rollout.max_batch_seqs,
                              heartbeat_s=rt.heartbeat_interval_s, swap_dir=swap_dir,
                              placement=placement, publication=publication,
                              slot_ranks=slot_ranks, shard_dir=shard_dir,
                              rank_launcher=rank_launcher if slot_ranks else None)

        self.placements = {"rollout": rollout_at, "train": train_at}
        launcher = self._launcher()
        self.rollout_workers = [
            WorkerProxy("rollout", i, rollout_worker_main, spec(local_agents, rollout_at[i]), sink,
                        launcher)
            for i in range(rt.rollout_workers)
        ]
        self.train_workers = [
            WorkerProxy("train", i, train_worker_main,
                        spec(trainable, train_at[i], tuple(slot_at[i][1:])), sink, launcher)
            for i in range(n_train)
        ]
        for w, hint in zip(self.rollout_workers + self.train_workers,
                           memory_hints(cfg, vocab_size, len(self.rollout_workers),
                                        len(self.train_workers), local_agents, trainable),
                           strict=True):
            w.memory_hint = hint  # named in the loss reason of an out-of-memory kill
        costs = {a: float(approx_params(cfg.agents[a].model, vocab_size)) for a in local_agents}
        balancer = Balancer(local_agents or agents, rt.rollout_workers, cfg.rollout.balance, costs)
        remote = {a: OpenAIBackend(a, cfg.agents[a].backend)
                  for a in agents if cfg.agents[a].backend.kind == "openai"}
        self.rollout = LocalRolloutPool(self.rollout_workers, balancer, remote)
        if time_shared(cfg):
            self.rollout.take_turns(local_agents)
        self._restart_tmp = self._restart_folder(launcher, trainable, vocab_size)
        self.train = LocalTrainPool(
            self.train_workers, self.slot_sizes,
            self._restart_tmp.name if self._restart_tmp is not None else None)
        # slots of different sizes: the heaviest agent (parameters) on the largest slot, until
        # the planner measured their training (an agent keeps the size it first trained at)
        self.slot_of = bind_slots({a: costs.get(a, float(approx_params(
            cfg.agents[a].model, vocab_size))) for a in trainable}, self.slot_sizes)
        self.train.bind_slots(self.slot_of)
        if rt.train_binding == "fixed":
            self.train.fix_slots(fixed_binding(trainable, self.slot_sizes, self.slot_of))
        self.supervisor = Supervisor(self) if rt.max_worker_restarts > 0 else None
        if publication is not None:
            sup = self.supervisor

            async def wait_slot(index: int) -> None:
                if sup is None:  # why it was lost (an out-of-memory kill names its agents)
                    why = self.train_workers[index].lost_reason
                    raise WorkerLost(f"train worker {index} lost: {why or 'not running'} "
                                     "(runtime.max_worker_restarts=0)")
                await sup.wait_worker("train", index)

            async def pipe_weights(agent: str) -> Any:
                return await self.train._call(agent, "weights_pipe", agent)

            def refetched(agent: str, version: int) -> None:
                sink.fault("weights_refetched", agent=agent, version=version)

            self.rollout.publisher = Publisher(self.train_workers, self.placements,
                                               wait_slot, pipe_weights, refetched,
                                               rt.publication_timeout_s)

    def _restart_folder(self, launcher: Launcher, trainable: list[str],
                        vocab_size: int) -> tempfile.TemporaryDirectory | None:
        """Where the slots write their restart points (`LocalTrainPool.restart_dir`), with
        recovery on: slots of one rank that are processes of this machine (a sharded slot's
        restart point is already a checkpoint folder; a Ray actor may be on another node).
        In shared memory when it holds four restart points of every agent (weights and two
        optimizer moments in float32), else the temporary folder; removed at `stop`."""
        rt = self.cfg.runtime
        if (rt.max_worker_restarts <= 0 or not trainable or max(self.slot_sizes) > 1
                or not isinstance(launcher, ProcessLauncher)):
            return None
        need = 4 * 12 * sum(approx_params(self.cfg.agents[a].model, vocab_size)
                            for a in trainable)
        shm = "/dev/shm"  # noqa: S108 - a private folder made in it
        try:
            where = shm if shutil.disk_usage(shm).free > need else None
        except OSError:
            where = None
        return RunTempFolder("flexmarl-restart-", where)

    def _swap_dir(self) -> str | None:
        """`runtime.swap_to: disk`: the folder swapped-out trainer states go to (the workers
        of both runtimes get it in their spec; removed at `stop`)."""
        self._swap_tmp = (RunTempFolder("flexmarl-swap-")
                          if self.cfg.runtime.swap_to == "disk" else None)
        return self._swap_tmp.name if self._swap_tmp is not None else None

    # --- what a runtime that hosts the same workers elsewhere (Ray) changes ------------------
    def _launcher(self) -> Launcher:
        """Where the workers run: local processes."""
        return ProcessLauncher()

    def _placements(self, n_rollout: int, slot_sizes: list[int]
                    ) -> tuple[list[Placement], list[list[Placement]]]:
        """The device of each rollout worker and of each rank of each training slot: each
        process sees only its own GPU."""
        rollout, _ = plan_placements(self.cfg.runtime, n_rollout, 0)
        nice = rollout_nice(self.cfg, rollout[0].kind if rollout else "cpu", n_rollout,
                            sum(slot_sizes))
        rollout = [dataclasses.replace(p, nice=nice) for p in rollout]
        return rollout, slot_placements(self.cfg.runtime, slot_sizes)

    def _slot_rank_launcher(self) -> Any:
        """What starts ranks 1..K-1 of a sharded slot: None, rank 0's child processes."""
        return None

    def _rendezvous_host(self) -> str:
        """The address the workers reach the driver's publication rendezvous at."""
        return "127.0.0.1"

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start() for w in self.rollout_workers + self.train_workers))
            if self.supervisor is not None:
                await self.supervisor.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        await asyncio.gather(
            *(w.stop() for w in self.rollout_workers + self.train_workers),
            return_exceptions=True,
        )
        if self._swap_tmp is not None:
            self._swap_tmp.cleanup()
        if self._shard_tmp is not None:
            self._shard_tmp.cleanup()
        if self._restart_tmp is not None:
            self._restart_tmp.cleanup()
        self._store = None  # the pair groups' rendezvous, once every worker is gone

    def pool_devices(self) -> dict[str, list[int]]:
        """The GPU indices each pool computes on (empty on the CPU)."""
        return {pool: sorted({d for p in at for d in p.visible})
                for pool, at in self.placements.items()}

    def fault_counts(self) -> dict[str, Any] | None:
        if self.supervisor is None:
            return None
        return {"failures": self.supervisor.failures, "recoveries": self.supervisor.recoveries}

    def placement(self) -> dict[str, Any]:
        at = self.placements
        return {
            "rollout": [{"worker": w.index, "pid": w.process.pid,
                         "device": at["rollout"][w.index].kind,
                         "gpus": list(at["rollout"][w.index].visible),
                         "memory": w.resident}
                        for w in self.rollout_workers],
            "train": [
                {"worker": w.index, "pid": w.process.pid,
                 "device": at["train"][w.index].kind, "gpus": list(at["train"][w.index].visible),
                 "agents": [a for a, i in self.train.allocator.binding().items()
                            if i == w.index],
                 "resident_mb": round(self.train.resident_bytes.get(w.index, 0.0) / 2**20, 3)}
                for w in self.train_workers
            ],
            # what each trained agent adds to a slot (an adapter agent: adapter + AdamW)
            "train_agent_mb": {a: round(b / 2**20, 3) for a, b in self.train.agent_bytes.items()},
            "train_swaps": self.train.allocator.swaps,
            "train_swaps_in": dict(self.train.swaps_in),
            "train_swap_s": self.train.swap_seconds,
            # pools sharing a GPU overlap their kernels only under MPS (doctor: gpu sharing)
            "mps": mps_active(),
        }


class EnvRolloutPool(RolloutPool):
    """An environment run's rollout workers (classic MARL): each steps its own environments
    with the published version of every policy; `rollout_on(i, k)` is worker i's batch of work.

    Each worker owns its environments, so a lost worker's iteration cannot go to another:
    with a supervisor (`wait_worker`), the worker is restarted with every policy's latest
    weights (the supervisor's `load_latest`), gets back the environment state it had at the
    start of the iteration (`env_state`, returned by its previous rollout) and rolls the
    iteration out again: the same rows, bit for bit."""

    n_workers: int

    def __init__(self, workers: list[WorkerProxy]) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        # per policy: the last (version, weights) published, what a restarted worker loads
        self.latest: dict[str, tuple[int, Any]] = {}
        # per worker: its environment state at the start of the next iteration (None: not
        # captured)
        self.env_state: list[bytes | None] = [None] * len(workers)
        self._proxies = list(workers)  # the processes env_state belongs to
        # set by the runtime's supervisor: returns once rollout worker i runs again
        self.wait_worker: Callable[[int], Awaitable[None]] | None = None
        self.on_lost: Callable[[], Awaitable[None]] | None = None  # (the LLM pool's hook)
        self.redone = 0  # iterations rolled out again on a restarted worker

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        raise Unsupported("an environment run's rollout workers step environments with "
                          "network policies; they serve no token generation requests")

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        """To every live worker; a lost one loads `latest` when it is restarted."""
        self.latest[agent] = (version, weights)
        results = await asyncio.gather(
            *(w.call("load_weights", (agent, version, weights))
              for w in self.workers if w.alive), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not (isinstance(r, WorkerLost)
                                                     and self.wait_worker is not None):
                raise r

    async def capture(self) -> None:
        """Every worker's environment state now (the run's start)."""
        self.env_state = list(await asyncio.gather(*(w.call("get_state", None)
                                                     for w in self.workers)))
        self._proxies = list(self.workers)

    async def restore(self, states: list[bytes]) -> None:
        """Resume: every worker's environments as a checkpoint holds them."""
        if len(states) != len(self.workers):
            raise ValueError(f"the checkpoint holds the environments of {len(states)} rollout "
                             f"workers, runtime.rollout_workers is {len(self.workers)}")
        await asyncio.gather(*(w.call("set_state", s)
                               for w, s in zip(self.workers, states, strict=True)))
        self.env_state = list(states)
        self._proxies = list(self.workers)

    async def rollout_on(self, i: int, k: int) -> Any:
        """Iteration k on worker i (the async pipeline takes each worker's rows as it ends);
        `WorkerLost` when the worker is gone and cannot be restarted (the driver counts it
        against its failure budget)."""
        while True:
            worker = self.workers[i]
            try:
                if worker is not self._proxies[i]:  # restarted: back to the iteration's start
                    state = self.env_state[i]
                    if state is None:
                        raise WorkerError(f"rollout worker {i} was restarted, but its "
                                          "environment state was not captured")
                    await worker.call("set_state", state)
                    self._proxies[i] = worker
                    self.redone += 1
                result = await worker.call("rollout", k)
            except WorkerLost as lost:
                if self.wait_worker is None:
                    raise
                try:
                    await self.wait_worker(i)
                except WorkerError as exc:  # its restarts are used up: lost for good
                    raise WorkerLost(str(exc)) from lost
                continue
            if result.state is not None:
                self.env_state[i] = result.state
                result.state = None  # held here, not by the driver's records
            return result


@dataclasses.dataclass
class EnvWorkers:
    """What an environment run's workers run (the classic MARL layer's mains, above this one):
    `rollout_main` steps environments, `train_main` hosts the network learners of `policies`
    in a `TrainHost`; `spec(i)` is worker i's spec. `capture`: each rollout returns the
    environment state it leaves (restarts, checkpoints)."""

    rollout_main: Callable[..., None]
    train_main: Callable[..., None]
    spec: Callable[[int, str | None], WorkerSpec]  # (worker index, swap folder)
    policies: list[str]
    capture: bool


class EnvRuntime(LocalRuntime):
    """The local runtime with an environment run's workers: `runtime.rollout_workers`
    environment workers (`EnvRolloutPool`) and `runtime.train_workers` training slots (at
    most one per policy; fewer: policies time-share them and are swapped), the same
    `LocalTrainPool`, launcher and `Supervisor` (unless `runtime.max_worker_restarts` is 0):
    a lost slot is restored from the pool's journal, a lost rollout worker redoes its
    iteration from the captured environment state. The networks are small and live on the
    CPU: no placements, no publication but the pipes."""

    rollout: EnvRolloutPool  # type: ignore[assignment]

    def __init__(self, cfg: RunConfig, workers: EnvWorkers,
                 sink: RuntimeSink | None = None) -> None:
        rt = cfg.runtime
        self.cfg = cfg
        self.sink = sink or NullSink()
        self.trainable = list(workers.policies)
        self._shard_tmp = None
        self._restart_tmp = None  # restart points through the pipes (`LocalTrainPool`)
        self._store = None
        swap_dir = self._swap_dir()
        n_train = max(1, min(rt.train_workers, len(workers.policies)))
        self.slot_sizes = [1] * n_train
        self.placements = {}
        launcher = self._launcher()
        self.rollout_workers = [
            WorkerProxy("rollout", i, workers.rollout_main, workers.spec(i, swap_dir),
                        self.sink, launcher) for i in range(rt.rollout_workers)]
        self.train_workers = [
            WorkerProxy("train", i, workers.train_main, workers.spec(i, swap_dir), self.sink,
                        launcher) for i in range(n_train)]
        self.rollout = EnvRolloutPool(self.rollout_workers)
        self.train = LocalTrainPool(self.train_workers)
        self.capture = workers.capture
        self.supervisor = Supervisor(self) if rt.max_worker_restarts > 0 else None

    async def start(self) -> None:
        await super().start()
        try:
            if self.capture:
                await self.rollout.capture()
            if self.supervisor is not None:
                supervisor = self.supervisor

                async def wait_rollout(i: int) -> None:
                    await supervisor.wait_worker("rollout", i)

                self.rollout.wait_worker = wait_rollout
        except BaseException:
            await self.stop()
            raise

    def fault_counts(self) -> dict[str, Any] | None:
        counts = super().fault_counts()
        if counts is not None:
            counts["iterations_redone"] = self.rollout.redone
        return counts

    def placement(self) -> dict[str, Any]:
        return {
            "runtime": self.cfg.runtime.kind,
            "rollout": [{"worker": w.index, "pid": w.process.pid} for w in self.rollout_workers],
            "train": [{"worker": w.index, "pid": w.process.pid,
                       "policies": [a for a, i in self.train.binding.items() if i == w.index]}
                      for w in self.train_workers],
            "train_swaps": self.train.allocator.swaps,
            "train_swaps_in": dict(self.train.swaps_in),
        }


class SupervisedRuntime(Protocol):
    """What `Supervisor` uses of a runtime: `LocalRuntime`, and `EnvRuntime`, whose rollout
    workers step environments instead of serving requests. `cfg.runtime` has the heartbeat,
    progress and restart fields (`heartbeat_interval_s`, `heartbeat_misses`,
    `progress_timeout_s`, `max_worker_restarts`)."""

    cfg: Any
    sink: RuntimeSink
    rollout_workers: list[WorkerProxy]
    train_workers: list[WorkerProxy]
    trainable: list[str]

    @property
    def rollout(self) -> Any: ...  # `latest` (agent -> (version, weights)), `on_lost`

    @property
    def train(self) -> LocalTrainPool: ...


class Supervisor:
    """Liveness and recovery of the local runtime's worker processes.

    Every worker beats every `runtime.heartbeat_interval_s`; one silent for
    `runtime.heartbeat_misses` intervals is killed. A lost worker (killed, crashed, hung) is
    restarted in place: a rollout replica reloads the last published weights of every agent
    (its in-flight requests were already re-dispatched to live replicas by the pool); a training
    worker gets each of its agents' state after their last step and replays the micro-batches
    accumulated since. Each failure and recovery is a `worker_failed` / `worker_recovered`
    event in metrics.jsonl and the trace, with the recovery time.
    """

    def __init__(self, runtime: SupervisedRuntime) -> None:
        self.rt = runtime
        self.cfg = runtime.cfg.runtime
        self.restarts = 0
        self.failures: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._changed = asyncio.Event()
        self._fatal: str | None = None
        self._monitor: asyncio.Task | None = None
        self._stopping = False
        # a lost worker this returns True for is not restarted (an elastic pool shrinking)
        self.retire: Callable[[WorkerProxy], bool] | None = None

    def _workers(self) -> list[WorkerProxy]:
        return self.rt.rollout_workers + self.rt.train_workers

    def _event(self, name: str, **fields: Any) -> None:
        self.rt.sink.fault(name, **fields)

    async def start(self) -> None:
        for w in self._workers():
            w.on_death = self._on_death
        self.rt.rollout.on_lost = self._wait_rollout
        self.rt.train.on_lost = self._wait_train
        # Restart point of every trainer: its state now (version 0, or a resumed one later).
        for agent in self.rt.trainable:
            await self.rt.train.keep_restart_point(agent)
        self._monitor = asyncio.ensure_future(self._watch())

    def adopt(self, proxy: WorkerProxy) -> None:
        """Watch and restart a worker that joined a running pool (an elastic pool's)."""
        proxy.on_death = self._on_death

    async def stop(self, timeout: float = 60.0) -> None:
        """Let restarts in progress finish (a run hands back whole pools, and their recovery
        is recorded), then stop watching."""
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for task in self._tasks.values():
            task.cancel()

    async def _watch(self) -> None:
        """Checked every quarter interval: a worker (or a whole Ray node) gone silent is
        declared lost at most a quarter interval after `heartbeat_misses` intervals. A local
        worker's beats are also read from its shared clock (`BeatingPipe`), so one sending a
        large message is not mistaken for a silent one."""
        interval = self.cfg.heartbeat_interval_s
        limit = interval * self.cfg.heartbeat_misses
        while True:
            await asyncio.sleep(interval / 4)
            now = time.monotonic()
            stuck = self.cfg.progress_timeout_s
            for w in self._workers():
                if not w.alive or w.stopping:
                    continue
                clock = getattr(w.process, "beat", None)
                if clock is not None:
                    w.last_beat = max(w.last_beat, clock.value)
                if now - w.last_beat > limit:
                    w.kill(f"missed {self.cfg.heartbeat_misses} heartbeats "
                           f"({now - w.last_beat:.1f} s silent)")
                elif stuck is not None and now - w.last_progress > stuck and w.outstanding():
                    w.kill(f"no progress: {w.outstanding()} calls unanswered for "
                           f"{now - w.last_progress:.1f} s while it beats "
                           f"(runtime.progress_timeout_s={stuck:g})")

    def _on_death(self, proxy: WorkerProxy) -> None:
        if self._stopping:
            return
        died_at = time.monotonic()
        info = {"pool": proxy.pool, "worker": proxy.index, "pid": proxy.process.pid,
                "reason": proxy.lost_reason, "in_flight": proxy.lost_in_flight}
        self.failures.append(info)
        self._event("worker_failed", **info)
        if self.retire is not None and self.retire(proxy):
            self._changed.set()
            return
        key = (proxy.pool, proxy.index)
        self._tasks[key] = asyncio.ensure_future(self._restart(proxy, died_at))

    def _give_up(self, old: WorkerProxy, why: str) -> None:
        """`old` stays lost: the run ends with why (`worker_unrecoverable`)."""
        self._fatal = f"{old.pool} worker {old.index} lost ({old.lost_reason}) and {why}"
        self._event("worker_unrecoverable", pool=old.pool, worker=old.index, reason=self._fatal)
        self._changed.set()

    async def _restart(self, old: WorkerProxy, died_at: float) -> None:
        while True:
            if self.restarts >= self.cfg.max_worker_restarts:
                self._give_up(old, f"runtime.max_worker_restarts="
                                   f"{self.cfg.max_worker_restarts} restarts are used up")
                return
            self.restarts += 1
            new = old.fresh()
            try:
                await new.start()
                if old.pool == "rollout":
                    await self._load_latest(new)
                    match_sleep = getattr(self.rt.rollout, "match_sleep", None)
                    if match_sleep is not None:  # runtime.colocate: asleep as the others are
                        await match_sleep(new)
                else:
                    await self._restore_trainers(new)
            except WorkerLost:
                await new.stop(timeout=1)
                continue
            except Exception as exc:  # noqa: BLE001 - ends the run with why, never a silent wait
                await new.stop(timeout=1)
                self._give_up(old, f"its restart failed: {type(exc).__name__}: {exc}")
                return
            new.on_death = self._on_death
            workers = self.rt.rollout_workers if old.pool == "rollout" else self.rt.train_workers
            workers[old.index] = new  # the pools share these lists
            recovery_s = time.monotonic() - died_at
            info = {"pool": old.pool, "worker": old.index, "pid": new.process.pid,
                    "recovery_s": recovery_s, "restarts": self.restarts}
            self.recoveries.append(info)
            self._event("worker_recovered", **info)
            self._changed.set()
            return

    async def _load_latest(self, new: WorkerProxy) -> None:
        load_into = getattr(self.rt.rollout, "load_into", None)

        async def load(agent: str, version: int, weights: Any) -> None:
            if load_into is not None:
                await load_into(new, agent, version, weights)
            else:
                await new.call("load_weights", (agent, version, weights))

        await load_latest(self.rt.rollout.latest, load)

    async def _restore_trainers(self, new: WorkerProxy) -> None:
        await self.rt.train.restore_slot(new.index, new.call)

    async def _wait_rollout(self) -> None:
        while True:
            if self._fatal is not None:
                raise WorkerError(self._fatal)
            if any(w.alive for w in self.rt.rollout_workers):
                return
            self._changed.clear()
            await self._changed.wait()

    async def _wait_train(self, index: int) -> None:
        await self.wait_worker("train", index)

    async def wait_worker(self, pool: str, index: int) -> None:
        """Return once worker `index` of `pool` runs again (restarted and restored), or raise
        when it cannot be restarted."""
        workers = self.rt.rollout_workers if pool == "rollout" else self.rt.train_workers
        while True:
            if self._fatal is not None:
                raise WorkerError(self._fatal)
            if workers[index].alive:
                return
            task = self._tasks.get((pool, index))
            if task is not None and not task.done():
                await asyncio.shield(task)
                continue
            self._changed.clear()
            await self._changed.wait()
