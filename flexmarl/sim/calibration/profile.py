"""Measured per-token costs of this machine for one local run config: `flexmarl simulate
--profile-local CONFIG`.

For every agent's real model, with the real engine and trainer code (`rollout.engine.HFEngine`,
`training.trainer.AgentTrainer`, `training.host.TrainHost`), in this process and with the
config's `runtime.torch_threads`, the profiler times, in this process's CPU seconds (so that
other users' work preempting it does not end up in the costs; the mirror simulates the load
of each run instead: `LocalProfile.clock` "cpu"):

- `prefill`: `HFEngine.admit` of `seqs` new requests, left-padded to `width` prompt tokens
  (`tokens` = seqs x width), including the first token's sampling;
- `decode`: one `HFEngine.step` of a batch of `seqs` sequences whose KV rows are `width` wide
  (`tokens` = seqs x width), including sampling;
- `load_weights`: a replica loading published weights (wire form -> tensors -> model);
- `accumulate`: `AgentTrainer.accumulate` (forward + backward) of `rows` samples padded to a
  common width (`tokens` = rows x width);
- `step`: the training worker's `step` command: optimizer step plus the published weights'
  wire form; `weights`: the wire form alone;
- `swap_out` / `swap_in` / `get_state`: a training slot changing its resident agent (state
  capture + wire form; restore into the kept trainer) and the restart point the supervisor keeps;

and, through the real `WorkerProxy` and a spawned echo process speaking the worker protocol,
the message round trips of the local runtime (`ipc_generate`: a batch of `requests`;
`ipc_call`: one command carrying `rows` samples or one set of weights, by `bytes`). Also
`sleep` / `wake` (`runtime.colocate`: an engine's KV pool freed and allocated again, the first
batch after waking included) and `swap_in_kept` (a swap-in back to the process the state left:
the token path). Then `worker_scale`: real worker processes given the run's order of work (a
replica: batches with the agents' measured output lengths), over the fits' prediction, their
busy spans turned into CPU seconds by the share of them each process spent on a CPU (`_OnCpu`,
from /proc); `overlap`: the same training worker's commands with a real replica decoding next
to it, over their cost alone. Finally the driver (`driver`, `parent_per_request_s`,
`parent_per_train_call_s`): the driver process's own CPU (the scheduler's counters) in real
runs of the config, a sync one's rollout phase per generate request and the rest per training
call, and an async one's CPU an iteration over what those charge (`measure_driver`); the
zero-cost-worker measure (`measure_parent_overhead`) is kept beside it as `driver["echo_*"]`.
Before all of it,
`contention`: how fast a CPU second of each of k processes busy at once goes on this machine
(spawned processes doing torch work of the config's model sizes, work done per CPU second
counted; see `measure_contention`). Every repeated quantity's spread over its rounds
((max - min) / median) is kept in `spread` and logged.

Each quantity is fitted by least squares to a small named linear model (`fits.Fit`: a fixed
overhead `1` plus per-sequence / per-token terms; negative coefficients are dropped and the fit
redone). The output lengths are taken from a short real run (one sync iteration of the config
on the local runtime): a node whose requests have no stop tokens always
decodes exactly `max_new_tokens`; otherwise the simulator draws from the measured lengths.

The profile is JSON (`fits.LocalProfile.save` / `load`), written next to the run; the machine's
load and contention measures are in `machine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import pickle
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexmarl.api.runtime import NullSink
from flexmarl.orchestrator.joint import JointOrchestrator
from flexmarl.orchestrator.run import train
from flexmarl.policy.device import Placement, computing_on, plan_placements
from flexmarl.policy.model import build_model, weights_of
from flexmarl.rollout.balancer import Balancer
from flexmarl.rollout.engine import HFEngine
from flexmarl.runtime.local.runtime import (
    LocalRolloutPool,
    LocalRuntime,
    LocalTrainPool,
    WorkerProxy,
)
from flexmarl.runtime.local.workers import (
    WorkerSpec,
    rollout_worker_main,
    train_worker_main,
)
from flexmarl.sim.calibration.fits import AgentProfile, Fit, LocalProfile, constant, fit_linear
from flexmarl.sim.calibration.machine import (
    OtherLoad,
    machine_info,
    measure_contention,
    measure_external_load,
    on_cpu_share,
    sched_times_s,
    speed_probe,
    tree_cpu_s,
)
from flexmarl.sim.calibration.mirror import ProfiledEngine, mirror_config, run_mirror
from flexmarl.sim.calibration.waits import figures
from flexmarl.telemetry.recorder import Telemetry, read_trace
from flexmarl.training import state as st
from flexmarl.training.host import TrainHost
from flexmarl.training.state import from_numpy, publish_form, state_to_numpy
from flexmarl.types import Bound, GenerationRequest, GenerationResult, Sample

# --- measurement helpers ----------------------------------------------------------------------
# How repeated timings of one point are summarised: the median is the typical cost at the
# machine's current load (what a run sees next to the same load); "min" the least-disturbed one.
STATISTIC = "median"


# Work is timed in this process's CPU seconds, not wall seconds: a timing that other users'
# processes preempted reads the same as one they did not, so a profile taken on a busy machine
# holds the same costs as one taken on a quiet one, and the mirror shares the CPUs among the
# run's processes and the run's own other load (`CpuShare`, `LocalProfile.clock` "cpu").
# On a GPU a call returns before its kernels ran and its CPU time is only their launches: there
# it is timed in wall seconds once the device has drained (`_on_gpu`, set by `profile_local`
# when the run's pools are on CUDA).
_on_gpu: list[torch.device] = []


def _clock() -> float:
    if _on_gpu:
        torch.cuda.synchronize(_on_gpu[0])
        return time.perf_counter()
    return time.process_time()


def run_placements(cfg: Any) -> tuple[Placement, Placement] | None:
    """Worker 0's placement of the rollout and the training pool when the run computes on CUDA
    (the profiler measures there); None on the CPU, where the probes keep the default."""
    rollout, train = plan_placements(cfg.runtime, 1, 1)
    return (rollout[0], train[0]) if rollout[0].kind == "cuda" else None


def _stat(xs: Sequence[float]) -> float:
    return float(min(xs) if STATISTIC == "min" else statistics.median(xs))


def _timed(fn: Callable[[], Any], reps: int = 5) -> float:
    """`_stat` of the CPU times of `fn` over `reps` runs (after the caller's warm-up)."""
    out = []
    for _ in range(reps):
        t0 = _clock()
        fn()
        out.append(_clock() - t0)
    return _stat(out)


def _grid(upper: int, points: Sequence[int]) -> list[int]:
    return sorted({max(1, min(upper, p)) for p in points})


def profile_engine(model: Any, max_seqs: int, max_width: int, vocab: int,
                   reps: int = 5) -> dict[str, Fit]:
    """Prefill and decode of one model through the real continuous batcher."""
    engine = HFEngine(model, max_seqs)
    rng = np.random.default_rng(0)
    ids = iter(range(1 << 30))

    def requests(n: int, width: int) -> list[GenerationRequest]:
        return [GenerationRequest(f"p{next(ids)}", "profile", 0,
                                  rng.integers(3, vocab, size=width).tolist(), 1 << 20)
                for _ in range(n)]

    seqs_grid = _grid(max_seqs, [1, 4, 16, max_seqs])
    width_grid = _grid(max_width, [1, max_width // 4, max_width // 2, max_width])
    engine.admit(requests(2, 2))  # warm-up
    engine.step()
    engine.reset()
    px, py, dx, dy = [], [], [], []
    for n in seqs_grid:
        for w in width_grid:
            times = []
            for _ in range(reps):
                batch = requests(n, w)
                t0 = _clock()
                engine.admit(batch)
                times.append(_clock() - t0)
                engine.reset()
            px.append({"seqs": n, "tokens": n * w})
            py.append(_stat(times))
            engine.admit(requests(n, w))
            engine.step()  # the first step after admission: not a steady one
            steps = []
            for _ in range(reps):
                t0 = _clock()
                engine.step()
                steps.append(_clock() - t0)
            dx.append({"seqs": n, "tokens": n * (w + 2 + reps / 2)})
            dy.append(_stat(steps))
            engine.reset()
    sleeps, wakes = _sleep_wake(engine, requests, seqs_grid[len(seqs_grid) // 2],
                                width_grid[len(width_grid) // 2], reps)
    return {"prefill": fit_linear(["1", "seqs", "tokens"], px, py),
            "decode": fit_linear(["1", "seqs", "tokens"], dx, dy),
            "sleep": constant(sleeps, STATISTIC), "wake": constant(wakes, STATISTIC)}


def _sleep_wake(engine: HFEngine, requests: Callable[[int, int], list[GenerationRequest]],
                n: int, width: int, reps: int) -> tuple[list[float], list[float]]:
    """`runtime.colocate`'s sleep and wake of one engine (`HFEngine.sleep` / `wake`: on a CPU
    its KV pool freed, then allocated again), the wake with what the first batch after it
    costs beyond the same batch on an engine that stayed awake (tables built again)."""
    sleeps, wakes = [], []
    for _ in range(reps):
        engine.admit(requests(n, width))
        engine.step()
        engine.reset()
        t0 = _clock()
        engine.sleep()
        sleeps.append(_clock() - t0)
        t0 = _clock()
        engine.wake()
        engine.admit(requests(n, width))
        engine.step()
        woke = _clock() - t0
        engine.reset()
        t0 = _clock()
        engine.admit(requests(n, width))
        engine.step()
        awake = _clock() - t0
        engine.reset()
        wakes.append(max(0.0, woke - awake))
    return sleeps, wakes


def _samples(n: int, prompt: int, response: int, vocab: int, version: int, tag: str,
             allowed: list[int] | None) -> list[Any]:

    rng = np.random.default_rng(n * 1000 + prompt)
    pool = allowed or list(range(3, vocab))
    return [Sample(f"{tag}-{i}", rng.integers(3, vocab, size=prompt).tolist(),
                   [int(t) for t in rng.choice(pool, size=response)],
                   [-1.0] * response, float(rng.normal()), allowed, 1.0, version)
            for i in range(n)]


def profile_trainer(cfg: Any, agent: str, vocab: int, max_seq_len: int,
                    prompt_len: int, response_len: int, allowed: list[int] | None,
                    reps: int = 5) -> dict[str, Fit]:
    """accumulate / step / weights / swap / get_state of one agent's real trainer."""
    slot = TrainHost(cfg, vocab, max_seq_len)
    t0 = _clock()
    slot.bind(agent, None)
    build_s = _clock() - t0
    trainer = slot.trainers[agent]
    mb = cfg.train.micro_batch_size
    rows_grid = _grid(max(mb, 1), [1, 4, mb // 2, mb])
    scale_grid = sorted({1, 2, 4})
    ax, ay, steps = [], [], []
    tag = iter(range(1 << 30))
    trainer.accumulate(_samples(2, prompt_len, response_len, vocab, trainer.version, "w",
                                allowed))  # warm-up
    trainer.step()
    for rows in rows_grid:
        for scale in scale_grid:
            p, r = prompt_len * scale, max(1, response_len * scale)
            if p + r > max_seq_len:
                continue
            times = []
            for _ in range(reps):
                batch = _samples(rows, p, r, vocab, trainer.version, f"s{next(tag)}", allowed)
                t0 = _clock()
                trainer.accumulate(batch)
                times.append(_clock() - t0)
            ax.append({"rows": rows, "tokens": rows * (p + r)})
            ay.append(_stat(times))
            t0 = _clock()
            trainer.step()
            publish_form(trainer.weights(), agent, trainer.version)
            steps.append(_clock() - t0)
    weights_s = _timed(lambda: publish_form(trainer.weights(), agent, trainer.version), reps)
    state_s = _timed(lambda: state_to_numpy(trainer.get_state()), reps)
    # swapping: evicted as `TrainHost.bind` evicts a resident, then bound back on another slot
    # (restored into the trainer it keeps: the first round builds it, the median leaves that out)
    outs, ins = [], []
    spare = TrainHost(cfg, vocab, max_seq_len)
    for _ in range(reps):
        t0 = _clock()
        state = st.swap_out(slot.trainers.pop(agent).capture(), None, agent)
        outs.append(_clock() - t0)
        t0 = _clock()
        spare.bind(agent, state)
        ins.append(_clock() - t0)
        slot, spare = spare, slot
    # a kept swap-in (`TrainHost.bind`'s `("kept", token)`: back to the process it left, its
    # kept trainer still holds the state): parked as `bind` parks a swapped-out resident
    kept_ins: list[float] = []
    for _ in range(reps):
        token = len(kept_ins) + 1
        slot.trainers.pop(agent)
        slot.parked[agent] = (token, torch.get_rng_state())
        t0 = _clock()
        slot.bind(agent, ("kept", token))
        kept_ins.append(_clock() - t0)
    return {
        "swap_in_kept": constant(kept_ins, STATISTIC),
        "accumulate": fit_linear(["1", "rows", "tokens"], ax, ay),
        "step": constant(steps, STATISTIC),
        "weights": constant([weights_s]),
        "get_state": constant([state_s]),
        "swap_out": constant(outs, STATISTIC),
        "swap_in": constant(ins, STATISTIC),
        "build": constant([build_s]),
    }


def profile_load_weights(model: Any, agent: str, reps: int = 5) -> Fit:
    engine = HFEngine(model, 4)
    wire = publish_form(weights_of(model), agent, 1)
    return constant([_timed(lambda: engine.load_weights(from_numpy(wire)), reps)])


# --- message round trips through the real WorkerProxy ------------------------------------------
def echo_worker_main(conn: Any, spec: Any) -> None:
    """Speaks the local workers' protocol and answers every command at once: generate requests
    with `max_new_tokens` tokens (the first allowed token), published weights as a blob of
    `spec` bytes (the real wire form's size), the rest with what a real worker returns."""

    blob = bytes(int(spec or 0))
    conn.send((-1, True, "ready", []))
    while True:
        msg_id, command, payload = conn.recv()
        if command == "stop":
            conn.send((msg_id, True, None, []))
            return
        if command == "generate":
            replies = []
            for sub_id, r, _ in payload:
                tok = (r.allowed_tokens or [5])[0]
                replies.append((sub_id, True, GenerationResult(
                    r.sample_id, [tok] * r.max_new_tokens, [-1.0] * r.max_new_tokens, r.version,
                    admitted_at=time.time())))
            conn.send((-2, True, replies, []))
            continue
        result: Any = 0
        if command == "bind":
            result = Bound(None, None, None, {})
        elif command == "accumulate":
            result = {"rows": float(len(payload[1]))} if payload else {}
        elif command == "step":
            result = ({}, blob)
        elif command == "weights":
            result = blob
        elif command == "get_state":
            result = ({}, {"version": 0})
        elif command in ("sleep", "wake"):  # runtime.colocate: the bytes freed / loaded
            result = {"kv_bytes": 0.0, "weight_bytes": 0.0}
        conn.send((msg_id, True, result, []))


async def _ipc_measure(samples_of: Callable[[int], Any], wire: Any,
                       reps: int) -> dict[str, Fit]:
    proxy = WorkerProxy("profile", 0, echo_worker_main, None, NullSink())
    await proxy.start()
    try:
        gx, gy = [], []
        for n in [1, 4, 16, 64]:
            times = []
            for _ in range(reps):
                reqs = [GenerationRequest(f"e{i}", "a", 0, [3] * 8, 4) for i in range(n)]
                t0 = time.perf_counter()
                await asyncio.gather(*(proxy.submit(r, (0, i, 0)) for i, r in enumerate(reqs)))
                times.append(time.perf_counter() - t0)
            gx.append({"requests": n})
            gy.append(_stat(times))
        cx, cy = [], []
        payloads = [samples_of(rows) if rows else None for rows in [0, 4, 16, 64]]
        for command, payload in [("accumulate", p) for p in payloads] + [("load_weights", wire)]:
            nbytes = len(pickle.dumps(payload))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                await proxy.call(command, payload)
                times.append(time.perf_counter() - t0)
            cx.append({"bytes": nbytes})
            cy.append(_stat(times))
    finally:
        await proxy.stop()
    return {"ipc_generate": fit_linear(["1", "requests"], gx, gy),
            "ipc_call": fit_linear(["1", "bytes"], cx, cy)}


class _Spans(NullSink):
    """The busy spans a real worker reports: (kind, seconds), the kind being the label's
    command (`gen`, `load`, `swap`, `acc`, `step`, ...)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float]] = []

    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        self.spans.append((label.split(":")[0], end - start))

    def busy(self) -> float:
        return sum(d for _, d in self.spans)


class _OnCpu:
    """Turns a real worker's busy spans into CPU seconds, one awaited command (or batch) at a
    time (`measure`): the spans it reported meanwhile times the share of its runnable time
    the worker spent on a CPU over that call (`machine.on_cpu_share`, from the scheduler's
    nanosecond counters), so a call that other users' processes preempted reads the same as
    one they did not, and each round of a probe is converted with its own moment's load.
    Where the kernel keeps no per-thread counters it falls back to one share over the phase:
    the process's CPU seconds (/proc/PID/stat, 10 ms ticks) over the spans reported meanwhile
    (`fraction`); without /proc the spans stay wall time."""

    def __init__(self, proxy: Any, sink: _Spans) -> None:
        self.pid = proxy.process.pid
        self.sink = sink
        self.cpu0 = tree_cpu_s(self.pid)
        self.busy = 0.0
        self.shares: list[float] = []  # per call, where the counters were read

    async def measure(self, awaitable: Any) -> list[tuple[str, float, float | None]]:
        """Await `awaitable` (work of the worker); the spans reported meanwhile, as (kind,
        wall seconds, on-CPU share or None)."""
        first = len(self.sink.spans)
        before = sched_times_s(self.pid)
        await awaitable
        share = on_cpu_share(before, sched_times_s(self.pid))
        if share is not None:
            self.shares.append(share)
        spans = self.sink.spans[first:]
        self.busy += sum(d for _, d in spans)
        return [(kind, d, share) for kind, d in spans]

    def fraction(self) -> float:
        cpu1 = tree_cpu_s(self.pid)
        if self.cpu0 is None or cpu1 is None or self.busy <= 0:
            return 1.0  # no /proc: wall time, as measured
        return max(0.05, min(1.0, (cpu1 - self.cpu0) / self.busy))

    def cpu_s(self, spans: Sequence[tuple[str, float, float | None]]) -> float:
        """The CPU seconds of `spans` (from `measure`), at the end of the phase."""
        fallback: float | None = None
        total = 0.0
        for _, d, share in spans:
            if share is None:
                fallback = self.fraction() if fallback is None else fallback
                share = fallback
            total += d * share
        return total


async def _start_worker(cfg: Any, vocab: int, max_len: int, names: list[str],
                        pool: str = "rollout") -> tuple[Any, _Spans]:
    """A real worker process of the local runtime (`rollout_worker_main`, or
    `train_worker_main` for pool "train") hosting `names`, and the sink its spans go to."""
    rt = cfg.runtime
    gpu = run_placements(cfg)  # on a GPU run: on the pool's GPU, as the run's worker 0
    spec = WorkerSpec(cfg.model_dump(mode="json"), vocab, max_len, names, rt.torch_threads,
                      rt.deterministic, cfg.rollout.max_batch_seqs,
                      heartbeat_s=rt.heartbeat_interval_s,
                      placement=gpu[pool == "train"] if gpu else Placement())
    sink = _Spans()
    main = train_worker_main if pool == "train" else rollout_worker_main
    proxy = WorkerProxy(pool, 0, main, spec, sink)
    await proxy.start()
    return proxy, sink


def _ratio(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """Measured over predicted, as a median of per-round ratios (1.0 without data)."""
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if p > 0]
    return _stat(ratios) if ratios else 1.0


def replay_batch(agent: str, prof: AgentProfile, prompt: int, outs: Sequence[int],
                 max_seqs: int) -> tuple[float, int]:
    """What the mirror charges a replica for one batch of `agent` admitted together, each
    request decoding exactly its `outs` tokens: the seconds of `prof`'s fits (with its
    `replica_overhead`, if it has one) and the number of turns that admitted or answered
    something (those carry the loop's own work). The mirror's own engine (`ProfiledEngine`)
    replays it, so the profile and the mirror count the same turns."""
    local = LocalProfile("replay", 1, {agent: prof}, {})
    engine = ProfiledEngine(agent, local, max(max_seqs, len(outs)), 1 << 30, lambda: 0.0)
    engine.admit([GenerationRequest(f"replay{i}", agent, 0, [3] * prompt, max(1, out))
                  for i, out in enumerate(outs)])
    engine.step()  # a scheduler turn admits and decodes once
    while engine.seqs:
        engine.step()
    return engine.take_cost(), engine.event_turns


def _spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated measurements of one quantity (0: none or one)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return float((max(values) - min(values)) / mid) if mid else 0.0


async def _replica_probe(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                         allowed: dict[str, list[int] | None], reps: int
                         ) -> tuple[Fit, float, dict[str, float]]:
    """A real rollout replica process (`rollout_worker_main`, the config's models), timed by
    the busy spans it reports, given batches whose output lengths are drawn from each agent's
    measured ones (a long tail answers in many turns, as in the run). First each agent alone,
    in batches of 1 .. max_batch_seqs requests: its busy time beyond what the engine fits
    predict (`replay_batch`: the mirror's own engine on the same batch) is the worker loop's
    own work (messages, queues, replies), fitted per turn that admitted or answered something
    and per request admitted (`replica_overhead`; the mirror charges it on exactly those
    turns). Then every agent at once, as in a run (the models take turns): its busy time over
    what the fits and that overhead predict for the same work (`worker_scale["rollout"]`); the
    fits were measured one model at a time, in hot loops, and a replica whose models alternate
    runs slower than that. In both the first round warms the replica up and is left out.
    Returns the overhead, the scale and the spread of the scale's rounds."""

    proxy, sink = await _start_worker(cfg, vocab, max_len, list(agents))
    ids = itertools.count()
    prompts = {a: max(1, round(statistics.median(prof.prompt_lengths or [8])))
               for a, prof in agents.items()}
    max_seqs = 1 if cfg.runtime.deterministic else cfg.rollout.max_batch_seqs

    def batch(agent: str, n: int, rng: np.random.Generator, tag: str
              ) -> tuple[list[GenerationRequest], list[int]]:
        lengths = agents[agent].output_lengths or [1]
        outs = [max(1, int(v)) for v in rng.choice(lengths, size=n)]
        return [GenerationRequest(f"{tag}{next(ids)}", agent, 0,
                                  rng.integers(3, vocab, size=prompts[agent]).tolist(), out,
                                  allowed.get(agent)) for out in outs], outs

    async def busy(on_cpu: _OnCpu, reqs: list[GenerationRequest]) -> list[Any]:
        return await on_cpu.measure(asyncio.gather(
            *(proxy.submit(r, (0, i, 0)) for i, r in enumerate(reqs))))

    try:
        rng = np.random.default_rng(1)
        xs, ys = [], []
        for agent, prof in agents.items():
            for n in _grid(max_seqs, [1, 8, max_seqs]):
                runs = []
                on_cpu = _OnCpu(proxy, sink)
                for rep in range(reps + 1):
                    reqs, outs = batch(agent, n, rng, "r")
                    spans = await busy(on_cpu, reqs)
                    engine, turns = replay_batch(agent, prof, prompts[agent], outs, max_seqs)
                    if rep:
                        runs.append((spans, engine, max(1, turns)))
                xs.append({"requests": _stat([n / t for _, _, t in runs])})
                ys.append(max(0.0, _stat([(on_cpu.cpu_s(spans) - e) / t
                                          for spans, e, t in runs])))
        over = fit_linear(["1", "requests"], xs, ys)
        for prof in agents.values():
            prof.fits["replica_overhead"] = over
        rng = np.random.default_rng(2)
        n = max(1, min(max_seqs, 32))
        rounds, predicted = [], []
        on_cpu = _OnCpu(proxy, sink)
        for rep in range(reps + 1):
            reqs, expect = [], 0.0
            for agent, prof in agents.items():
                more, outs = batch(agent, n, rng, "s")
                reqs += more
                expect += replay_batch(agent, prof, prompts[agent], outs, max_seqs)[0]
            spans = await busy(on_cpu, reqs)
            if rep:
                rounds.append(spans)
                predicted.append(expect)
        measured = [on_cpu.cpu_s(spans) for spans in rounds]
    finally:
        await proxy.stop()
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if p > 0]
    return over, _ratio(measured, predicted), {"rollout": _spread(ratios)}


async def _keep_busy(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                     allowed: dict[str, list[int] | None]) -> tuple[Any, asyncio.Task]:
    """A real rollout replica (`rollout_worker_main`, the config's models) kept decoding:
    batches of every agent's requests with its measured output lengths, one after another,
    until the returned task is cancelled (then stop the proxy)."""
    proxy, _ = await _start_worker(cfg, vocab, max_len, list(agents))
    ids = itertools.count()
    rng = np.random.default_rng(3)
    n = max(1, min(cfg.rollout.max_batch_seqs, 16))

    async def feed() -> None:
        while True:
            reqs = []
            for agent, prof in agents.items():
                prompt = max(1, round(statistics.median(prof.prompt_lengths or [8])))
                for out in rng.choice(prof.output_lengths or [1], size=n):
                    reqs.append(GenerationRequest(
                        f"busy{next(ids)}", agent, 0, rng.integers(3, vocab, size=prompt).tolist(),
                        max(1, int(out)), allowed.get(agent)))
            await asyncio.gather(*(proxy.submit(r, (0, i, 0)) for i, r in enumerate(reqs)))

    return proxy, asyncio.ensure_future(feed())


def _side_trainers(cfg: Any, vocab: int, max_len: int, trainable: list[str]) -> dict[str, Any]:
    """A trainer in this process for each agent, one per distinct agent config (a micro-batch
    costs what its shapes cost, whatever the weights)."""
    hosts: dict[str, Any] = {}
    side: dict[str, Any] = {}
    for agent in trainable:
        acfg = cfg.agents[agent]
        key = json.dumps([acfg.model.model_dump(mode="json"),
                          acfg.lora.model_dump(mode="json") if acfg.lora else None,
                          acfg.algorithm.model_dump(mode="json")], sort_keys=True)
        if key not in hosts:
            hosts[key] = TrainHost(cfg, vocab, max_len)
            hosts[key].bind(agent, None)
        side[agent] = next(iter(hosts[key].trainers.values()))
    return side


def _accumulate_here(trainer: Any, batch: list[Any]) -> float:
    """This process's CPU seconds for `batch` through `trainer` (as rows of its version; the
    gradients dropped after)."""
    rows = [dataclasses.replace(s, policy_version=trainer.version) for s in batch]
    t0 = _clock()
    trainer.accumulate(rows)
    spent = _clock() - t0
    trainer._clear_step()
    return spent


async def _train_scale(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                       allowed: dict[str, list[int] | None], reps: int, busy_replica: bool = False
                       ) -> tuple[dict[str, float], dict[str, float]]:
    """A real training worker (`train_worker_main`) given the run's commands in the run's
    order: the trainable agents in turn (each `bind` swaps the resident out and the next
    agent in when agents share the slot), each its micro-batches (samples over the pipe) and
    its `step`. Per command kind, the worker's CPU seconds while each command was out (the
    scheduler's counters of every thread: the command's own work and its payload's
    unpickling and its reply's pickling, which its busy span leaves out; where the kernel
    keeps no counters, its spans in CPU seconds, `_OnCpu`) over what the same work costs in
    this process (`accumulate`: on the CPU timed here beside it, `_side_trainers`; `swap_out`
    + `swap_in`, `step` and a GPU's `accumulate`: the in-process fits), and the spread of its
    rounds.
    With `busy_replica`, a real rollout replica decodes next to it all along (`_keep_busy`),
    as in a pipelined run."""
    trainable = [a for a in agents if cfg.agents[a].trainable]
    if not trainable:
        return {}, {}
    neighbour = await _keep_busy(cfg, vocab, max_len, agents, allowed) if busy_replica else None
    proxy, sink = await _start_worker(cfg, vocab, max_len, trainable, "train")
    rows = max(1, cfg.train.micro_batch_size)
    swapped: dict[str, Any] = {}
    versions = dict.fromkeys(trainable, 0)
    tags = itertools.count()
    kinds = {"swap": "bind", "acc": "accumulate", "step": "step"}
    measured: dict[str, list[float]] = defaultdict(list)
    predicted: dict[str, list[float]] = defaultdict(list)
    want: dict[str, float] = defaultdict(float)

    on_cpu = _OnCpu(proxy, sink)
    spans: list[tuple[str, float, float | None]] = []  # this round's
    # On the CPU, each micro-batch also runs through a trainer in this process right after the
    # worker's, and the worker's CPU is scaled against that: both read within the same
    # seconds, so a change of the host's speed between the fits and this probe stays out of
    # the scale (it moved x1.07-1.29 between two profiles minutes apart). On a GPU, the fits.
    side = {} if _on_gpu else _side_trainers(cfg, vocab, max_len, trainable)

    pid = proxy.process.pid
    calls: list[tuple[str, float]] = []  # this round's: (kind, the worker's CPU seconds)

    async def call(command: str, payload: Any) -> Any:
        got: list[Any] = []

        async def run() -> None:
            got.append(await proxy.call(command, payload))

        before = sched_times_s(pid)
        spans.extend(await on_cpu.measure(run()))
        after = sched_times_s(pid)
        if before is not None and after is not None:
            calls.append((command, after[0] - before[0]))
        return got[0]

    async def bind(agent: str) -> None:
        bound = await call("bind", (agent, swapped.pop(agent, None)))
        if bound.evicted is not None:
            swapped[bound.evicted] = bound.state
        if len(trainable) > 1:
            want["bind"] += agents[agent].fits["swap_out"]() + agents[agent].fits["swap_in"]()

    try:
        rounds: list[tuple[list[Any], dict[str, float], list[tuple[str, float]]]] = []
        for rep in range(reps + 1):
            want.clear()
            spans.clear()
            calls.clear()
            if rep == 1:  # the first round builds the trainers: its CPU time left out
                on_cpu = _OnCpu(proxy, sink)
            # agents in turn, each its two micro-batches then its step (a slot drains the
            # queue of the agent it holds: sticky slots)
            for agent in trainable:
                await bind(agent)
                p = max(1, round(statistics.mean(agents[agent].prompt_lengths or [8])))
                o = max(1, round(statistics.mean(agents[agent].output_lengths or [1])))
                for _ in range(2):
                    batch = _samples(rows, p, o, vocab, versions[agent], f"t{next(tags)}",
                                     allowed.get(agent))
                    await call("accumulate", (agent, batch))
                    want["accumulate"] += (
                        _accumulate_here(side[agent], batch) if agent in side else
                        agents[agent].fits["accumulate"](rows=rows, tokens=rows * (p + o)))
                await call("step", agent)
                versions[agent] += 1
                want["step"] += agents[agent].fits["step"]()
            if rep:  # the first round builds the trainers
                rounds.append((list(spans), dict(want), list(calls)))
        for got_spans, wanted, got_calls in rounds:
            for kind, value in wanted.items():
                if got_calls:  # all of the worker's CPU while the command was out
                    measured[kind].append(sum(c for k, c in got_calls if k == kind))
                    predicted[kind].append(value)
                    continue
                mine = [sp for sp in got_spans if kinds.get(sp[0]) == kind]
                measured[kind].append(on_cpu.cpu_s(mine))
                predicted[kind].append(value)
    finally:
        await proxy.stop()
        if neighbour is not None:
            neighbour[1].cancel()
            await asyncio.gather(neighbour[1], return_exceptions=True)
            await neighbour[0].stop()
    scale = {f"train_{k}": _ratio(measured[k], predicted[k]) for k in measured}
    spread = {f"train_{k}": _spread([m / p for m, p in zip(measured[k], predicted[k],
                                                           strict=True) if p > 0])
              for k in measured}
    return scale, spread


# --- lengths from a short real run -----------------------------------------------------------
def measure_lengths(cfg: Any, task: Any
                    ) -> tuple[dict[str, list[tuple[int, int, bool]]], dict[str, list[int] | None]]:
    """One sync iteration of the config on the real local runtime (its worker processes, its
    weight publication): per agent, (prompt length, output length, has stop tokens) of each
    request its replicas served, and the request's allowed tokens."""
    one = mirror_config(cfg, 1, "sync")
    lengths: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)
    allowed: dict[str, list[int] | None] = {}

    async def main() -> None:
        runtime = LocalRuntime(one, task.vocab_size, task.max_seq_len)
        generate = runtime.rollout.generate

        async def recorded(request: Any, priority: tuple) -> Any:
            result = await generate(request, priority)
            allowed.setdefault(request.agent, request.allowed_tokens)
            lengths[request.agent].append((len(request.prompt), len(result.tokens),
                                           bool(request.stop_tokens)))
            return result

        runtime.rollout.generate = recorded  # type: ignore[method-assign]
        await runtime.start()
        try:
            await JointOrchestrator(one, task, runtime.rollout, runtime.train,
                                    Telemetry(None)).run()
        finally:
            await runtime.stop()

    asyncio.run(main())
    return dict(lengths), allowed


# --- the driver's CPU in real runs -----------------------------------------------------------
def driver_cpu_s() -> float:
    """This process's CPU seconds, every thread (the scheduler's nanosecond counters, or
    `time.process_time` where the kernel keeps none)."""
    got = sched_times_s(os.getpid())
    return got[0] if got is not None else time.process_time()


DRIVER_ITERATIONS = 4  # of each of `measure_driver`'s real runs


def driver_marks(cfg: Any, iterations: int, publish: list[float] | None = None,
                 trace: list[Any] | None = None) -> list[tuple[str, float, int, int]]:
    """The config run for real (`orchestrator.run.train`: its worker processes, telemetry
    files, metrics) for `iterations` iterations, in this process: marks `(what, driver CPU
    seconds, generate requests so far, training calls so far)` at the start, at each
    iteration's rollout end ("rollout", `RolloutPool.end_iteration`) and at each iteration's
    record ("iteration"). `publish` gets the wall seconds of each collective publication's
    send (the slots' `publish:` spans in the run's trace.json); `trace` the run's trace
    (its spans and its instant events, `read_trace`)."""
    counts = {"requests": 0, "calls": 0}
    marks: list[tuple[str, float, int, int]] = []

    def mark(what: str) -> None:
        marks.append((what, driver_cpu_s(), counts["requests"], counts["calls"]))

    def on_runtime(runtime: Any) -> None:
        pool = runtime.rollout
        generate, end = pool.generate, pool.end_iteration

        async def counted(request: Any, priority: tuple) -> Any:
            counts["requests"] += 1
            return await generate(request, priority)

        def ended(k: int, stats: Any) -> Any:
            mark("rollout")
            return end(k, stats)

        pool.generate = counted
        pool.end_iteration = ended
        for w in getattr(runtime.train, "workers", []):
            call = w.call

            async def called(command: str, payload: Any, *args: Any, call: Any = call,
                             **kw: Any) -> Any:
                counts["calls"] += 1
                return await call(command, payload, *args, **kw)

            w.call = called
        mark("start")

    with tempfile.TemporaryDirectory(prefix="flexmarl-driver-") as out:
        train(mirror_config(cfg, iterations), out, on_iteration=lambda _: mark("iteration"),
              on_runtime=on_runtime)
        read = read_trace(Path(out) / "trace.json")
        if publish is not None and read is not None:
            publish.extend(s.end - s.start for s in read[0] if s.label.startswith("publish:"))
        if trace is not None and read is not None:
            trace.extend(read)
    return marks


def pipelined_config(cfg: Any) -> Any:
    """The config `measure_driver` runs pipelined: its own, or async for a sync config (then
    with separate pools and the agents trained together: colocated pools and agents trained
    in turn are sync-only, and the workers would refuse the config)."""
    if cfg.pipeline.mode != "sync":
        return cfg
    return mirror_config(cfg.model_copy(update={
        "runtime": cfg.runtime.model_copy(update={"colocate": False}),
        "pipeline": cfg.pipeline.model_copy(update={"train_agents": "together"})}), mode="async")


def measure_driver(cfg: Any, iterations: int = DRIVER_ITERATIONS,
                   sync_trace: list[Any] | None = None) -> dict[str, float]:
    """The driver's CPU as real runs of the config spend it (its requests' and calls'
    pickling, the task's prompts and rewards, the store, the metrics and telemetry files,
    the proxies' threads), over the iterations after the first: a sync run's rollout phase
    per generate request and the rest of its iterations per training call (publication and
    records included), and an async run's CPU an iteration over what those two charge its
    requests and calls (`pipelined`: rollout and training overlapped in one driver; the
    config's own mode, or async for a sync config). With `runtime.publication` collective,
    `publish_s`: the median wall seconds of a publication's send in both runs (a replica
    receiving it stops decoding meanwhile, `mirror.SimRolloutWorker`). `sync_trace` gets the
    sync run's trace (`in_situ_scales`)."""
    sends: list[float] = []
    sync = driver_marks(mirror_config(cfg, mode="sync"), iterations, sends, sync_trace)
    rollout = train_s = 0.0
    requests = calls = 0
    last = next(m for m in sync if m[0] == "start")
    seen = 0
    for what, cpu, req, n_calls in sync:
        if what == "start":
            continue
        if seen >= 2:  # the iterations after the first
            if what == "rollout":
                rollout += cpu - last[1]
                requests += req - last[2]
            else:
                train_s += cpu - last[1]
                calls += n_calls - last[3]
        seen += what == "rollout" or what == "iteration"
        last = (what, cpu, req, n_calls)
    per_request = rollout / max(1, requests)
    per_call = train_s / max(1, calls)
    out = {"per_request_s": per_request, "per_train_call_s": per_call,
           "sync_per_iteration_s": (rollout + train_s) / max(1, iterations - 1)}
    piped = [m for m in driver_marks(pipelined_config(cfg), iterations, sends)
             if m[0] != "rollout"]
    first, end = piped[min(1, len(piped) - 1)], piped[-1]  # the first iteration's record
    charged = per_request * (end[2] - first[2]) + per_call * (end[3] - first[3])
    spent = end[1] - first[1]
    out["pipelined"] = spent / charged if charged > 0 else 1.0
    out["pipelined_per_iteration_s"] = spent / max(1, len(piped) - 2)
    if sends:
        out["publish_s"] = statistics.median(sends)
    return out


# `worker_scale` key -> the (pool, span kind) whose busy seconds `in_situ_scales` compares
IN_SITU = {"rollout": ("rollout", "gen"), "train_accumulate": ("train", "acc"),
           "train_step": ("train", "step"), "train_bind": ("train", "swap")}
IN_SITU_MIN_S = 1e-4  # busy seconds an iteration below which a kind is left as fitted


def in_situ_scales(prof: LocalProfile, cfg: Any, task: Any, trace: Sequence[Any],
                   iterations: int = DRIVER_ITERATIONS) -> dict[str, float]:
    """The real sync run's busy seconds of each kind of work (a replica's `gen:` spans, a
    slot's `acc:`, `step:`, `swap:`) over what the mirror of the same config, from `prof`,
    spends on them (`waits.figures`: the iterations after the first), by `worker_scale` key.

    The fits are measured in the profiler's own process, one kind of work at a time, and the
    worker scales on synthetic work; a real run's decode steps and micro-batches then cost
    what neither saw (their batch mixes, lengths, caches): in two profiles of one afternoon
    the mirror charged longtail_experts' decode 23% more and relay_chain's micro-batches 13%
    less than the same profile's later sync runs spent. The profile's own sync run (made
    for the driver's CPU anyway) measures that in situ; a sync run, so that each pool's work
    runs next to little else, as its costs are counted."""
    if len(trace) < 2:
        return {}
    spans, events = trace[0], trace[1]
    real = figures(spans, events, iterations)
    sim = run_mirror(mirror_config(cfg, iterations, "sync"), task, prof, external=0.0)
    mirrored = figures(sim.spans, sim.events, iterations)
    out: dict[str, float] = {}
    for key, (pool, kind) in IN_SITU.items():
        a = real.get(f"busy:{pool}:{kind}", 0.0)
        b = mirrored.get(f"busy:{pool}:{kind}", 0.0)
        if a >= IN_SITU_MIN_S and b >= IN_SITU_MIN_S:
            out[key] = a / b
    return out


# --- the profiler ----------------------------------------------------------------------------
def profile_local(cfg: Any, task: Any, *, reps: int = 5,
                  log: Callable[[str], None] | None = None) -> LocalProfile:
    """Measure `cfg`'s agents on this machine (see the module docstring)."""
    log = log or (lambda s: None)
    started = time.perf_counter()
    log("machine load: other runnable work, in CPUs")
    external = measure_external_load()
    # the host's speed, at the start and at the end: the least reading (`speed_probe`)
    speed = [speed_probe()]
    during = OtherLoad().start()  # other users' work over the whole profiling
    log("contention: the speed of a CPU second of each of k busy processes (spawned, torch "
        "work)")
    contention_spread: dict[str, float] = {}
    contention = measure_contention(cfg, task.vocab_size, task.max_seq_len, reps=reps,
                                    spread=contention_spread, per_cpu_second=True)
    log("contention: " + ", ".join(f"{k} busy x{v:.2f}" for k, v in enumerate(contention, 1)))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.runtime.torch_threads)
    gpu = run_placements(cfg)  # a GPU run's agents are measured on its GPUs
    rollout_device = f"cuda:{gpu[0].visible[0]}" if gpu else "cpu"
    if gpu:
        log(f"measuring on the run's GPUs: rollout on {rollout_device}, training on "
            f"cuda:{gpu[1].visible[0]} (wall seconds after the device drained)")
        _on_gpu[:] = [torch.device(rollout_device)]
    try:
        vocab, max_len = task.vocab_size, task.max_seq_len
        models = {a: build_model(a, cfg.agents[a].model, vocab, max_len, cfg.seed,
                                 rollout_device)
                  for a in cfg.agents if cfg.agents[a].backend.kind == "hf"}
        log(f"lengths: one iteration of {cfg.name} on the local runtime")
        lengths, allowed = measure_lengths(cfg, task)
        agents: dict[str, AgentProfile] = {}
        cache: dict[str, dict[str, Fit]] = {}  # same model config: measured once
        for agent, model in models.items():
            acfg = cfg.agents[agent]
            seen = lengths.get(agent, [])
            prompts = [p for p, _, _ in seen] or [8]
            outs = [o for _, o, _ in seen] or [1]
            key = json.dumps([acfg.model.model_dump(mode="json"), acfg.algorithm.model_dump(
                mode="json"), acfg.lora.model_dump(mode="json") if acfg.lora else None,
                round(statistics.mean(prompts)), round(statistics.mean(outs))])
            if key not in cache:
                log(f"engine and trainer: {agent}")
                width = min(max_len, max(8, 2 * max(prompts) + max(outs)))
                fits = profile_engine(model, cfg.rollout.max_batch_seqs, width, vocab, reps)
                fits["load_weights"] = profile_load_weights(model, agent, reps)
                if acfg.trainable:
                    with computing_on(f"cuda:{gpu[1].visible[0]}" if gpu else "cpu"):
                        fits.update(profile_trainer(
                            cfg, agent, vocab, max_len, max(1, round(statistics.mean(prompts))),
                            max(1, round(statistics.mean(outs))), allowed.get(agent), reps))
                cache[key] = fits
            nbytes = len(pickle.dumps(publish_form(weights_of(model), agent, 1)))
            agents[agent] = AgentProfile(dict(cache[key]), outs[:2048], prompts[:2048],
                                         any(s for _, _, s in seen), nbytes)
        log("message round trips through a spawned worker")
        first = next(iter(models))
        p = max(1, round(statistics.mean(agents[first].prompt_lengths or [8])))
        o = max(1, round(statistics.mean(agents[first].output_lengths or [1])))
        wire = publish_form(weights_of(models[first]), first, 1)
        ipc_fits = asyncio.run(_ipc_measure(
            lambda n: (first, _samples(n, p, o, vocab, 0, "ipc", None)), wire, reps))
        log("a real rollout replica: the worker loop's own work, then agents interleaved")
        replica, rollout_scale, spread = asyncio.run(_replica_probe(cfg, vocab, max_len,
                                                                    agents, allowed, reps))
        log("a real training worker: the run's order of work, agents interleaved")
        scale = {"rollout": rollout_scale}
        train_scale, train_spread = asyncio.run(_train_scale(cfg, vocab, max_len, agents,
                                                             allowed, reps))
        scale.update(train_scale)
        spread.update(train_spread)
        spread.update(contention_spread)
        log("worker scale: " + ", ".join(f"{k} x{v:.2f} (spread {spread.get(k, 0.0):.0%})"
                                         for k, v in scale.items()))
        log("a real training worker with a real replica decoding next to it")
        busy_scale, _ = asyncio.run(_train_scale(cfg, vocab, max_len, agents, allowed, reps,
                                                 busy_replica=True))
        overlap = {k: v / scale[k] for k, v in busy_scale.items() if scale.get(k, 0) > 0}
        log("overlap: " + ", ".join(f"{k} x{v:.2f}" for k, v in overlap.items()))
        log("orchestrator overhead per request and training call (zero-cost workers, "
            "real time)")
        echo_s = asyncio.run(measure_parent_overhead(cfg, task, agents))
        log(f"the driver's CPU in real runs of {cfg.name} (sync, then {cfg.pipeline.mode})")
        sync_trace: list[Any] = []
        driver = measure_driver(cfg, sync_trace=sync_trace)
        driver.update(echo_per_request_s=echo_s[0], echo_per_train_call_s=echo_s[1])
        log("driver: " + ", ".join(f"{k} {v:.4g}" for k, v in driver.items()))
    finally:
        torch.set_num_threads(threads)
        _on_gpu.clear()
    during.stop()
    speed.append(speed_probe())
    machine = machine_info()
    machine["external_load"] = external
    machine["speed_probe_s"] = min(speed)
    machine["other_load"] = round(during.cpus, 3)
    prof = LocalProfile(cfg.name, cfg.runtime.torch_threads, agents, ipc_fits,
                        driver["per_request_s"], machine, time.perf_counter() - started,
                        driver["per_train_call_s"], scale, contention, spread, clock="cpu",
                        overlap=overlap, driver=driver)
    prof.in_situ = in_situ_scales(prof, cfg, task, sync_trace)
    for key, ratio in prof.in_situ.items():
        prof.worker_scale[key] = prof.scale(key) * ratio
    log("in situ (the profile's sync run over its mirror): " + ", ".join(
        f"{k} x{v:.2f}" for k, v in prof.in_situ.items()))
    return prof


async def measure_parent_overhead(cfg: Any, task: Any, agents: dict[str, AgentProfile]
                                  ) -> tuple[float, float]:
    """The parent's own CPU time, which virtual time leaves out: the production orchestrator and
    pools (`LocalRolloutPool`, `LocalTrainPool`, `WorkerProxy` with its reader and sender
    threads) run one sync iteration in real time against spawned echo workers that answer at
    once (`echo_worker_main`). Returns this process's CPU seconds per generate request (the
    rollout phase) and per training command (the rest); message latency is not in it (the
    `ipc_*` fits), nor the echo workers' own time."""
    rt = cfg.runtime
    trainable = [a for a in cfg.agents if cfg.agents[a].trainable]
    nbytes = max((p.weights_bytes for p in agents.values()), default=0)
    sink = NullSink()
    rollout_w = [WorkerProxy("rollout", i, echo_worker_main, nbytes, sink)
                 for i in range(rt.rollout_workers)]
    train_w = [WorkerProxy("train", i, echo_worker_main, nbytes, sink)
               for i in range(max(1, min(rt.train_workers, len(trainable))))]
    counts = {"requests": 0, "calls": 0}
    for w in train_w:
        call = w.call

        async def counted(command: str, payload: Any, call: Any = call) -> Any:
            counts["calls"] += 1
            return await call(command, payload)

        w.call = counted  # type: ignore[method-assign,assignment]
    await asyncio.gather(*(w.start() for w in rollout_w + train_w))
    try:
        best = (float("inf"), float("inf"))
        one = mirror_config(cfg, 1, "sync")
        for _ in range(3):  # the quietest of three runs
            balancer = Balancer(list(cfg.agents), rt.rollout_workers, cfg.rollout.balance)
            rollout = LocalRolloutPool(rollout_w, balancer)
            train = LocalTrainPool(train_w)
            counts.update(requests=0, calls=0)
            generate = rollout.generate

            async def gen(request: Any, priority: tuple, generate: Any = generate) -> Any:
                counts["requests"] += 1
                return await generate(request, priority)

            rollout.generate = gen  # type: ignore[method-assign]
            marks: list[float] = []
            end = rollout.end_iteration

            def ended(k: int, stats: Any, end: Any = end, marks: list = marks) -> Any:
                marks.append(time.process_time())
                return end(k, stats)

            rollout.end_iteration = ended  # type: ignore[method-assign]
            orch = JointOrchestrator(one, task, rollout, train, Telemetry(None))
            # version 0 is published before the rollout: count it with the training calls
            counts.update(calls=0)
            t0 = time.process_time()  # this process's CPU time, all its threads
            await orch.run()
            t1 = time.process_time()
            roll_cpu = marks[0] - t0 if marks else 0.0
            per_request = roll_cpu / max(1, counts["requests"])
            per_call = max(0.0, t1 - t0 - roll_cpu) / max(1, counts["calls"])
            if per_request + per_call < sum(best):
                best = (per_request, per_call)
    finally:
        await asyncio.gather(*(w.stop() for w in rollout_w + train_w), return_exceptions=True)
    return best


