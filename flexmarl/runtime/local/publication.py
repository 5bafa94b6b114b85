"""Weight publication trainer -> replica over torch.distributed, without the driver in the path.

`runtime.publication: collective` (see docs/gpu.md): a training slot's `step` keeps the
published weights as one flat buffer (`SlotPublisher`) and answers the driver with a small
`PublishedRef` (agent, version, wire header, size) instead of the weights. Publishing sends the
buffer from the slot to each live replica over a two-process group of its own (gloo; NCCL when
both ends compute on CUDA); the header travels over the existing pipes.

Why pairwise groups rather than one world group: torch.distributed cannot re-admit a restarted
process into a running group, and a replica or slot restarted by the supervisor must keep
receiving. A pair group is keyed by both ends' process generations (`WorkerProxy.generation`),
so a restarted worker simply meets its peers under a new key; both ends build it lazily on its
first publication (rendezvous through the driver's TCPStore on 127.0.0.1).

Failures: every group has `runtime.publication_timeout_s`, so a hung peer fails the transfer
instead of hanging the run; a group that failed once is dropped. The driver (`Publisher`) runs
one publication at a time (two concurrent ones could wait on each other through the replicas'
ordered command loops), kills a live replica whose receive failed (the supervisor restarts it
with the latest weights, as for any lost worker), and when the slot itself is lost it asks the
restored slot for the weights in pipe form (`weights_pipe`), checking the version.

NCCL and device indices: each worker sees only its own GPU (CUDA_VISIBLE_DEVICES), where it is
`cuda:0`. NCCL identifies GPUs by PCI bus id, not by index, so both ends use their local
`cuda:current_device()`; but a peer GPU that is not visible in this process cannot be reached by
CUDA peer-to-peer copies, so NCCL may route the transfer through shared host memory (SHM).
Unverified here: this session had no GPU.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexmarl.api.runtime import WorkerError, WorkerLost
from flexmarl.training.state import TrainingState, _header, _unflat, comm_device

if TYPE_CHECKING:
    from flexmarl.policy.device import Placement
    from flexmarl.runtime.local.runtime import WorkerProxy


@dataclass(frozen=True)
class PublishedRef:
    """What the driver holds of a published version: where it is, not the weights. `slot` and
    `generation` (the slot process's) are filled in by the driver-side pool."""

    agent: str
    version: int
    header: bytes  # the wire header: names, dtypes, shapes, meta
    nbytes: int
    slot: int = -1
    generation: int = -1


def backend_for(a: Placement, b: Placement) -> str:
    """NCCL when both ends compute on CUDA, on different GPUs (NCCL refuses two ranks of one
    communicator on one GPU: a single-GPU machine sharing its GPU between the pools); gloo
    otherwise (through host memory)."""
    apart = a.kind == "cuda" and b.kind == "cuda" and not set(a.visible) & set(b.visible)
    return "nccl" if apart else "gloo"


def pair_key(slot: int, slot_gen: int, replica: int, replica_gen: int) -> str:
    return f"pub/s{slot}.{slot_gen}/r{replica}.{replica_gen}"


class PairGroups:
    """This process's two-process groups, by pair key (rank 0: the slot, 1: the replica)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port = host, port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._groups: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: str, rank: int, backend: str) -> Any:
        """The pair's group; built (a rendezvous with the peer, up to the timeout) on first
        use. Groups of different pairs may be built at the same time from several threads."""

        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=self.timeout)
            group = self._groups.get(key)
            store = self._store
        if group is None:
            prefixed = dist.PrefixStore(key, store)
            if backend == "nccl":
                group = dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options())
            else:
                group = dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)
            with self._lock:
                self._groups[key] = group
        return group

    def drop(self, key: str) -> None:
        with self._lock:
            self._groups.pop(key, None)


class SlotPublisher:
    """A training slot's published versions, kept until a newer version of the agent is
    published (a restarted replica loads the latest from here), and the sends."""

    def __init__(self, groups: PairGroups) -> None:
        self.groups = groups
        self.kept: dict[str, dict[int, tuple[bytes, Any]]] = {}
        self._lock = threading.Lock()

    def keep(self, agent: str, version: int, weights: dict[str, Any]) -> PublishedRef:
        """Flatten the weights (on their device) and keep them; the driver gets the ref."""

        state = TrainingState(weights, {"agent": agent, "version": version})
        parts = [v.detach().contiguous().reshape(-1).view(torch.uint8) for v in weights.values()]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        header = json.dumps(_header(state)).encode()
        with self._lock:
            self.kept.setdefault(agent, {})[version] = (header, flat)
        return PublishedRef(agent, version, header, int(flat.numel()))

    def send(self, agent: str, version: int, dests: list[tuple[str, str]]) -> list[str | None]:
        """Send `agent`'s `version` to each (pair key, backend) at once; older versions are
        dropped. Per destination: None, or the error (that pair's group is dropped)."""
        with self._lock:
            versions = self.kept.get(agent, {})
            if version not in versions:
                raise KeyError(f"agent {agent!r} version {version} is not kept on this slot "
                               f"(kept: {sorted(versions)})")
            for old in [v for v in versions if v < version]:
                del versions[old]
            _, flat = versions[version]
        errors: list[str | None] = [None] * len(dests)

        def one(i: int, key: str, backend: str) -> None:
            try:
                group = self.groups.get(key, 0, backend)
                group.send([flat.to(comm_device(group))], 1, 0).wait()
            except Exception as exc:  # noqa: BLE001 - a lost or hung replica
                errors[i] = f"{type(exc).__name__}: {exc}"
                self.groups.drop(key)

        # all at once: a missing peer's rendezvous or a slow receiver delays no other replica
        threads = [threading.Thread(target=one, args=(i, *d), daemon=True)
                   for i, d in enumerate(dests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors


def receive(groups: PairGroups, ref: PublishedRef, key: str, backend: str) -> Any:
    """A replica's end: the version's `TrainingState`, on this process's compute device."""

    try:
        group = groups.get(key, 1, backend)
        buf = torch.empty(ref.nbytes, dtype=torch.uint8, device=comm_device(group))
        group.recv([buf], 0, 0).wait()
    except Exception:
        groups.drop(key)
        raise
    return _unflat(json.loads(ref.header), buf)


@dataclass(eq=False)
class Publisher:
    """The driver's side: one publication at a time, from the slot holding the version to
    replicas, over their pair groups; recovery of the failures described in the module
    docstring. `train_workers` / `placements` are the runtime's (restarts replace workers in
    the shared lists)."""

    train_workers: list[WorkerProxy]
    placements: dict[str, list[Placement]]
    # returns once training slot i runs again (a lost slot's restart)
    wait_slot: Callable[[int], Awaitable[None]] | None = None
    # the agent's current weights in wire form, fetched through the slot pool
    pipe_weights: Callable[[str], Awaitable[Any]] | None = None
    # (agent, version): a lost slot's version was published again from its restored
    # successor (an event in metrics.jsonl)
    on_refetch: Callable[[str, int], None] | None = None
    # `runtime.publication_timeout_s`: how long a restarted replica waits for the publication
    # of a version its restored slot already trained (see `load_into`)
    timeout_s: float = 60.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    sent_bytes: int = field(default=0, init=False)
    fallbacks: int = field(default=0, init=False)
    # per agent: the newest version sent
    published: dict[str, int] = field(default_factory=dict, init=False)
    # per agent: the newest version whose publication began (the driver's `latest`)
    announced: dict[str, int] = field(default_factory=dict, init=False)
    # set (and replaced) when a newer version is announced
    _news: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def _dest(self, ref: PublishedRef, replica: WorkerProxy) -> tuple[str, str]:
        key = pair_key(ref.slot, ref.generation, replica.index, replica.generation)
        backend = backend_for(self.placements["train"][ref.slot],
                              self.placements["rollout"][replica.index])
        return key, backend

    async def publish(self, ref: PublishedRef, replicas: list[WorkerProxy],
                      restart: bool = False) -> Any:
        """Deliver `ref` to the live `replicas`. Returns what the driver should keep as the
        latest: the ref, or the pipe form when the slot was lost and the weights were
        fetched from its restored successor (then delivered through the pipes)."""

        if not restart:
            self._announce(ref.agent, ref.version)
        async with self.lock:
            if restart and ref.version < self.announced.get(ref.agent, -1):
                return ref  # superseded while the restart waited (see `load_into`)
            slot = self.train_workers[ref.slot]
            live = [w for w in replicas if w.alive]
            if slot.generation == ref.generation and slot.alive and live:
                dests = [self._dest(ref, w) for w in live]
                sender = slot.call("pub_send", (ref.agent, ref.version, dests), watched=False)
                receivers = [w.call("load_collective", (ref, *self._dest(ref, w)), watched=False)
                             for w in live]
                results = await asyncio.gather(sender, *receivers, return_exceptions=True)
                sent, received = results[0], results[1:]
                if not isinstance(sent, BaseException):
                    for w, err, got in zip(live, sent, received, strict=True):
                        if err is not None or isinstance(got, BaseException):
                            if w.alive and not isinstance(got, WorkerLost):
                                # a peer that failed a collective is lost: restarted, it
                                # gets the latest weights like any restarted replica
                                w.kill(f"collective publication of {ref.agent!r} version "
                                       f"{ref.version} failed: {err or got}")
                    self.sent_bytes += ref.nbytes * len(live)
                    self.published[ref.agent] = max(ref.version,
                                                    self.published.get(ref.agent, -1))
                    return ref
                if not isinstance(sent, WorkerLost):
                    raise sent
            elif slot.generation == ref.generation and slot.alive:
                return ref
        return await self._from_restored_slot(ref, replicas, WorkerError, WorkerLost, restart)

    def _announce(self, agent: str, version: int) -> None:
        if version > self.announced.get(agent, -1):
            self.announced[agent] = version
            self._news.set()
            self._news = asyncio.Event()

    async def _announced_after(self, agent: str, version: int, error: type) -> None:
        """Return once a version of `agent` newer than `version` is being published."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while self.announced.get(agent, -1) <= version:
            news = self._news
            try:
                await asyncio.wait_for(news.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise error(
                    f"agent {agent!r}: version {version} was lost with its training slot and "
                    f"the restored slot's newer version was not published within "
                    f"runtime.publication_timeout_s={self.timeout_s:g} s (a held publication, "
                    "pipeline.mode: one_step_off?); runtime.publication: pipe keeps published "
                    "weights in the driver") from None

    async def _from_restored_slot(self, ref: PublishedRef, replicas: list[WorkerProxy],
                                  error: type, lost: type, restart: bool = False) -> Any:
        """The slot holding the version was lost: its restored successor's weights, when
        they are still that version, go through the pipes. A restarted replica's load
        (`restart`) may find the restored slot already a step further: its load was queued
        behind that step, which made the version it asked for obsolete; it waits for the
        newer version's publication (the step's caller publishes it at once), which its
        `load_latest` loop then loads."""
        if self.wait_slot is None or self.pipe_weights is None:
            raise error(f"training slot {ref.slot} holding agent {ref.agent!r} version "
                        f"{ref.version} was lost before its publication")
        await self.wait_slot(ref.slot)
        wire = await self.pipe_weights(ref.agent)
        have = json.loads(wire[0])["meta"].get("version")
        if restart and isinstance(have, int) and have > ref.version:
            await self._announced_after(ref.agent, ref.version, error)
            return ref
        if have != ref.version:
            raise error(
                f"agent {ref.agent!r}: version {ref.version} was lost with training slot "
                f"{ref.slot} before its publication (the restored trainer is at version "
                f"{have}); runtime.publication: pipe keeps published weights in the driver")
        self.fallbacks += 1
        self.published[ref.agent] = max(ref.version, self.published.get(ref.agent, -1))
        if self.on_refetch is not None:
            self.on_refetch(ref.agent, ref.version)
        results = await asyncio.gather(
            *(w.call("load_weights", (ref.agent, ref.version, wire))
              for w in replicas if w.alive), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, lost):
                raise r
        return wire

    async def load_into(self, replica: WorkerProxy, ref: PublishedRef) -> Any:
        """A restarted replica's load of the latest version (the slot still keeps it). One a
        newer publication superseded meanwhile is skipped (the slot may have dropped it; the
        caller's `load_latest` loop loads the newer one), as is one its lost slot's restored
        successor already trained past (`_from_restored_slot`)."""
        return await self.publish(ref, [replica], restart=True)
