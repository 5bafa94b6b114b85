"""One engine thread per served agent: HTTP handlers submit jobs, the thread runs the batch.

The thread owns the continuous batch (`flexmarl.rollout.engine`): it admits waiting jobs as
room frees up, steps the batch, and hands each job its new tokens (streams, and requests with
stop strings, which the handler decodes and may cancel) and its result. Everything crosses
threads through queues; nothing else touches the engine.

Hot reload: a new version arrives as a second engine beside the running one. New admissions go
to the newest engine only; older engines keep stepping until their last sequence finishes and
are then dropped. A request is therefore decoded wholly by the version that admitted it, and a
reload neither waits for the batch to drain nor fails anything in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.engine import HFEngine
from flexmarl.serving.agents import Version


@dataclass
class ServeRequest(GenerationRequest):
    top_p: float = 1.0


class ServeEngine(HFEngine):
    """The engine plus nucleus (top-p) sampling: tokens outside the smallest set holding
    `top_p` of the (masked, tempered) probability are masked before the Gumbel-max draw, so
    reported log-probs are those of the distribution actually sampled."""

    def _sample(self, start: int = 0) -> list[GenerationResult]:
        seqs = self.seqs[start:]
        tops = [getattr(s.request, "top_p", 1.0) for s in seqs]
        if self.logits is not None and any(t < 1.0 for t in tops):
            logits = self.logits / self._temps[start:]
            if any(s.mask is not None for s in seqs):
                full = torch.ones(self.vocab, dtype=torch.bool, device=self.device)
                masks = torch.stack([full if s.mask is None else s.mask for s in seqs])
                logits = logits.masked_fill(~masks, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            top = torch.tensor(tops, dtype=sorted_p.dtype, device=self.device).unsqueeze(1)
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top  # the first always stays
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            self.logits = self.logits.masked_fill(drop, float("-inf"))
        return super()._sample(start)


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


@dataclass
class _Slot:
    version: Version
    engine: ServeEngine
    jobs: dict[str, Job] = field(default_factory=dict)


class AgentWorker:
    def __init__(self, agent: str, model: torch.nn.Module, version: Version,
                 max_seqs: int = 64, max_tokens: int = 65536) -> None:
        self.agent = agent
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self._slots = [_Slot(version, ServeEngine(model, max_seqs, max_tokens))]
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.version = version  # the version new requests get (updated by `swap`)
        self.pending = 0  # jobs submitted and not yet done (read by the HTTP side)
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"serve-{agent}", daemon=True)
        self._thread.start()

    # --- called from other threads -----------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            self.pending += 1
        self.inbox.put(("job", job))

    def cancel(self, sample_id: str) -> None:
        """Stop decoding a job (a client gone, a stop string seen); it still gets its "done"."""
        self.inbox.put(("cancel", sample_id))

    def swap(self, model: torch.nn.Module, version: Version) -> None:
        """Serve `version` for every request admitted from now on."""
        self.version = version
        self.inbox.put(("swap", _Slot(version, ServeEngine(model, self.max_seqs,
                                                          self.max_tokens))))

    def stop(self) -> None:
        self._stopped = True
        self.inbox.put(("stop", None))

    def versions_running(self) -> list[int]:
        return [s.version.number for s in self._slots]

    # --- the engine thread -------------------------------------------------------------------
    def _finish(self, job: Job, item: tuple) -> None:
        with self._lock:
            self.pending -= 1
        try:
            job.sink(item)
        except Exception:  # noqa: BLE001 - a closed event loop must not kill the engine
            pass

    def _loop(self) -> None:
        waiting: list[Job] = []
        while not self._stopped:
            busy = bool(waiting) or any(s.engine.active for s in self._slots)
            msgs = [] if busy else [self.inbox.get()]
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, payload in msgs:
                if kind == "job":
                    waiting.append(payload)
                elif kind == "swap":
                    self._slots.append(payload)
                elif kind == "cancel":
                    self._cancel(payload, waiting)
                elif kind == "stop":
                    return
            current = self._slots[-1]
            take: list[GenerationRequest] = []
            tokens = 0
            while waiting and current.engine.fits(waiting[0].request, len(take), tokens):
                job = waiting.pop(0)
                tokens += len(job.request.prompt) + job.request.max_new_tokens
                job.version = current.version
                job.request.version = current.version.number
                current.jobs[job.request.sample_id] = job
                take.append(job.request)
            for slot in self._slots:
                self._advance(slot, take if slot is current else [])
            # older versions leave once their last sequence is done
            self._slots = [s for s in self._slots[:-1] if s.engine.active] + [self._slots[-1]]

    def _cancel(self, sample_id: str, waiting: list[Job]) -> None:
        for i, job in enumerate(waiting):
            if job.request.sample_id == sample_id:
                waiting.pop(i)
                self._finish(job, ("done", GenerationResult(sample_id, [], [], 0), None))
                return
        for slot in self._slots:
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
            self._finish(job, ("done", result, slot.version))

    def _emit(self, job: Job, tokens: list[int], logprobs: list[float]) -> None:
        new = (tokens[job.emitted:], logprobs[job.emitted:])
        job.emitted = len(tokens)
        try:
            job.sink(("tokens", *new, job.version))
        except Exception:  # noqa: BLE001
            pass
