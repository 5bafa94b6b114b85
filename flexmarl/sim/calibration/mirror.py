"""The local runtime in virtual time, with a measured `LocalProfile` as its cost model.

The production `LocalRolloutPool` (and `Balancer`) and `LocalTrainPool` (and `SlotAllocator`,
the supervisor's restart points with `runtime.max_worker_restarts > 0`) drive simulated worker
processes that keep the protocol of `runtime.local.workers`:

- `SimRolloutWorker` mirrors `rollout_worker_main`: the shared `ReplicaScheduler` over one
  `ProfiledEngine` per local agent (the profile's prefill, decode and load costs);
- `SimTrainWorker` mirrors `train_worker_main`: one command at a time, in arrival order, its
  states parked as a real slot's kept trainers park them (a swap-in back to the slot it left
  costs the profile's `swap_in_kept`), its spans labelled as the real slot's (`swap:` spans
  are the records' `pool/train/swaps`); while another of the run's workers is busy next to
  it, its commands cost the profile's `overlap` more.

Message round trips (`ipc_*`) delay delivery and replies by half a measured round trip each.
The orchestrator's own CPU time (`parent_per_request_s`, `parent_per_train_call_s`, as real
runs of the config measured it, times `driver["pipelined"]` outside sync mode) is work of a
serial parent process. A colocated replica's `sleep` and `wake` cost their profiled time.
Under collective publication (`runtime.publication`, the real runtime's choice for sync and
async) with a profile that measured it (`driver["publish_s"]`), a step answers with a small
`PublishedRef`, the production `Publisher` sends `pub_send` to the slot and `load_collective`
to each replica, and a replica that reads it stops decoding for the measured send (the real
replica's loop blocks in the receive), which ends the slot's `publish:` span; otherwise the
weights travel through the pipes (`load_weights`). All
processes' work shares the machine's CPUs (`CpuShare`: the measured contention curve, or
processor sharing on `profile.machine["cpus"]` cores), next to other users' load as the run
saw it (`run_mirror(..., external=...)`). The worker layout is the config's; the task is the
real one (its prompt builders), and outputs are tokens drawn from each request's allowed
tokens with the profile's lengths.
"""

from __future__ import annotations

import asyncio
import bisect
import pickle
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.api.runtime import WorkerLost
from flexmarl.config.schema import RunConfig
from flexmarl.orchestrator.joint import JointOrchestrator
from flexmarl.policy.device import (
    CPU_MAX_BATCH_TOKENS,
    Placement,
    nice_weight,
    rollout_nice,
)
from flexmarl.policy.model import approx_params, stable_seed
from flexmarl.rollout.balancer import Balancer
from flexmarl.rollout.engine import BLOCK_SIZE
from flexmarl.rollout.paged import shared_prompt_tokens
from flexmarl.rollout.scheduler import Loaded, ReplicaScheduler, Reply
from flexmarl.runtime.local.publication import PublishedRef, Publisher
from flexmarl.runtime.local.runtime import (
    LocalRolloutPool,
    LocalTrainPool,
    fixed_binding,
    publication_mode,
)
from flexmarl.runtime.local.turns import time_shared
from flexmarl.sim.calibration.fits import AgentProfile, LocalProfile
from flexmarl.sim.calibration.machine import profiled_load
from flexmarl.sim.runtime.clock import run_virtual
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training.digest_host import DigestSlotHost
from flexmarl.training.host import TrainHost
from flexmarl.training.trainer import length_split, split_call_tokens
from flexmarl.types import GenerationRequest, GenerationResult

_WORKER_KINDS = ("rollout", "train")  # the run's worker processes (the driver is "driver")


class CpuShare:
    """Processor sharing: the busy work of the simulated processes (replicas, training slots,
    the parent) next to `external` CPUs' worth of other runnable work. `speed(k)` is how fast
    each of k runnable processes progresses relative to one alone: with a measured contention
    curve (`LocalProfile.contention`, `curve[k-1]` the speed of each of k busy processes
    relative to one alone) that is the curve, linear between its points and, past its last
    point K, the same total throughput shared (curve[K-1] * K / n); without one it is processor
    sharing on `cores` CPUs, min(1, cores / n) (each process is one torch thread, as
    `runtime.torch_threads: 1` runs).

    Profiled costs (and the curve) were measured by the profile's own processes next to
    `profiled_external` CPUs' worth of other work, and the simulated run has `external` next to
    it: a number, or a piecewise-constant series `[(t, cpus), ...]` (from virtual time t on,
    until the next point; before the first point its value). With n busy simulated processes
    and E other runnable, each progresses at `rate(n, E)` relative to the profiled speed of one
    process alone: the curve read at n + E - profiled_external (so equal loads cancel and the
    curve is read as measured), or, where that is below one process (the run is quieter than the
    profile), processor sharing's min(1, cores / (n + E)) over the profile's own
    min(1, cores / (1 + profiled_external)), a speed-up over the profiled costs. Without a curve
    it is processor sharing throughout: min(1, cores / (n + E)) over the same.

    With `cpu_seconds` (a profile whose costs are CPU seconds, `LocalProfile.clock` "cpu") the
    costs hold no load at all: each of n busy processes next to E other runnable gets
    processor sharing's min(1, cores / (n + E)) of a CPU, and a CPU second of its work runs at
    the curve's speed read at n + E busy (`curve[k-1]`: work per CPU second with k busy over
    one alone, held past its last point); `profiled_external` plays no part.

    Nice weights need no term of their own: the others' runnable work is inferred from the
    CPU time they got (`run_mirror_measured`), and under CFS, D runnable at weight w next to
    the run's n at weight 1 share the CPUs as wD at weight 1 would (each cores / (n + wD) while
    no one's cap of one CPU binds): what is inferred is wD."""

    def __init__(self, cores: float, external: float | Sequence[tuple[float, float]] = 0.0,
                 profiled_external: float = 0.0, curve: list[float] | None = None,
                 cpu_seconds: bool = False, weights: dict[str, float] | None = None,
                 speed: float = 1.0) -> None:
        self.cores = max(1.0, float(cores))
        # the host's slowness against the profile's (`machine.speed_probe`: the run's probe
        # over the profile's): every profiled CPU second of work costs this many
        self.host_speed = max(1e-3, float(speed))
        # CFS weights of the run's processes by kind, relative to 1 (`runtime.rollout_nice`:
        # `nice_weight`); a kind not named has 1, as the other load has. With `cpu_seconds`
        # only (`_weighted`).
        self.weights = {k: float(w) for k, w in (weights or {}).items() if w != 1.0}
        self.cpu_seconds = cpu_seconds
        if isinstance(external, (int, float)):
            series = [(0.0, float(external))]
        else:
            series = sorted((float(t), float(v)) for t, v in external) or [(0.0, 0.0)]
        self.times = [t for t, _ in series]
        self.loads = [max(0.0, v) for _, v in series]
        self.external = self.loads[0]
        self.profiled_external = max(0.0, float(profiled_external))
        self.curve = [min(1.0, max(1e-3, float(v))) for v in (curve or [])]
        # one profiled process alone ran at this speed of an idle machine's (processor sharing)
        self.solo = min(1.0, self.cores / (1.0 + self.profiled_external))
        self.jobs: dict[int, list[Any]] = {}  # id -> [remaining work (s), future]
        self.last: float | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.busy_s = 0.0
        # (virtual start, who, profiled CPU seconds) of every piece of work: the run's own CPU
        # by process kind ("rollout", "train", "driver") over any stretch (`cpu_by_kind`)
        self.log: list[tuple[float, str, float]] = []
        self.got_s = 0.0  # CPU seconds the run's own processes got (`own_cpu_got_s`)
        self.others_s = 0.0  # CPU seconds the other load got (`others_cpu_s`)

    def speed(self, n: float) -> float:
        """How fast each of `n` runnable processes progresses (1.0: as fast as one alone)."""
        if n <= 1.0:
            return 1.0
        if not self.curve:
            return min(1.0, self.cores / n)
        curve = [1.0, *self.curve[1:]]
        last = len(curve)
        if n >= last:
            return curve[-1] * last / n
        lo = int(n)  # 1 <= lo < last
        frac = n - lo
        return curve[lo - 1] * (1.0 - frac) + curve[lo] * frac

    def efficiency(self, k: float) -> float:
        """The speed of a CPU second of work with `k` busy (the curve per CPU second), linear
        between its points, its last point past them; 1.0 without a curve."""
        if k <= 1.0 or not self.curve:
            return 1.0
        curve = [1.0, *self.curve[1:]]
        if k >= len(curve):
            return curve[-1]
        lo = int(k)
        return curve[lo - 1] * (1.0 - (k - lo)) + curve[lo] * (k - lo)

    def rate(self, n: float, external: float | None = None) -> float:
        """How fast each of `n` busy simulated processes progresses next to `external` other
        runnable work (default: the current), relative to the profiled speed of one alone."""
        e = self.external if external is None else max(0.0, external)
        if self.cpu_seconds:
            return min(1.0, self.cores / max(1.0, n + e)) * self.efficiency(n + e)
        shifted = n + e - self.profiled_external
        if self.curve and shifted >= 1.0:
            return self.speed(shifted)
        return min(1.0, self.cores / max(1.0, n + e)) / self.solo

    def external_at(self, t: float) -> float:
        """The other load at virtual time `t` (piecewise constant)."""
        return self.loads[max(0, bisect.bisect_right(self.times, t + 1e-9) - 1)]

    def _next_change(self, t: float) -> float | None:
        i = bisect.bisect_right(self.times, t + 1e-9)
        return self.times[i] if i < len(self.times) else None

    def _rate(self) -> float:
        return self.rate(len(self.jobs)) if self.jobs else 1.0

    def _weighted(self) -> bool:
        """Whether a busy job's weight differs from 1 (CPU-second profiles only: a wall-clock
        profile's costs hold its own load, shared equally)."""
        return self.cpu_seconds and bool(self.weights) and any(
            j[2] in self.weights for j in self.jobs.values())

    def _shares(self) -> tuple[dict[Any, float], float]:
        """The CPUs each busy job gets and the CPUs the other load gets: weighted processor
        sharing (a job's weight by its kind, the other runnable work weight 1 each), no one
        more than one CPU, what a capped one leaves shared by the rest (water filling)."""
        e = self.external
        weight: dict[Any, float] = {k: self.weights.get(j[2], 1.0) for k, j in self.jobs.items()}
        cap: dict[Any, float] = {**{k: 1.0 for k in weight}, "others": e}
        if e > 0:
            weight["others"] = e
        share: dict[Any, float] = {}
        left, free = dict(weight), self.cores
        while left:
            total = sum(left.values())
            fair = {k: free * w / total for k, w in left.items()}
            capped = [k for k, v in fair.items() if v >= cap[k]]
            if not capped:
                share.update(fair)
                break
            for k in capped:
                share[k] = cap[k]
                free -= cap[k]
                del left[k]
        others = share.pop("others", 0.0)
        return share, others

    def _advance(self, now: float) -> None:
        if self.last is not None:
            e = self.external
            weighted = self._weighted()
            if weighted:
                shares, others = self._shares()
                self.others_s += (now - self.last) * others
            elif e > 0:  # the others' CPU time meanwhile: each of them gets a runnable's share
                self.others_s += (now - self.last) * e * min(
                    1.0, self.cores / max(1.0, len(self.jobs) + e))
            if self.jobs:
                n = len(self.jobs)
                equal = min(1.0, self.cores / max(1.0, n + e))
                self.got_s += (now - self.last) * (sum(shares.values()) if weighted
                                                   else n * equal)
                done = (now - self.last) * self._rate()
                for key, job in self.jobs.items():
                    slow = self._slowdown(job)
                    # weighted: the job's share over the equal one
                    got = done * shares[key] / equal if weighted else done
                    job[0] -= got / slow
                    if slow != 1.0 and got > 0:  # the CPU it spent beyond its profiled work
                        self.log.append((self.last, job[2], got - got / slow))
                        self.busy_s += got - got / slow
        self.last = now
        self.external = self.external_at(now)

    def others_cpu_s(self, now: float) -> float:
        """CPU seconds the other runnable work got until `now` (processor sharing)."""
        self._advance(now)
        return self.others_s

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        for key in [k for k, j in self.jobs.items() if j[0] <= 1e-9]:
            fut = self.jobs.pop(key)[1]
            if not fut.done():
                fut.set_result(None)
        if self.jobs:
            if self._weighted():
                shares, _ = self._shares()
                equal = min(1.0, self.cores / max(1.0, len(self.jobs) + self.external))
                left = min(j[0] * self._slowdown(j) * equal / max(shares[k], 1e-9)
                           for k, j in self.jobs.items()) / self._rate()
            else:
                left = min(j[0] * self._slowdown(j) for j in self.jobs.values()) / self._rate()
            change = self._next_change(loop.time())  # the other load changes: a new rate
            if change is not None:
                left = min(left, max(0.0, change - loop.time()))
            self.handle = loop.call_later(left, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self.handle = None
        self._advance(loop.time())
        self._reschedule(loop)

    def _slowdown(self, job: list[Any]) -> float:
        """How many CPU seconds a job spends a profiled one while another of the run's worker
        processes (a replica, a training slot) is busy next to it (its `overlap`; 1.0 alone)."""
        if job[3] == 1.0:
            return 1.0
        others = sum(1 for j in self.jobs.values() if j is not job and j[2] in _WORKER_KINDS)
        return job[3] if others else 1.0

    async def run(self, seconds: float, who: str = "", overlap: float = 1.0) -> None:
        """`seconds` of one process's profiled CPU work (of a process of kind `who`),
        stretched (or shrunk) by the sharing; `overlap`: the CPU seconds it spends a profiled
        one while another of the run's worker processes is busy (`LocalProfile.overlap`)."""
        if seconds <= 0:
            return
        seconds *= self.host_speed
        loop = asyncio.get_running_loop()
        self.log.append((loop.time(), who, seconds))
        self._advance(loop.time())
        fut = loop.create_future()
        self.jobs[id(fut)] = [seconds, fut, who, max(1e-3, float(overlap))]
        self.busy_s += seconds
        self._reschedule(loop)
        try:
            await fut
        finally:
            if self.jobs.pop(id(fut), None) is not None:  # cancelled while running
                self._advance(loop.time())
                self._reschedule(loop)


class ParentProcess:
    """The orchestrator's own process: its per-request and per-training-call work, one piece
    at a time, on the shared CPUs; `scale` is what the run's pipeline mode costs it a request
    or call over a sync run (`LocalProfile.driver_scale`)."""

    def __init__(self, cpu: CpuShare, scale: float = 1.0) -> None:
        self.cpu = cpu
        self.scale = scale
        self.lock = asyncio.Lock()

    async def work(self, seconds: float) -> None:
        if seconds <= 0:
            return
        async with self.lock:
            await self.cpu.run(seconds * self.scale, "driver")


class Transfers:
    """Collective publications in flight: a replica's receive of (agent, version) starts once
    the slot's send has (`sent`) and lasts the profile's `driver["publish_s"]`; its end
    (`future(agent, version, replica)`) ends the slot's send to it (`pub_send` waits for
    every destination's)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = max(0.0, float(seconds))
        self.done: dict[tuple[str, int, int], asyncio.Future] = {}

    def future(self, agent: str, version: int, replica: int) -> asyncio.Future:
        key = (agent, version, replica)
        if key not in self.done:
            self.done[key] = asyncio.get_running_loop().create_future()
        return self.done[key]

    def sent(self, agent: str, version: int) -> asyncio.Future:
        return self.future(agent, version, -1)


def _cost(p: AgentProfile | None, name: str, **x: float) -> float:
    if p is None or name not in p.fits:
        return 0.0
    return max(0.0, p.fits[name](**x))


class _Common:
    def __init__(self, pool: str, index: int, profile: LocalProfile, sink: Any,
                 cpu: CpuShare, parent: ParentProcess) -> None:
        self.pool, self.index = pool, index
        self.profile = profile
        self.sink = sink
        self.cpu, self.parent = cpu, parent
        self.calls = 0
        self.alive = True
        self.outstanding_tokens = 0  # the balancer's load measure (`LocalRolloutPool`)

    def _ipc(self, name: str, **x: float) -> float:
        """One direction of a message. `ipc_generate` round trips carried n requests out and
        n replies back: half of it. `ipc_call` round trips carried the payload one way and a
        small reply back: half the fixed part, and all of the per-byte part."""
        fit = self.profile.ipc.get(name)
        if fit is None:
            return 0.0
        if name != "ipc_call":
            return max(0.0, fit(**x)) / 2
        fixed = fit.coef.get("1", 0.0)
        return max(0.0, fixed / 2 + fit(**x) - fixed)

    def _later(self, delay: float, fut: asyncio.Future, value: Any) -> None:
        def done() -> None:
            if not fut.done():
                fut.set_result(value)

        asyncio.get_running_loop().call_later(delay, done)


@dataclass
class _Seq:
    request: GenerationRequest
    out_len: int
    admitted: float
    generated: int = 0

    @property
    def width(self) -> int:
        return len(self.request.prompt) + self.generated

    @property
    def budget(self) -> int:
        return len(self.request.prompt) + self.request.max_new_tokens


class ProfiledEngine:
    """One model's continuous batch (the local `HFEngine`'s admission and budgets) whose
    prefills, decode steps and loads cost the profile's fitted times: each call adds its cost
    to `cost`, which the host then spends on the shared CPUs. Outputs are tokens drawn from
    each request's allowed tokens with the profile's lengths."""

    def __init__(self, agent: str, profile: LocalProfile, max_seqs: int, max_tokens: int,
                 clock: Any) -> None:
        self.agent = agent
        self.p = profile.agents.get(agent)
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.clock = clock
        self.seqs: list[_Seq] = []
        self.cost = 0.0
        self._new = 0  # this turn's newcomers, and those of them that finished at admission
        self._finished = 0
        self.event_turns = 0  # turns that admitted or answered something (the loop's work)

    @property
    def active(self) -> int:
        return len(self.seqs)

    def active_for(self, agent: str) -> int:
        return len(self.seqs)

    @staticmethod
    def _budget(request: GenerationRequest, seen: set[tuple]) -> int:
        """As `HFEngine.budget`: a prompt shared with a request already `seen` (running ones
        and earlier newcomers) holds its full blocks once."""
        key = (request.agent, request.version, tuple(request.prompt))
        full = len(request.prompt) + request.max_new_tokens
        if key in seen:
            return full - shared_prompt_tokens(len(request.prompt), BLOCK_SIZE)
        seen.add(key)
        return full

    def fits(self, request: GenerationRequest, take: Sequence[GenerationRequest] = ()) -> bool:
        active = len(self.seqs)
        if active + len(take) >= self.max_seqs:
            return False
        seen: set[tuple] = set()
        used = sum(self._budget(r, seen) for r in [*(s.request for s in self.seqs), *take])
        return used + self._budget(request, seen) <= self.max_tokens or (
            active + len(take)) == 0

    def _out_len(self, request: GenerationRequest) -> int:
        p = self.p
        cap = request.max_new_tokens
        if p is None or not request.stop_tokens or not p.output_lengths:
            return cap  # no stop token: the engine decodes exactly max_new_tokens
        rng = np.random.default_rng(stable_seed(0, "len", request.sample_id, request.version))
        return int(min(cap, p.output_lengths[int(rng.integers(len(p.output_lengths)))]))

    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Prefill of the newcomers; admission samples each one's first token."""
        self._new = len(requests)
        if not requests:
            return []
        now = self.clock()
        new = [_Seq(r, self._out_len(r), now) for r in requests]
        width = max(len(r.prompt) for r in requests)
        self.cost += _cost(self.p, "prefill", seqs=len(new), tokens=len(new) * width)
        finished: list[_Seq] = []
        for s in new:
            if s.out_len > 0:
                s.generated = 1
            (finished if s.generated >= s.out_len else self.seqs).append(s)
        self._finished = len(finished)
        return [self._result(s) for s in finished]

    def step(self) -> list[GenerationResult]:
        """One decode step of the batch, plus the loop's own work in a turn that admitted or
        answered something (the newcomers' messages, the replies)."""
        finished: list[_Seq] = []
        if self.seqs:
            width = max(s.width for s in self.seqs)
            self.cost += _cost(self.p, "decode", seqs=len(self.seqs),
                               tokens=len(self.seqs) * (width + 1))
            still: list[_Seq] = []
            for s in self.seqs:
                s.generated += 1
                (finished if s.generated >= s.out_len else still).append(s)
            self.seqs = still
        answered = self._finished + len(finished)
        if answered or self._new:
            self.event_turns += 1
            over = self.p.fits.get("replica_overhead") if self.p is not None else None
            if over is not None:
                self.cost += max(0.0, over(requests=self._new))
        self._new = self._finished = 0
        return [self._result(s) for s in finished]

    def load_weights(self, weights: Any, agent: str | None = None) -> None:
        self.cost += _cost(self.p, "load_weights")

    def reset(self) -> None:
        self.seqs = []

    def take_cost(self) -> float:
        cost, self.cost = self.cost, 0.0
        return cost

    def _result(self, s: _Seq) -> GenerationResult:
        r = s.request
        rng = np.random.default_rng(stable_seed(r.seed, "tok", r.sample_id, r.version))
        pool = r.allowed_tokens or [3]
        tokens = [int(t) for t in rng.choice(pool, size=s.out_len)] if s.out_len else []
        if r.stop_tokens and tokens and s.out_len < r.max_new_tokens:
            tokens[-1] = r.stop_tokens[0]
        return GenerationResult(r.sample_id, tokens, [-1.0] * len(tokens), r.version,
                                admitted_at=s.admitted)


class SimRolloutWorker(_Common):
    """One rollout replica process of the local runtime, in virtual time: the production
    `ReplicaScheduler` over one `ProfiledEngine` per local agent."""

    def __init__(self, index: int, agents: list[str], profile: LocalProfile, max_seqs: int,
                 max_tokens: int, sink: Any, cpu: CpuShare, parent: ParentProcess) -> None:
        super().__init__("rollout", index, profile, sink, cpu, parent)
        self.agents = agents
        loop = asyncio.get_running_loop()
        self.engines = {a: ProfiledEngine(a, profile, max_seqs, max_tokens, loop.time)
                        for a in agents}
        self.sched = ReplicaScheduler({a: [a] for a in agents}, dict(self.engines),
                                      max_batch_seqs=max_seqs)
        # (future, agent, version, collective: the replica receives the weights first)
        self.loads: list[tuple[asyncio.Future, str, int, bool]] = []
        self.transfers: Transfers | None = None  # collective publication (`run_mirror`)
        self.generation = index  # the pair key's (`Publisher`): never restarted
        self.wake = asyncio.Event()
        self._outbox: list[tuple[asyncio.Future, GenerationRequest, tuple]] = []
        self._pending: set[asyncio.Task] = set()
        self.task = asyncio.ensure_future(self._run())

    # --- the parent's side (WorkerProxy's interface) -----------------------------------------
    def submit(self, request: GenerationRequest, priority: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append((fut, request, priority))
        return fut

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        task = asyncio.ensure_future(self._send(batch))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, batch: list) -> None:
        self.calls += len(batch)
        await self.parent.work(self.profile.parent_per_request_s * len(batch))
        await asyncio.sleep(self._ipc("ipc_generate", requests=len(batch)))
        for fut, request, priority in batch:
            self.sched.submit(fut, request, priority)
        self.wake.set()

    async def call(self, command: str, payload: Any, watched: bool = True) -> Any:
        """`load_weights` (`load_collective`: the ref of a collective publication), and under
        `runtime.colocate` `sleep` / `wake`: their message round
        trip and what the replica's engines of the named agents (None: all) spend on them
        (the profile's `sleep` / `wake`, measured on the real engine: on a CPU the KV pool is
        freed and allocated again, the weights stay where they are)."""
        if command in ("sleep", "wake"):
            await asyncio.sleep(self._ipc("ipc_call", bytes=0))
            named = self.agents if payload is None else [a for a in payload if a in self.engines]
            cost = sum(_cost(self.engines[a].p, command) for a in named)
            t0 = asyncio.get_running_loop().time()
            await self.cpu.run(cost, "rollout")
            if cost > 0:
                who = "+".join(payload) if payload else ""
                self.sink.span("rollout", self.index, t0, asyncio.get_running_loop().time(),
                               f"{command}:{who}")
            await asyncio.sleep(self._ipc("ipc_call", bytes=0))
            return {"kv_bytes": 0, "weight_bytes": 0}
        if command == "load_collective":
            ref = payload[0]
            fut = asyncio.get_running_loop().create_future()
            await asyncio.sleep(self._ipc("ipc_call", bytes=len(ref.header) + 256))
            self.loads.append((fut, ref.agent, ref.version, True))
            self.wake.set()
            return await fut
        if command != "load_weights":
            raise ValueError(f"simulated rollout worker: unknown command {command!r}")
        agent, version, _ = payload
        fut = asyncio.get_running_loop().create_future()
        await asyncio.sleep(self._ipc("ipc_call", bytes=self.profile.agents[agent].weights_bytes))
        self.loads.append((fut, agent, version, False))
        self.wake.set()
        return await fut

    async def stop(self, timeout: float = 0.0) -> None:
        self.alive = False
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    # --- the worker's loop -------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.sched
        while True:
            loads, self.loads = self.loads, []
            for fut, agent, version, collective in loads:
                if collective and self.transfers is not None:
                    # the real loop blocks in the receive until the slot's send is done
                    await self.transfers.sent(agent, version)
                    await asyncio.sleep(self.transfers.seconds)
                    done = self.transfers.future(agent, version, self.index)
                    if not done.done():
                        done.set_result(None)
                await self._loaded(sched.load(fut, agent, version, None))
            await self._loaded(sched.apply_deferred())
            if self.loads:  # a load that came in while the one before it ran
                continue
            if not sched.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = loop.time()
            events = sched.step()
            group = sched.last_group
            cost = self.engines[group].take_cost() if group is not None else 0.0
            if cost:
                await self.cpu.run(cost * self.profile.scale("rollout"), "rollout")
            now = loop.time()
            if group is not None:  # busy, as the real one
                self.sink.span("rollout", self.index, t0, now, f"gen:{group}")
            await self._loaded(events)
            finished = [ev for ev in events if isinstance(ev, Reply)]
            delay = self._ipc("ipc_generate", requests=len(finished)) if finished else 0.0
            for ev in finished:
                if ev.ok:
                    ev.result.finished_at = now
                    self._later(delay, ev.key, ev.result)
                elif not ev.key.done():  # older than the replica: never served
                    ev.key.set_exception(WorkerLost(str(ev.result)))

    async def _loaded(self, events: list[Any]) -> None:
        """Each load costs its profiled time on the shared CPUs, then answers its caller."""
        loop = asyncio.get_running_loop()
        for ev in events:
            if not isinstance(ev, Loaded):
                continue
            t0 = loop.time()
            await self.cpu.run(self.engines[ev.agent].take_cost(), "rollout")
            self.sink.span("rollout", self.index, t0, loop.time(), f"load:{ev.agent}")
            self._later(self._ipc("ipc_call", bytes=0), ev.key, ev.version)


class SimTrainWorker(_Common):
    """One training slot process of the local runtime, in virtual time: one command at a time,
    the slot protocol's results from `training.digest_host.DigestSlotHost` (no models), its work
    the profile's costs (a first `bind` of an agent builds its trainer, later ones swap it in)."""

    def __init__(self, index: int, profile: LocalProfile, sink: Any, cpu: CpuShare,
                 parent: ParentProcess, split: dict[str, int] | None = None) -> None:
        super().__init__("train", index, profile, sink, cpu, parent)
        # per agent, the trainer's `model.split_call_tokens` on CPU (`length_split`)
        self.split = split or {}
        # the last command sent: each runs after the one sent before it is done (the pipe's
        # order, one at a time), whatever their transfer times (a micro-batch sent ahead of a
        # small one, ...)
        self._tail: asyncio.Future | None = None
        # who is resident, versions, results; a swapped-out state stays parked here, as in a
        # real slot's kept trainer, and comes back as `("kept", token)` (`TrainHost.bind`)
        self.host = DigestSlotHost(parks=True)
        self.generation = index  # `LocalTrainPool._slot_generation`: never restarted
        self.built: set[str] = set()
        # a profile that measured the token path prices a kept swap-in as one; an older one
        # did not, and simulates as before (the state sent and swapped in)
        self.kept_priced = any("swap_in_kept" in a.fits for a in profile.agents.values())
        self.transfers: Transfers | None = None  # collective publication (`run_mirror`)

    def _payload_bytes(self, command: str, payload: Any) -> int:
        if command in ("accumulate",):
            return len(pickle.dumps(payload))
        if command in ("step", "weights", "get_state"):
            return 0
        if command == "bind" and payload[1] is not None and not (
                self.kept_priced and payload[1][0] == "kept"):
            return 3 * self.profile.agents[payload[0]].weights_bytes  # weights + Adam moments
        return 256

    async def call(self, command: str, payload: Any, watched: bool = True) -> Any:
        loop = asyncio.get_running_loop()
        self.calls += 1
        if command == "pub_send":  # the slot's side thread: not in the commands' order
            await self.parent.work(self.profile.parent_per_train_call_s)
            return await self._pub_send(*payload)
        before, mine = self._tail, loop.create_future()
        self._tail = mine
        try:
            await self.parent.work(self.profile.parent_per_train_call_s)
            await asyncio.sleep(self._ipc("ipc_call",
                                          bytes=self._payload_bytes(command, payload)))
            if before is not None:
                await asyncio.shield(before)
            result, reply_bytes = await self._command(loop, command, payload)
        finally:
            mine.set_result(None)
        await asyncio.sleep(self._ipc("ipc_call", bytes=reply_bytes))
        return result

    async def _command(self, loop: asyncio.AbstractEventLoop, command: str,
                       payload: Any) -> tuple[Any, int]:
        """One command on the slot: its result and its reply's bytes."""
        t0 = loop.time()
        result, cost, reply_bytes, agent = self._run(command, payload)
        if self.transfers is not None and command in ("step", "weights"):
            # collective publication: the slot keeps the weights, the driver gets a ref
            ref = PublishedRef(agent, self.host.states[agent][1], b"{}",
                               self.profile.agents[agent].weights_bytes)
            result, reply_bytes = ((result[0], ref) if command == "step" else ref), 256
        kind = f"train_{command}"
        await self.cpu.run(cost * self.profile.scale(kind), "train",
                           self.profile.overlap.get(kind, 1.0))
        # the real slot's label (`TrainHost.SPAN_LABELS`): `swap:` spans are the records'
        # `pool/train/swaps`
        label = TrainHost.SPAN_LABELS.get(command, command)
        count = f":{len(payload[1])}" if command == "accumulate" else ""
        self.sink.span("train", self.index, t0, loop.time(), f"{label}:{agent}{count}")
        return result, reply_bytes

    async def _pub_send(self, agent: str, version: int, dests: list[Any]) -> list[None]:
        """A collective publication's send (the real slot's side thread: beside its commands,
        not behind them), done when every destination replica has received it."""
        assert self.transfers is not None
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self._ipc("ipc_call", bytes=256))
        t0 = loop.time()
        sent = self.transfers.sent(agent, version)
        if not sent.done():
            sent.set_result(None)
        await asyncio.gather(*(self.transfers.future(agent, version, i)
                               for i in range(len(dests))))
        for i in (-1, *range(len(dests))):
            self.transfers.done.pop((agent, version, i), None)
        self.sink.span("train", self.index, t0, loop.time(), f"publish:{agent}")
        await asyncio.sleep(self._ipc("ipc_call", bytes=64))
        return [None] * len(dests)

    def _run(self, command: str, payload: Any) -> tuple[Any, float, int, str]:
        """The command's result (the slot protocol, kept by `DigestSlotHost`), its profiled CPU
        seconds, the reply's bytes, and its agent."""
        prof = self.profile.agents
        agent = payload if isinstance(payload, str) else payload[0]
        resident = self.host.resident
        result = self.host.handle(command, payload)
        if command == "bind":
            cost, reply = 0.0, 0
            if resident is not None and resident != agent:
                cost += _cost(prof.get(resident), "swap_out")
                reply = 3 * prof[resident].weights_bytes  # weights + two Adam moments
            if resident != agent:
                first = payload[1] is None and agent not in self.built
                kept = (self.kept_priced and payload[1] is not None
                        and payload[1][0] == "kept")  # only the RNG put back: the token path
                cost += _cost(prof.get(agent), "build" if first else
                              "swap_in_kept" if kept else "swap_in")
                self.built.add(agent)
            return result, cost, reply, agent
        if command == "accumulate":
            # one forward and backward per run of the trainer's split by length
            lengths = [len(s.prompt) + len(s.response) for s in payload[1]]
            cost = sum(_cost(prof.get(agent), "accumulate", rows=len(run),
                             tokens=len(run) * max(lengths[i] for i in run))
                       for run in length_split(lengths, self.split.get(agent, 0)))
            return result, cost, 64, agent
        nbytes = prof[agent].weights_bytes
        fit, reply = {"step": ("step", nbytes), "weights": ("weights", nbytes),
                      "get_state": ("get_state", 3 * nbytes), "set_state": ("swap_in", 64),
                      "save": ("", 64)}[command]  # "": no cost
        return result, _cost(prof.get(agent), fit), reply, agent


@dataclass
class MirrorResult:
    records: list[dict[str, Any]]
    requests: int
    makespan_s: float
    per_iteration_s: float
    steady_per_iteration_s: float
    spans: list[Any]
    train_calls: int = 0
    other_cpus: float = 0.0  # CPUs' worth of time the other load got over the makespan
    other_runnable: float = 0.0  # the other runnable work simulated (`run_mirror_measured`)
    own_cpu_s: float = 0.0  # the CPU seconds of the run's own simulated work
    cpu_log: list[tuple[float, str, float]] = field(default_factory=list)  # `CpuShare.log`
    # the CPU time the run's own processes got (processor sharing; more than `own_cpu_s`
    # where contention slows a CPU second): what a real run's own CPUs measure
    own_cpu_got_s: float = 0.0
    # the orchestrator's instant events (`Telemetry.event`: `rollout_plan` ...), as a real
    # run's trace.json holds them: {"name", "time" (virtual seconds), ...}
    events: list[dict[str, Any]] = field(default_factory=list)

    def cpu_by_kind(self, after_first: bool = True) -> dict[str, float]:
        """The run's own profiled CPU seconds an iteration by process kind (rollout, train,
        driver), over the iterations after the first (as `benchmarks/pipeline_cpu.py` reads a
        real run's) or, with `after_first` False, over all of them."""
        n = len(self.records)
        start = float(self.records[0]["time_s"]) if after_first and n > 1 else 0.0
        its = n - 1 if after_first and n > 1 else max(1, n)
        out: dict[str, float] = defaultdict(float)
        for t, who, seconds in self.cpu_log:
            if t >= start - 1e-9:
                out[who] += seconds / its
        return dict(out)


def per_iteration(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean s/iteration over the run, mean over iterations after the first) from `time_s`."""
    if not records:
        return 0.0, 0.0
    times = [float(r["time_s"]) for r in records]
    mean = times[-1] / len(times)
    steady = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else mean
    return mean, steady


def mirror_config(cfg: RunConfig, iterations: int | None = None,
                  mode: str | None = None) -> RunConfig:
    update: dict[str, Any] = {}
    if iterations is not None:
        update["train"] = cfg.train.model_copy(update={"iterations": iterations})
    if mode is not None:
        update["pipeline"] = cfg.pipeline.model_copy(update={"mode": mode})
    return cfg.model_copy(update=update) if update else cfg


def run_mirror(cfg: RunConfig, task: Any, profile: LocalProfile, *,
               iterations: int | None = None, mode: str | None = None,
               cores: float | None = None,
               external: float | Sequence[tuple[float, float]] | None = None,
               profiled_external: float | None = None, speed: float = 1.0) -> MirrorResult:
    """Run the production orchestrator on the mirrored local runtime. `cores` overrides the
    profile's CPU count; `external` is the simulated run's other runnable work in CPUs (a
    number, or a series `[(virtual t, cpus), ...]`, see `CpuShare`) next to the
    `profiled_external` the profile was measured under (default `machine.profiled_load`: other
    users' work during the profiling, or an older profile's probe); with `external` None the run
    sees the profile's load, and the profiled costs and curve are used as measured. `speed`:
    the host's speed probe during the simulated run over the profile's
    (`CpuShare.host_speed`)."""
    cfg = mirror_config(cfg, iterations, mode)
    rt = cfg.runtime
    agents = list(cfg.agents)
    trainable = [a for a in agents if cfg.agents[a].trainable]
    local = [a for a in agents if cfg.agents[a].backend.kind != "openai"]
    if len(local) != len(agents):
        raise ValueError("--profile-local: agents served by an external endpoint cannot be "
                         "profiled on this machine")
    workers: list[_Common] = []
    spans: list[Any] = []
    events: list[dict[str, Any]] = []
    shares: list[CpuShare] = []

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        telemetry = Telemetry(None, clock=loop.time)
        telemetry.spans = spans
        telemetry.events = events
        max_seqs = 1 if rt.deterministic else cfg.rollout.max_batch_seqs
        machine = profile.machine
        # the profiled costs are typical costs at the profile's load (medians): without
        # `external` only this run's own processes share the CPUs, at the machine's measured
        # speed with n busy processes (unless `cores` asks for another core count); with it,
        # the difference between the run's other load and the profile's is simulated
        ext: float | Sequence[tuple[float, float]] = 0.0
        prof_ext = 0.0
        cpu_seconds = profile.clock == "cpu"
        if external is not None:
            ext = external
            prof_ext = (profiled_load(machine) if profiled_external is None
                        else profiled_external)
        elif cpu_seconds:  # costs without load: the profile's own load, simulated
            ext = profiled_load(machine)
        ncores = cores or machine.get("cpus") or 1
        # the real runtime's niceness of its replicas (`runtime.rollout_nice`) on these cores
        nice = rollout_nice(cfg, "cpu", rt.rollout_workers,
                            max(1, min(rt.train_workers, len(trainable))), cores=int(ncores))
        cpu = CpuShare(ncores, ext, prof_ext,
                       curve=None if cores else profile.contention, cpu_seconds=cpu_seconds,
                       weights={"rollout": nice_weight(nice)}, speed=speed)
        shares.append(cpu)
        parent = ParentProcess(cpu, profile.driver_scale(cfg.pipeline.mode))
        kv_budget = cfg.rollout.max_batch_tokens or CPU_MAX_BATCH_TOKENS
        rworkers = [SimRolloutWorker(i, local, profile, max_seqs, kv_budget, telemetry, cpu,
                                     parent) for i in range(rt.rollout_workers)]
        split = {a: split_call_tokens(cfg.agents[a], "cpu") for a in trainable}
        tworkers = [SimTrainWorker(i, profile, telemetry, cpu, parent, split)
                    for i in range(max(1, min(rt.train_workers, len(trainable))))]
        workers.extend(rworkers)
        workers.extend(tworkers)
        costs = {a: float(approx_params(cfg.agents[a].model, task.vocab_size)) for a in local}
        balancer = Balancer(local, rt.rollout_workers, cfg.rollout.balance, costs)
        rollout = LocalRolloutPool(rworkers, balancer)  # type: ignore[arg-type]
        if time_shared(cfg):
            rollout.take_turns(local)
        train = LocalTrainPool(tworkers)  # type: ignore[arg-type]
        publish_s = profile.driver.get("publish_s")
        if (publish_s is not None and trainable
                and publication_mode(rt.publication, cfg.pipeline.mode) == "collective"):
            transfers = Transfers(publish_s)
            for w in workers:
                w.transfers = transfers  # type: ignore[attr-defined]
            rollout.publisher = Publisher(
                tworkers, {"train": [Placement()] * len(tworkers),  # type: ignore[arg-type]
                           "rollout": [Placement()] * len(rworkers)})
        if rt.train_binding == "fixed":
            train.fix_slots(fixed_binding(trainable, [1] * len(tworkers), {}))
        try:
            if rt.max_worker_restarts > 0:  # the supervisor's restart points, as in the runtime

                async def never_lost(*_: Any) -> None:
                    raise WorkerLost("simulated workers are never lost")

                train.on_lost = never_lost
                rollout.on_lost = never_lost
                for agent in trainable:
                    await train.keep_restart_point(agent)
            orch = JointOrchestrator(cfg, task, rollout, train, telemetry)
            return await orch.run()
        finally:
            for w in rworkers:
                await w.stop()

    records = run_virtual(main())
    mean, steady = per_iteration(records)
    makespan = float(records[-1]["time_s"]) if records else 0.0
    requests = sum(w.calls for w in workers if w.pool == "rollout")
    train_calls = sum(w.calls for w in workers if w.pool == "train")
    others = shares[0].others_cpu_s(makespan) / makespan if shares and makespan > 0 else 0.0
    runnable = shares[0].external if shares else 0.0
    return MirrorResult(records, requests, makespan, mean, steady, spans, train_calls, others,
                        runnable, shares[0].busy_s if shares else 0.0,
                        shares[0].log if shares else [],
                        shares[0].got_s if shares else 0.0, events)


def run_mirror_measured(cfg: RunConfig, task: Any, profile: LocalProfile, other_cpus: float,
                        tries: int = 6, series: Sequence[tuple[float, float]] | None = None,
                        makespan: float = 0.0, **kw: Any) -> MirrorResult:
    """The mirror next to other users' work as a real run measured it: `other_cpus`, the CPU
    time they got during the run (`OtherLoad`), in CPUs. For a CPU-second profile that is not
    their runnable work: on a saturated machine they get only their processor share of it
    next to the run's own busy processes (2 CPUs, 1 busy of ours and 3 runnable of theirs:
    they get 1.5 CPUs). The runnable work is inferred so that, in the simulated run, the
    others get the CPU time they got in the real one (secant steps on the runnable work,
    `tries` runs at most, within 3%). A wall-clock profile is simulated with `other_cpus` as
    its other load.

    With `series` (what they got window by window over the real iterations, `[(t, cpus),
    ...]`, t since the first began; `makespan` the iterations' real length) the runnable work
    follows the series' shape (each window's in proportion to what the others got in it,
    placed at the same fraction of the simulated iterations, `series_on_progress`) and its
    level is inferred as above, starting from the mean's: load that comes in bursts costs
    what it cost, not what its mean would."""
    if profile.clock != "cpu" or other_cpus <= 0:
        return run_mirror(cfg, task, profile, external=other_cpus, **kw)
    mean = _series_mean(series) if series else 0.0
    if series and mean > 0 and makespan > 0:
        sim = run_mirror_measured(cfg, task, profile, other_cpus, tries=3, **kw)
        level, placed = max(1e-3, sim.other_runnable), sim.makespan_s

        def external(runnable: float) -> Any:
            return [(t, runnable * v / mean)
                    for t, v in series_on_progress(series, makespan, placed)]
    else:
        level = other_cpus

        def external(runnable: float) -> Any:
            return runnable

    runnable = level
    sim = run_mirror(cfg, task, profile, external=external(runnable), **kw)
    sim.other_runnable = runnable
    best = sim
    last: tuple[float, float] | None = None
    for _ in range(tries - 1):
        got = sim.other_cpus
        if got <= 0 or abs(got - other_cpus) <= 0.03 * other_cpus:
            break
        if last is not None and abs(got - last[1]) > 1e-9:
            step = runnable + (other_cpus - got) * (runnable - last[0]) / (got - last[1])
        else:  # a first step: as if the others' share grew with their runnable work
            step = runnable * other_cpus / got
        last = (runnable, got)
        runnable = min(64.0, max(1e-3, step))
        if series and mean > 0 and makespan > 0:
            placed = sim.makespan_s  # the series follows the simulated run's length
        sim = run_mirror(cfg, task, profile, external=external(runnable), **kw)
        sim.other_runnable = runnable
        if abs(sim.other_cpus - other_cpus) < abs(best.other_cpus - other_cpus):
            best = sim
    return best


def _series_mean(series: Sequence[tuple[float, float]]) -> float:
    """The time-weighted mean of `[(t, value), ...]` (each value over the interval ending
    at t, the first from 0)."""
    total = weight = prev = 0.0
    for t, v in series:
        total += float(v) * max(0.0, float(t) - prev)
        weight += max(0.0, float(t) - prev)
        prev = float(t)
    return total / weight if weight > 0 else 0.0


def series_on_progress(series: Sequence[tuple[float, float]], makespan: float,
                       simulated: float) -> list[tuple[float, float]]:
    """A real run's other load over its iterations (`[(t, cpus), ...]`, t in seconds since
    its first iteration began, each point the load over the interval ending at t) as
    piecewise-constant points in a simulated run's virtual time (`CpuShare`: from t on): the
    load at a fraction of the real iterations elapsed applies at that fraction of the
    simulated ones."""
    points: list[tuple[float, float]] = []
    prev = 0.0
    for t, v in series:
        if float(t) > prev and makespan > 0:
            points.append((prev / makespan * simulated, float(v)))
        prev = float(t)
    return points or [(0.0, 0.0)]

