"""One engine thread per served agent: HTTP handlers submit jobs, the thread runs the batch.

The thread owns the continuous batch (`flexmarl.rollout.engine`): it admits waiting jobs as
room frees up, steps the batch, and hands each job its new tokens (streams, and requests with
stop strings, which the handler decodes and may cancel) and its result. Everything crosses
threads through queues; nothing else touches the engine.

Hot reload: a new version arrives as a second engine beside the running one. New admissions go
to the newest engine only; older engines keep stepping until their last sequence finishes and
are then dropped. A request is therefore decoded wholly by the version that admitted it, and a
reload neither waits for the batch to drain nor fails anything in flight.

Canary (triple-buffer deployment, `deploy.py`): a third engine may run beside the shadow's and
take `canary_share` of new admissions (error diffusion: after n admissions the canary has had
floor(n * share) of them, whatever the order). Promotion makes the canary's
engine the one that takes all new admissions; rollback stops admissions to it. Both are
messages the engine thread applies between two steps, so they are atomic with respect to
admission, and the demoted engine drains like an old version after a reload.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flexmarl.rollout.engine import HFEngine
from flexmarl.serving.adapters import light_copy
from flexmarl.serving.agents import Version
from flexmarl.types import GenerationRequest, GenerationResult


@dataclass
class ServeRequest(GenerationRequest):
    adapter: str | None = None  # a LoRA agent: the adapter to decode with (None: the shadow's)


class ServeEngine(HFEngine):
    """The engine with per-request adapters (a training tenant's requests decode through its
    own). Nucleus sampling is the engine's: inside the nucleus, log-probs of the tempered,
    masked distribution before the cut, as training records them."""

    def _adapter_of(self, request: GenerationRequest) -> str | None:
        """A LoRA agent's request decodes through its tenant's adapter when it names one."""
        adapter = getattr(request, "adapter", None)
        if adapter is not None and self.adapters is not None:
            if adapter not in self.adapters.values():
                raise ValueError(f"request {request.sample_id}: adapter {adapter!r} is not "
                                 f"on this model")
            return adapter
        return super()._adapter_of(request)


Sink = Callable[[tuple], object]  # its return value is ignored


@dataclass
class Job:
    """A request on its way through the batch. `sink` receives, from the engine thread:
    ("tokens", ids, logprobs, version) for new tokens (when `deltas`), then exactly one of
    ("done", GenerationResult, version) or ("error", message)."""

    request: ServeRequest
    sink: Sink
    deltas: bool = False
    emitted: int = 0
    version: Version | None = None
    cancelled: bool = False
    slot: Any = None  # the engine it was routed to (shadow or canary), at first admission try
    pin: str | None = None  # "shadow" / "canary": a team canary's episode (no share counted)


@dataclass
class _Slot:
    version: Version
    engine: ServeEngine
    jobs: dict[str, Job] = field(default_factory=dict)


class AgentWorker:
    HEARTBEAT_S = 2.0  # the engine thread beats at least this often, idle or busy

    def __init__(self, agent: str, model: torch.nn.Module, version: Version,
                 max_seqs: int = 64, max_tokens: int = 65536,
                 adapters: list[str] | None = None) -> None:
        """`adapters`: a LoRA agent served unmerged, the adapters of `model` (the shadow's
        first, then the training tenants'); each engine decodes them in one batch."""
        self.agent = agent
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.adapters = adapters
        self._current = _Slot(version, self._engine(model))
        self._canary: _Slot | None = None
        self._draining: list[_Slot] = []
        self.canary_share = 0.0
        self._owed = 0.0  # error diffusion of the canary's share
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.version = version  # the version new requests get (updated by `swap`)
        self.canary_version: Version | None = None
        self.admitted: dict[int, int] = {}  # requests admitted per version number
        # a LoRA agent's training tenants: the version each one's adapter serves, set with
        # the swap that brings it (`swap(..., tenant_versions)`)
        self.tenant_versions: dict[str, Version] = {}
        self.pending = 0  # jobs submitted and not yet done (read by the HTTP side)
        self.beat = time.monotonic()  # the engine thread's last heartbeat
        self.error: str | None = None  # why the engine thread died, if it did
        self._waiting: list[Job] = []  # submitted, not admitted yet (the engine thread's)
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"serve-{agent}", daemon=True)
        self._thread.start()

    def _engine(self, model: torch.nn.Module) -> ServeEngine:
        """An engine over `model`; a LoRA agent's over a light copy (the base shared, the
        adapters its own), since the engine hooks the adapted layers of the model it gets."""
        if not self.adapters:
            return ServeEngine(model, self.max_seqs, self.max_tokens)
        names = {self.agent: self.adapters[0], **{a: a for a in self.adapters[1:]}}
        return ServeEngine(light_copy(model), self.max_seqs, self.max_tokens, adapters=names)

    # --- called from other threads -----------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            self.pending += 1
        self.inbox.put(("job", job))

    def cancel(self, sample_id: str) -> None:
        """Stop decoding a job (a client gone, a stop string seen); it still gets its "done"."""
        self.inbox.put(("cancel", sample_id))

    def swap(self, model: torch.nn.Module, version: Version,
             tenant_versions: dict[str, Version] | None = None) -> None:
        """Serve `version` for every request admitted from now on (the canary keeps its share);
        a LoRA agent's tenant adapters in `model` serve `tenant_versions` (by adapter)."""
        self.version = version
        self.inbox.put(("swap", (_Slot(version, self._engine(model)), tenant_versions)))

    def set_canary(self, model: torch.nn.Module, version: Version, share: float) -> None:
        """Send `share` of new admissions to `version` (replacing any canary, which drains)."""
        self.canary_version = version
        self.inbox.put(("canary", (_Slot(version, self._engine(model)), share)))

    def promote(self) -> None:
        """The canary becomes the shadow: it takes every new admission; the old shadow drains."""
        assert self.canary_version is not None
        self.version, self.canary_version = self.canary_version, None
        self.inbox.put(("promote", None))

    def rollback(self) -> None:
        """No more admissions to the canary; its requests in flight finish on it."""
        self.canary_version = None
        self.inbox.put(("rollback", None))

    def stop(self) -> None:
        self._stopped = True
        self.inbox.put(("stop", None))

    def versions_running(self) -> list[int]:
        slots = [*self._draining, self._current] + ([self._canary] if self._canary else [])
        return sorted({s.version.number for s in slots})

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the engine thread -------------------------------------------------------------------
    def _finish(self, job: Job, item: tuple) -> None:
        with self._lock:
            self.pending -= 1
        try:
            job.sink(item)
        except Exception:  # noqa: BLE001 - a closed event loop must not kill the engine
            pass

    def _apply(self, kind: str, payload: Any, waiting: list[Job]) -> bool:
        """One control message; False on stop."""
        if kind == "job":
            waiting.append(payload)
        elif kind == "swap":
            self._draining.append(self._current)
            self._current, tenant_versions = payload
            if tenant_versions is not None:  # applied with the engine holding them
                self.tenant_versions = {**self.tenant_versions, **tenant_versions}
        elif kind == "canary":
            if self._canary is not None:
                self._draining.append(self._canary)
            self._canary, self.canary_share = payload
            self._owed = 0.0
        elif kind == "promote" and self._canary is not None:
            self._draining.append(self._current)
            self._current, self._canary = self._canary, None
        elif kind == "rollback" and self._canary is not None:
            self._draining.append(self._canary)
            self._canary = None
        elif kind == "cancel":
            self._cancel(payload, waiting)
        elif kind == "stop":
            return False
        return True

    def _target(self) -> _Slot:
        """Where the next admission goes: the canary for its share of them, else the shadow."""
        if self._canary is None:
            return self._current
        self._owed += self.canary_share
        if self._owed >= 1.0 - 1e-9:
            self._owed -= 1.0
            return self._canary
        return self._current

    def _loop(self) -> None:
        """The engine thread; if it dies, every job it holds gets an error (none hangs) and
        the thread is reported dead (`alive`), for the server to replace it (failover)."""
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - answered below, then the thread ends
            self.error = f"{type(exc).__name__}: {exc}"
            self.fail_all(f"engine thread of agent {self.agent!r} lost ({self.error}); retry")

    def fail_all(self, message: str) -> None:
        """Answer every job this worker holds (queued, waiting, decoding) with an error; for a
        worker whose thread is gone."""
        jobs = list(self._waiting)
        self._waiting.clear()
        slots = [*self._draining, self._current] + ([self._canary] if self._canary else [])
        for slot in slots:
            jobs += list(slot.jobs.values())
            slot.jobs.clear()
        while True:
            try:
                kind, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "job":
                jobs.append(payload)
        for job in jobs:
            self._finish(job, ("error", message))

    def _run(self) -> None:
        waiting = self._waiting
        while not self._stopped:
            self.beat = time.monotonic()
            slots = [*self._draining, self._current] + ([self._canary] if self._canary else [])
            busy = bool(waiting) or any(s.engine.active for s in slots)
            msgs = []
            if not busy:
                try:
                    msgs.append(self.inbox.get(timeout=self.HEARTBEAT_S))
                except queue.Empty:
                    continue
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in msgs:
                if not self._apply(kind, payload, waiting):
                    return
            takes: dict[int, list[GenerationRequest]] = {}
            while waiting:
                job = waiting[0]
                if job.slot is None:  # routed once, at its first admission attempt
                    job.slot = self._target() if job.pin is None else (
                        self._canary if job.pin == "canary" and self._canary is not None
                        else self._current)
                slot = job.slot
                if slot is not self._current and slot is not self._canary:
                    slot = job.slot = self._current  # its canary was rolled back meanwhile
                take = takes.setdefault(id(slot), [])
                if not slot.engine.fits(job.request, take):
                    break
                waiting.pop(0)
                # a training tenant's adapter is its own version (`tenant_versions`)
                version = self.tenant_versions.get(job.request.adapter or "", slot.version)
                job.version = version
                job.request.version = version.number
                slot.jobs[job.request.sample_id] = job
                take.append(job.request)
                self.admitted[version.number] = self.admitted.get(version.number, 0) + 1
            slots = [*self._draining, self._current] + ([self._canary] if self._canary else [])
            for slot in slots:
                self._advance(slot, takes.get(id(slot), []))
            # demoted versions leave once their last sequence is done
            self._draining = [s for s in self._draining if s.engine.active]

    def _cancel(self, sample_id: str, waiting: list[Job]) -> None:
        for i, job in enumerate(waiting):
            if job.request.sample_id == sample_id:
                waiting.pop(i)
                self._finish(job, ("done", GenerationResult(sample_id, [], [], 0), None))
                return
        slots = [*self._draining, self._current] + ([self._canary] if self._canary else [])
        for slot in slots:
            running = slot.jobs.get(sample_id)
            if running is not None:
                running.cancelled = True
                for seq in slot.engine.seqs:
                    if seq.request.sample_id == sample_id:
                        # finishes at its next sampled token
                        seq.request.max_new_tokens = min(seq.request.max_new_tokens,
                                                         len(seq.tokens) + 1)
                return

    def _advance(self, slot: _Slot, take: list[GenerationRequest]) -> None:
        engine = slot.engine
        if not take and not engine.active:
            return
        try:
            done = engine.admit(take) + engine.step()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
            for job in slot.jobs.values():
                self._finish(job, ("error", f"generation failed: {type(exc).__name__}: {exc}"))
            slot.jobs.clear()
            engine.reset()
            return
        for seq in engine.seqs:
            job = slot.jobs[seq.request.sample_id]
            if job.deltas and len(seq.tokens) > job.emitted:
                self._emit(job, seq.tokens, seq.logprobs)
        for result in done:
            job = slot.jobs.pop(result.sample_id)
            if job.deltas and len(result.tokens) > job.emitted:
                self._emit(job, result.tokens, result.logprobs)
            self._finish(job, ("done", result, job.version or slot.version))

    def _emit(self, job: Job, tokens: list[int], logprobs: list[float]) -> None:
        new = (tokens[job.emitted:], logprobs[job.emitted:])
        job.emitted = len(tokens)
        try:
            job.sink(("tokens", *new, job.version))
        except Exception:  # noqa: BLE001
            pass
