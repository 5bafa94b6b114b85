"""A command host in a Ray actor, behind the same driver-side interface as a local worker
process (`runtime.local.runtime.WorkerProxy`), so the pools and the local `Supervisor` that use
one work unchanged on the other.

A host is any object with `handle(command, payload) -> (result, span label)`: the classic MARL
rollout worker (`marl.workers.RolloutHost`) and training slot (`marl.learner.MarlSlot`) are
served over a pipe by a local process and by `HostActor` here, with the same code.

Liveness as locally: the proxy pings the actor every `spec.heartbeat_s` in the actor's own
health thread (a busy actor answers); a dead actor fails its pings and calls with Ray's
`RayActorError`, which reads as the worker lost (`on_death`, then `WorkerLost` for every call);
`kill` (missed heartbeats, no progress) kills the actor and takes the same path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from flexmarl.api.runtime import SpanSink, WorkerError, WorkerLost
from flexmarl.runtime.local.workers import _setup_torch, chaos_stall

HEALTH_GROUP = "health"  # the actors' concurrency group for pings: a thread of its own


class HostActor:
    """One host in one Ray actor: `make_host(spec)` builds it in the actor's process."""

    def __init__(self, make_host: Callable[[Any], Any], spec: Any, pool: str) -> None:
        _setup_torch(spec)
        self.pool = pool
        self.host = make_host(spec)

    def where(self) -> dict[str, Any]:
        from flexmarl.runtime.ray.actors import where

        return where()

    def handle(self, command: str, payload: Any) -> tuple[Any, tuple[float, float, str]]:
        t0 = time.time()
        chaos_stall(self.pool, command)
        result, label = self.host.handle(command, payload)
        return result, (t0, time.time(), label)


@dataclass(frozen=True)
class ActorTarget:
    """What an `ActorProxy` starts: the host factory, and the Ray actor options of worker i
    (its placement-group bundle), asked for at each (re)start."""

    make_host: Callable[[Any], Any]
    options: Callable[[int], dict[str, Any]]


class ActorProxy:
    """Driver side of one `HostActor`, with `WorkerProxy`'s interface for the pools (`call`)
    and the supervisor (`alive`, `last_beat`, `last_progress`, `outstanding`, `kill`,
    `on_death`, `fresh`, `process.pid`, `lost_reason`)."""

    memory_hint: str = ""

    def __init__(self, pool: str, index: int, target: ActorTarget, spec: Any,
                 sink: SpanSink) -> None:
        self.pool, self.index, self.target, self.spec, self.sink = pool, index, target, spec, sink
        self.handle: Any = None
        self.where: dict[str, Any] = {}
        self.process = SimpleNamespace(pid=None)  # the actor's process, once started
        self.alive = False
        self.stopping = False
        self.last_beat = time.monotonic()
        self.last_progress = time.monotonic()
        self.lost_reason: str | None = None
        self.lost_in_flight = 0
        self.on_death: Callable[[Any], None] | None = None
        self._in_flight = 0
        self._beats: asyncio.Task | None = None

    def fresh(self) -> ActorProxy:
        """A new actor in this one's place (the supervisor's restart), not started yet."""
        return ActorProxy(self.pool, self.index, self.target, self.spec, self.sink)

    async def start(self) -> None:
        import ray

        make_remote: Any = ray.remote  # its typed overloads omit `concurrency_groups`
        actor = make_remote(concurrency_groups={HEALTH_GROUP: 1})(HostActor)
        self.handle = actor.options(**self.target.options(self.index)).remote(
            self.target.make_host, self.spec, self.pool)
        try:
            self.where = await self.handle.where.options(concurrency_group=HEALTH_GROUP).remote()
        except ray.exceptions.RayError as exc:
            raise WorkerLost(f"{self.pool} worker {self.index} did not start: {exc}") from exc
        self.process = SimpleNamespace(pid=self.where["pid"])
        self.alive = True
        self.last_beat = time.monotonic()
        self._beats = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        import ray

        while self.alive and not self.stopping:
            await asyncio.sleep(self.spec.heartbeat_s)
            try:
                await self.handle.where.options(concurrency_group=HEALTH_GROUP).remote()
            except ray.exceptions.RayActorError as exc:
                self._died(f"actor died: {exc}")
                return
            except ray.exceptions.RayError:
                continue
            self.last_beat = time.monotonic()

    async def call(self, command: str, payload: Any) -> Any:
        import ray

        if not self.alive:
            why = f": {self.lost_reason}" if self.lost_reason else ""
            raise WorkerLost(f"{self.pool} worker {self.index} is not running{why}")
        if not self._in_flight:  # idle until now: the wait for an answer starts here
            self.last_progress = time.monotonic()
        self._in_flight += 1
        try:
            result, span = await self.handle.handle.remote(command, payload)
        except ray.exceptions.RayActorError as exc:
            self._died(f"actor died: {exc}")
            raise WorkerLost(f"{self.pool} worker {self.index} lost: "
                             f"{self.lost_reason}") from exc
        except ray.exceptions.RayTaskError as exc:  # the host raised: the command failed
            cause = exc.cause if exc.cause is not None else exc
            raise WorkerError(f"{self.pool} worker {self.index}: "
                              f"{type(cause).__name__}: {cause}") from exc
        finally:
            self._in_flight -= 1
            self.last_progress = time.monotonic()
        self.sink.span(self.pool, self.index, *span)
        return result

    def outstanding(self) -> int:
        """Calls sent and not answered yet."""
        return self._in_flight

    def kill(self, reason: str) -> None:
        """Kill the actor (it missed its heartbeats, or made no progress): lost, as a crash."""
        import ray

        self.lost_reason = reason
        if self.handle is not None:
            ray.kill(self.handle, no_restart=True)
        self._died(reason)

    def _died(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.lost_reason = self.lost_reason or reason
        self.lost_in_flight = self._in_flight
        if self.on_death is not None and not self.stopping:
            self.on_death(self)

    async def stop(self, timeout: float = 10.0) -> None:
        import ray

        self.stopping = True
        self.alive = False
        if self._beats is not None:
            self._beats.cancel()
        if self.handle is not None and ray.is_initialized():
            try:
                ray.kill(self.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
