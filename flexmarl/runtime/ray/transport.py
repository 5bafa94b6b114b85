"""A worker process's pipe carried by Ray: the local runtime's workers, unchanged, in Ray actors.

A local worker is a process running a worker main (`rollout_worker_main`, `train_worker_main`,
classic MARL's) over one end of a pipe, with `WorkerProxy` at the other end. On Ray the same
main runs in a thread of a `PipeActor`, placed in its pool's placement-group bundle; the pipe
becomes two queues in the actor, fed by `push` calls and drained by long-polling `pull` calls
(each in a concurrency group of its own, so neither waits behind the other or behind the
main's work). `RayLauncher` hands `WorkerProxy` the driver's end (`ActorConn`) and a
process-like handle (`ActorProcess`): the pools, the supervisor (heartbeats, progress timeouts,
restarts, the recovery journal), weight publication and the store are then the local runtime's
own, so local and Ray differ in transport and placement only.

An actor that dies (its process SIGKILLed, its node gone) fails the next `pull` with
`RayActorError`: the driver's end reads that as the pipe's EOF, the local death path.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import ray

PUSH, PULL = "push", "pull"  # the actor's concurrency groups: one thread each
PULL_WAIT_S = 1.0  # a pull returns after this long with nothing (the driver asks again)


class _Inbox:
    """The worker's receiving end: `recv` blocks, `poll` waits up to a timeout."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()

    def put(self, item: Any) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()

    def get(self) -> Any:
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    def poll(self, timeout: float) -> bool:
        with self._ready:
            if not self._items and timeout > 0:
                self._ready.wait(timeout)
            return bool(self._items)


class ActorEnd:
    """The worker main's end of the pipe inside the actor (`send`, `recv`, `poll`)."""

    def __init__(self, inbox: _Inbox, outbox: queue.SimpleQueue) -> None:
        self._inbox, self._outbox = inbox, outbox

    def send(self, msg: Any) -> None:
        self._outbox.put(msg)

    def recv(self) -> Any:
        return self._inbox.get()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._inbox.poll(timeout)


class PipeActor:
    """Runs one worker main in a thread; `push` and `pull` are its pipe (see the module)."""

    def __init__(self) -> None:
        self._inbox = _Inbox()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._next = 0  # the sequence number of the next message to deliver
        self._early: dict[int, list[Any]] = {}  # pushes that overtook an earlier one

    def start_main(self, target: Callable[[Any, Any], None], spec: Any) -> dict[str, Any]:
        """Start `target(pipe end, spec)`; where this actor runs (pid, node, address)."""

        def run() -> None:
            try:
                target(ActorEnd(self._inbox, self._outbox), spec)
            except BaseException:  # noqa: BLE001 - the driver sees the pipe end, as locally
                traceback.print_exc()
            finally:
                self._done.set()

        threading.Thread(target=run, name="worker-main", daemon=True).start()
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "actor_id": ctx.get_actor_id()}

    def push(self, seq: int, msgs: list[Any]) -> None:
        """Messages from the driver, delivered in the order they were sent."""
        self._early[seq] = msgs
        while self._next in self._early:
            for msg in self._early.pop(self._next):
                self._inbox.put(msg)
            self._next += 1

    def pull(self, wait_s: float = PULL_WAIT_S) -> list[Any] | None:
        """What the worker sent since the last pull (waiting up to `wait_s` for a first
        message); None once its main has ended and everything was taken (the pipe's EOF)."""
        try:
            out = [self._outbox.get(timeout=wait_s)]
        except queue.Empty:
            return None if self._done.is_set() and self._outbox.empty() else []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out


class ActorProcess:
    """The `multiprocessing.Process` a `WorkerProxy` expects, for a `PipeActor`."""

    def __init__(self, target: Callable[[Any, Any], None], spec: Any,
                 options: Callable[[], dict[str, Any]]) -> None:
        """`options()`: the actor's options, asked for when it starts (its bundle exists by
        then)."""
        self.target, self.spec, self.options = target, spec, options
        self.handle: Any = None
        self.where: dict[str, Any] = {}
        self._where_ref: Any = None
        self.exitcode: int | None = None
        self.exit_reason: str | None = None  # why Ray says the actor is gone
        self._alive = False

    def start(self) -> None:
        make_remote: Any = ray.remote  # its typed overloads omit `concurrency_groups`
        actor = make_remote(concurrency_groups={PUSH: 1, PULL: 1})(PipeActor)
        self.handle = actor.options(**self.options()).remote()
        self._where_ref = self.handle.start_main.remote(self.target, self.spec)
        self._alive = True

    @property
    def pid(self) -> int | None:
        if not self.where and self._where_ref is not None:
            try:
                self.where = ray.get(self._where_ref, timeout=60)
            except ray.exceptions.RayError:
                return None
        return self.where.get("pid")

    def is_alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        if self.handle is not None and self._alive:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self.handle, no_restart=True)
        self._alive = False

    def gone(self, reason: str) -> None:
        """The driver's end saw the actor die (`RayActorError`)."""
        self.exit_reason = self.exit_reason or reason
        self._alive = False

    def join(self, timeout: float | None = None) -> None:
        """Nothing to reap: a finished main leaves its actor to `kill`."""


class ActorConn:
    """The driver's end of the pipe: `send` pushes (one sender thread: `WorkerProxy._write`),
    `recv` long-polls (one reader thread: `WorkerProxy._read`)."""

    def __init__(self, process: ActorProcess) -> None:
        self.process = process
        self._seq = 0
        self._received: collections.deque = collections.deque()

    def send(self, msg: Any) -> None:
        if not self.process.is_alive():
            raise OSError("the worker's actor is gone")
        self.process.handle.push.options(concurrency_group=PUSH).remote(self._seq, [msg])
        self._seq += 1

    def recv(self) -> Any:
        while not self._received:
            try:
                got = self._pull()
            except ray.exceptions.RayError as exc:  # dead, or the driver shutting Ray down
                dead = isinstance(exc, ray.exceptions.RayActorError)
                self.process.gone(f"{'actor died' if dead else type(exc).__name__}: "
                                  f"{exc}".splitlines()[0])
                raise EOFError from exc
            if got is None:
                self.process.gone("its worker main ended")
                raise EOFError
            self._received.extend(got)
        return self._received.popleft()

    def _pull(self) -> list[Any] | None:
        """One long poll; given up as the pipe's EOF once the driver killed the actor (a
        silent node's actor: Ray learns of its death only when the node is declared dead)."""
        ref = self.process.handle.pull.options(concurrency_group=PULL).remote()
        while True:
            ready, _ = ray.wait([ref], timeout=PULL_WAIT_S)
            if ready:
                return ray.get(ready[0])
            if not self.process.is_alive():
                raise ray.exceptions.RayActorError(
                    error_msg="killed by the driver while it did not answer")


class RayLauncher:
    """`WorkerProxy`'s launcher on Ray: worker `index` of `pool` as a `PipeActor` with the
    actor options `options(pool, index)` (its placement-group bundle), at every (re)start."""

    def __init__(self, options: Callable[[str, int], dict[str, Any]]) -> None:
        self.options = options

    def launch(self, pool: str, index: int, target: Callable[[Any, Any], None],
               spec: Any) -> tuple[ActorConn, ActorProcess]:
        process = ActorProcess(target, spec, lambda: self.options(pool, index))
        return ActorConn(process), process

