"""One replica scheduler for every runtime: a plain state machine, no I/O, no clock of its own.

A rollout replica hosts one engine per model (agents on a shared base share one engine, see
`policy.adapters.engine_groups`). Its host (the local worker process, the Ray actor, the
simulator's replica, the calibration mirror) feeds it requests and weight loads and calls
`step()` when `has_work()`; it answers with events (`Reply`, `Loaded`) for the host to deliver.
The rules live here once:

- per-agent request queues, admitted in priority order (ties: arrival order), each turn as many
  as the engine `fits` within `max_batch_seqs` and its KV budget (`max_batch_tokens`), skipping
  a request that does not fit so a smaller one behind it may;
- per-agent held versions: a request older than the held version is rejected (it can never be
  served); a request for a newer version waits for its weights without spinning;
- weight loads are deferred while the agent has running sequences (never swapped under them),
  and applied as soon as it has none;
- models sharing the replica take turns (one admission + one decode step per turn), so an agent
  with a few short requests is never starved behind another model's long generations;
- deterministic mode decodes one sequence at a time: numerics never depend on batch-mates.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flexmarl.types import GenerationRequest, GenerationResult


class Engine(Protocol):
    """What the scheduler needs of an engine: continuous batching of one model."""

    @property
    def active(self) -> int:
        """Running sequences (all agents)."""
        ...

    def active_for(self, agent: str) -> int:
        """Running sequences of `agent` (its weights must not change under them)."""
        ...

    def fits(self, request: GenerationRequest, take: Sequence[GenerationRequest] = ()) -> bool:
        """Would `request` fit next to the running batch and the newcomers `take` chosen before
        it? An empty batch always takes one request."""
        ...

    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Join `requests` to the running batch; returns any that finish at once."""
        ...

    def step(self) -> list[GenerationResult]:
        """One decode step of the running batch; returns the sequences that finished."""
        ...

    def load_weights(self, weights: Any, agent: str | None = None) -> None:
        """A new version of the model (or, on a shared base, of `agent`'s adapter)."""
        ...

    def reset(self) -> None:
        """Drop the running batch after a failure; the model stays loaded."""
        ...


@dataclass
class Reply:
    """The answer to one request: `result` is a `GenerationResult` if `ok`, else an error."""

    key: Any
    agent: str
    ok: bool
    result: Any


@dataclass
class Loaded:
    """The answer to one weight load; `start`/`end` on the host's clock (None: no clock)."""

    key: Any
    agent: str
    version: int
    ok: bool
    error: str | None = None
    start: float = 0.0
    end: float = 0.0


Event = Reply | Loaded


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ReplicaScheduler:
    """The request queues, versions and turns of one rollout replica (see the module doc).

    `groups` maps an engine key to the agents it serves, `engines` the key to its engine.
    `clock` (the host's, optional) only times weight loads for spans; `convert` turns weights
    as they arrive into what the engine loads (called when the load happens); `describe` turns
    an exception into the error text sent back.
    """

    def __init__(self, groups: dict[str, list[str]], engines: dict[str, Engine], *,
                 max_batch_seqs: int = 64, deterministic: bool = False,
                 clock: Callable[[], float] | None = None,
                 convert: Callable[[Any], Any] | None = None,
                 describe: Callable[[BaseException], str] = describe_error) -> None:
        if set(groups) != set(engines):
            raise ValueError(f"replica scheduler: engines {sorted(engines)} do not match "
                             f"groups {sorted(groups)}")
        if max_batch_seqs < 1:
            raise ValueError(f"replica scheduler: max_batch_seqs must be >= 1, got "
                             f"{max_batch_seqs}")
        self.groups = {g: list(members) for g, members in groups.items()}
        self.engines = dict(engines)
        self.group_of = {a: g for g, members in self.groups.items() for a in members}
        if len(self.group_of) != sum(len(m) for m in self.groups.values()):
            raise ValueError("replica scheduler: an agent is in more than one engine group")
        self.agents = list(self.group_of)
        self.max_seqs = 1 if deterministic else max_batch_seqs
        self.deterministic = deterministic
        self.clock = clock
        self.convert = convert
        self.describe = describe
        self.versions = dict.fromkeys(self.agents, 0)
        # per agent: sorted (priority, arrival, key, request); counts of waiting versions
        self.waiting: dict[str, list[tuple[Any, int, Any, GenerationRequest]]] = {
            a: [] for a in self.agents}
        self._versions_waiting: dict[str, Counter[int]] = {a: Counter() for a in self.agents}
        # per engine: sample_id -> (key, agent) of its running sequences
        self.running: dict[str, dict[str, tuple[Any, str]]] = {g: {} for g in self.groups}
        self.deferred: dict[str, tuple[list[Any], int, Any]] = {}  # agent -> keys, version, w
        self._out: list[Event] = []  # answers decided outside a step (rejections)
        self._arrival = itertools.count()
        self._turn = itertools.count()
        self.last_group: str | None = None  # the engine that took the last turn

    # --- input ---------------------------------------------------------------------------
    def submit(self, key: Any, request: GenerationRequest, priority: Any = ()) -> None:
        """Queue a request; `key` identifies it in its `Reply`."""
        agent = request.agent
        if agent not in self.versions:
            self._out.append(Reply(key, agent, False, f"agent {agent!r}: not hosted on this "
                                   f"replica (it hosts {sorted(self.versions)})"))
            return
        if request.version < self.versions[agent]:
            self._out.append(self._stale(key, request))
            return
        bisect.insort(self.waiting[agent], (priority, next(self._arrival), key, request))
        self._versions_waiting[agent][request.version] += 1

    def load(self, key: Any, agent: str, version: int, weights: Any) -> list[Event]:
        """Load `agent`'s `version` now, or once its running sequences are done. A load that
        a newer one supersedes before it happened is answered when the newer one is."""
        if agent not in self.versions:
            return [Loaded(key, agent, version, False,
                           f"agent {agent!r}: not hosted on this replica "
                           f"(it hosts {sorted(self.versions)})")]
        if agent in self.deferred:
            keys = self.deferred[agent][0] + [key]
            self.deferred[agent] = (keys, version, weights)
            return []
        if self.busy(agent):
            self.deferred[agent] = ([key], version, weights)
            return []
        return self._load([key], agent, version, weights)

    def complete(self, group: str, results: list[GenerationResult]) -> list[Event]:
        """Results an engine finished outside `step` (one that runs on its own clock)."""
        return self._answer(group, results)

    # --- state ---------------------------------------------------------------------------
    def busy(self, agent: str) -> int:
        """Running sequences of `agent`."""
        return self.engines[self.group_of[agent]].active_for(agent)

    def busy_agents(self) -> list[str]:
        return [a for a in self.agents if self.busy(a)]

    def queued(self, agent: str | None = None) -> int:
        """Requests waiting (of `agent`, or of all)."""
        if agent is not None:
            return len(self.waiting[agent])
        return sum(len(q) for q in self.waiting.values())

    def _servable(self, agent: str) -> bool:
        """A waiting request the held weights serve."""
        return self._versions_waiting[agent][self.versions[agent]] > 0

    def has_work(self) -> bool:
        """Something to do now: answers to send, a deferred load that can run, running
        sequences, or requests the held weights serve or reject (requests for a newer version
        wait for its weights without spinning)."""
        if self._out or any(not self.busy(a) for a in self.deferred):
            return True
        if any(e.active for e in self.engines.values()):
            return True
        return any(v <= self.versions[a] and n > 0
                   for a, c in self._versions_waiting.items() for v, n in c.items())

    # --- the turn ------------------------------------------------------------------------
    def apply_deferred(self) -> list[Event]:
        """Run the deferred loads whose agent has no running sequence left."""
        events: list[Event] = []
        for agent in list(self.deferred):
            if not self.busy(agent):
                keys, version, weights = self.deferred.pop(agent)
                events += self._load(keys, agent, version, weights)
        return events

    def step(self) -> list[Event]:
        """One turn: deferred loads, rejections, then one engine (in turn among those with
        work) admits what fits and decodes one step."""
        events = self.apply_deferred()
        events += self._out
        self._out = []
        self.last_group = None
        candidates = [g for g, e in self.engines.items()
                      if e.active or any(self._servable(a) for a in self.groups[g])]
        if not candidates:
            return events
        group = candidates[next(self._turn) % len(candidates)]
        self.last_group = group
        engine = self.engines[group]
        take = self._admission(group, engine)
        running = self.running[group]
        for key, r in take:
            running[r.sample_id] = (key, r.agent)
        try:
            finished = engine.admit([r for _, r in take]) + engine.step()
        except Exception as exc:  # noqa: BLE001 - fail this model's batch, keep serving
            err = self.describe(exc)
            events += [Reply(key, agent, False, err) for key, agent in running.values()]
            running.clear()
            engine.reset()
            return events
        return events + self._answer(group, finished)

    def _admission(self, group: str, engine: Engine) -> list[tuple[Any, GenerationRequest]]:
        """Waiting requests of the group's agents the held weights serve, by priority, as
        many as fit (a request that does not fit is skipped, not a barrier)."""
        members = [a for a in self.groups[group] if self._servable(a)]
        queues = [self.waiting[a] for a in members]
        ordered = queues[0] if len(queues) == 1 else sorted(
            item for q in queues for item in q)
        take: list[tuple[Any, GenerationRequest]] = []
        chosen: list[tuple[Any, int, Any, GenerationRequest]] = []
        for item in ordered:
            if engine.active + len(take) >= self.max_seqs:
                break
            r = item[3]
            if r.version != self.versions[r.agent] or not engine.fits(r, [t for _, t in take]):
                continue
            take.append((item[2], r))
            chosen.append(item)
        if chosen:
            gone = {item[1] for item in chosen}
            for a in members:
                self.waiting[a] = [item for item in self.waiting[a] if item[1] not in gone]
            for item in chosen:
                self._versions_waiting[item[3].agent][item[3].version] -= 1
        return take

    def _answer(self, group: str, results: list[GenerationResult]) -> list[Event]:
        running = self.running[group]
        events: list[Event] = []
        for result in results:
            key, agent = running.pop(result.sample_id)
            events.append(Reply(key, agent, True, result))
        return events

    # --- colocation ----------------------------------------------------------------------
    def sleep(self, agents: list[str] | None = None) -> dict[str, int]:
        """The engines of `agents` (None: every engine; an engine shared by several agents
        only when all of them are named) release their device for a colocated trainer or
        the next agent's turn (`HFEngine.sleep`); they must be idle (nothing running, queued
        or waiting to load). Returns the bytes released summed over the engines; engines that
        hold nothing (scripted) are skipped."""
        named = set(self.agents if agents is None else agents)
        groups = [g for g, members in self.groups.items() if set(members) <= named]
        members = [a for g in groups for a in self.groups[g]]
        queued = sum(self.queued(a) for a in members)
        running = sum(self.engines[g].active for g in groups)
        deferred = [a for a in members if a in self.deferred]
        if queued or running or deferred:
            raise RuntimeError(f"cannot sleep {sorted(members)}: {queued} requests queued, "
                               f"{running} running, {len(deferred)} weight loads deferred")
        return self._each("sleep", groups)

    def wake(self, agents: list[str] | None = None) -> dict[str, int]:
        """The engines of `agents` (None: every engine) take their device back
        (`HFEngine.wake`)."""
        named = set(self.agents if agents is None else agents)
        return self._each("wake", [g for g, members in self.groups.items()
                                   if named & set(members)])

    def memory(self) -> dict[str, Any]:
        """What each engine holds now (`HFEngine.memory`), by engine key."""
        return {g: e.memory() for g, e in self.engines.items()  # type: ignore[attr-defined]
                if hasattr(e, "memory")}

    def _each(self, command: str, groups: list[str]) -> dict[str, int]:
        total = {"kv_bytes": 0, "weight_bytes": 0}
        for group in groups:
            act = getattr(self.engines[group], command, None)
            if act is None:
                continue
            for key, n in act().items():
                total[key] = total.get(key, 0) + n
        return total

    # --- versions ------------------------------------------------------------------------
    def _stale(self, key: Any, r: GenerationRequest) -> Reply:
        return Reply(key, r.agent, False, f"agent {r.agent!r}: request {r.sample_id} wants "
                     f"version {r.version}, replica holds {self.versions[r.agent]}")

    def _load(self, keys: list[Any], agent: str, version: int, weights: Any) -> list[Event]:
        t0 = self.clock() if self.clock else 0.0
        try:
            engine = self.engines[self.group_of[agent]]
            engine.load_weights(self.convert(weights) if self.convert else weights, agent)
        except Exception as exc:  # noqa: BLE001 - reported to the host
            err = self.describe(exc)
            return [Loaded(k, agent, version, False, err) for k in keys]
        self.versions[agent] = version
        t1 = self.clock() if self.clock else 0.0
        # requests older than the weights now held can never be served
        queue = self.waiting[agent]
        if any(item[3].version < version for item in queue):
            keep = []
            for item in queue:
                if item[3].version < version:
                    self._out.append(self._stale(item[2], item[3]))
                    self._versions_waiting[agent][item[3].version] -= 1
                else:
                    keep.append(item)
            self.waiting[agent] = keep
            self._versions_waiting[agent] = +self._versions_waiting[agent]
        return [Loaded(k, agent, version, True, None, t0, t1) for k in keys]
