"""The simulator's engine under the shared `ReplicaScheduler`: continuous batching whose work
costs cost-model time on the virtual clock.

A decode "step" of this engine is a segment: the decode steps until the first running sequence
finishes (the batch is the same throughout, so its cost is one `_decode_segment_time` call,
O(log batch) whatever the number of steps). `step()` plans the segment and adds its seconds to
`pending_s`; the host waits that long on the virtual clock, then `settle()`s it and hands the
finished sequences to the scheduler (`ReplicaScheduler.complete`). A host may `cut` the planned
segment short (a newcomer for an under-filled batch joins at the next decode step).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from flexmarl.sim.cost import CostModel
from flexmarl.types import GenerationRequest, GenerationResult


class CostModelEngine:
    """One simulated inference engine (a model on `tp` accelerators)."""

    def __init__(self, cost: CostModel, model: Any, tp: int,
                 out_len: Callable[[GenerationRequest], int], max_seqs: int | None = None,
                 kv_cap: int | None = None) -> None:
        """`out_len`: each request's output length (drawn by the workload); `max_seqs` and
        `kv_cap` default to the cost model's (max_num_seqs, the KV cache of `tp` devices)."""
        self.cost = cost
        self.model = model
        self.tp = tp
        self.out_len = out_len
        self.max_seqs = cost.max_num_seqs if max_seqs is None else max_seqs
        self.kv_cap = cost.kv_capacity_tokens(model, tp) if kv_cap is None else kv_cap
        self.running: list[tuple[int, int, GenerationRequest, int]] = []  # heap: finish step
        self.decoded = 0  # decode steps run so far
        self.kv = 0  # KV tokens the running batch holds
        self.reserved = 0  # KV tokens it will hold at full length
        self._order = 0
        self.prefill_s = 0.0  # the admissions' prefill since the host last took it
        self.admitted: list[GenerationRequest] = []  # admitted since the host last took them
        self.segment: tuple[int, float] | None = None  # planned (steps, seconds per step)

    # --- the scheduler's engine interface -------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.running)

    def active_for(self, agent: str) -> int:
        return len(self.running)

    def budget(self, request: GenerationRequest) -> int:
        return len(request.prompt) + self.out_len(request)

    def fits(self, request: GenerationRequest, take: Sequence[GenerationRequest] = ()) -> bool:
        n = len(self.running) + len(take)
        if n >= self.max_seqs:
            return False
        extra = sum(self.budget(t) for t in take)  # a modelled engine without prefix sharing
        return self.reserved + extra + self.budget(request) <= self.kv_cap or n == 0

    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Newcomers join after one prefill of their prompts (no token sampled yet)."""
        if not requests:
            return []
        self.prefill_s += self.cost.prefill_time(self.model, self.tp,
                                                 sum(len(r.prompt) for r in requests))
        for r in requests:
            n = self.out_len(r)
            heapq.heappush(self.running, (self.decoded + n, self._order, r, n))
            self._order += 1
            self.reserved += len(r.prompt) + n
            self.kv += len(r.prompt)
        self.admitted += requests
        return []

    def step(self) -> list[GenerationResult]:
        """Plan the segment up to the first finish; it ends when the host `settle`s it."""
        if not self.running:
            self.segment = None
            return []
        steps = self.running[0][0] - self.decoded
        seconds = self.cost._decode_segment_time(self.model, self.tp, len(self.running),
                                                 self.kv, steps)
        self.segment = (steps, seconds / steps)
        return []

    def load_weights(self, weights: Any, agent: str | None = None) -> None:
        """Weights arrive with the publication the runtime prices; loading adds nothing."""

    def reset(self) -> None:
        self.running.clear()
        self.kv = self.reserved = 0
        self.segment = None

    # --- the host's side ------------------------------------------------------------------
    def pending_s(self) -> float:
        """Seconds of the planned segment."""
        return 0.0 if self.segment is None else self.segment[0] * self.segment[1]

    def cut(self, steps: int) -> None:
        """Shorten the planned segment to `steps` decode steps (no sequence finishes in it)."""
        assert self.segment is not None
        self.segment = (min(steps, self.segment[0]), self.segment[1])

    def settle(self) -> tuple[list[GenerationResult], int]:
        """Run the planned segment: the sequences it finished, and the tokens it decoded."""
        if self.segment is None:
            return [], 0
        done = self.segment[0]
        self.segment = None
        batch = len(self.running)
        self.decoded += done
        self.kv += done * batch
        finished = []
        while self.running and self.running[0][0] <= self.decoded:
            _, _, r, n = heapq.heappop(self.running)
            self.kv -= len(r.prompt) + n
            self.reserved -= len(r.prompt) + n
            finished.append(GenerationResult(r.sample_id, [], [], r.version))
        return finished, done * batch
