"""Measured per-token costs of this machine for one local run config: `flexmarl simulate
--profile-local CONFIG`.

For every agent's real model, with the real engine and trainer code (`rollout.engine.HFEngine`,
`training.trainer.AgentTrainer`, `training.host.TrainHost`), in this process and with the
config's `runtime.torch_threads`, the profiler times:

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
  capture + wire form; rebuild + restore) and the restart point the supervisor keeps;

and, through the real `WorkerProxy` and a spawned echo process speaking the worker protocol,
the message round trips of the local runtime (`ipc_generate`: a batch of `requests`;
`ipc_call`: one command carrying `rows` samples or one set of weights, by `bytes`). Finally
`parent_per_request_s`: the orchestrator's own CPU time per generate request, from running the
production `JointOrchestrator` against zero-cost pools in real time. Before all of it,
`contention`: how fast each of k processes busy at once runs on this machine (spawned
processes doing torch work of the config's model sizes, work done counted; see
`measure_contention`), which the mirror's CPU sharing uses instead of cores / n.

Each quantity is fitted by least squares to a small named linear model (`Fit`: a fixed
overhead `1` plus per-sequence / per-token terms; negative coefficients are dropped and the fit
redone). The output lengths are taken from a short real rollout (one iteration of the config's
task through the real engine, in process): a node whose requests have no stop tokens always
decodes exactly `max_new_tokens`; otherwise the simulator draws from the measured lengths.

The profile is JSON (`LocalProfile.save` / `load`), written next to the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl.runtime.base import RolloutPool, TrainPool

PROFILE_VERSION = 1


# --- fitting ---------------------------------------------------------------------------------
@dataclass
class Fit:
    """time = sum(coef[t] * x[t]) over named terms; the term `1` is the fixed overhead."""

    terms: list[str]
    coef: dict[str, float]
    rmse: float = 0.0
    n: int = 0
    unit: str = "s"

    def __call__(self, **x: float) -> float:
        return float(sum(c * (1.0 if t == "1" else float(x.get(t, 0.0)))
                         for t, c in self.coef.items()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fit:
        return cls(list(d["terms"]), {k: float(v) for k, v in d["coef"].items()},
                   float(d.get("rmse", 0.0)), int(d.get("n", 0)), d.get("unit", "s"))


def fit_linear(terms: Sequence[str], xs: Sequence[Mapping[str, float]],
               ys: Sequence[float]) -> Fit:
    """Least squares of ys on the named terms; a term whose coefficient comes out negative is
    dropped (a cost cannot shrink with more work) and the rest refitted."""
    if len(xs) != len(ys) or not ys:
        raise ValueError("fit_linear: need as many measurements as inputs, at least one")
    y = np.asarray(ys, dtype=float)
    active = list(terms)
    while True:
        a = np.array([[1.0 if t == "1" else float(x[t]) for t in active] for x in xs])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None) if active else (np.zeros(0),)
        neg = [t for t, c in zip(active, coef, strict=True) if c < 0]
        if not neg:
            break
        worst = min(zip(active, coef, strict=True), key=lambda tc: tc[1])[0]
        active.remove(worst)
    pred = a @ coef if active else np.zeros_like(y)
    rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
    out = dict.fromkeys(terms, 0.0)
    out.update({t: float(c) for t, c in zip(active, coef, strict=True)})
    return Fit(list(terms), out, rmse, len(ys))


def constant(ys: Sequence[float], how: str = "median") -> Fit:
    """A cost that does not depend on size: the median (or `min`) of its measurements."""
    ys = list(ys)
    value = float(min(ys) if how == "min" else statistics.median(ys))
    return Fit(["1"], {"1": value}, float(np.std(ys)), len(ys))


# --- the profile ----------------------------------------------------------------------------
@dataclass
class AgentProfile:
    fits: dict[str, Fit]
    # measured output lengths of the agent's nodes, and whether its requests had stop tokens
    output_lengths: list[int] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    stops: bool = False
    weights_bytes: int = 0  # published weights in wire form, pickled


@dataclass
class LocalProfile:
    config: str
    torch_threads: int
    agents: dict[str, AgentProfile]
    ipc: dict[str, Fit]
    parent_per_request_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    measured_s: float = 0.0
    parent_per_train_call_s: float = 0.0
    # worker scale: measured cost in the run's own worker processes, in the run's order of
    # work (agents interleaved, states swapped, payloads over the pipe), over the in-process
    # fits' prediction; by command (`bind`, `accumulate`, `step`; `rollout`: a replica's turn)
    worker_scale: dict[str, float] = field(default_factory=dict)
    # the machine's speed curve (`measure_contention`): contention[k-1] is how fast each of k
    # busy processes runs, relative to one alone; empty (an older profile): processor sharing,
    # cores / n
    contention: list[float] = field(default_factory=list)

    def scale(self, kind: str) -> float:
        return float(self.worker_scale.get(kind, 1.0))

    def agent(self, name: str) -> AgentProfile:
        return self.agents[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "config": self.config,
            "torch_threads": self.torch_threads,
            "machine": self.machine,
            "measured_s": self.measured_s,
            "parent_per_request_s": self.parent_per_request_s,
            "parent_per_train_call_s": self.parent_per_train_call_s,
            "worker_scale": dict(self.worker_scale),
            "contention": list(self.contention),
            "ipc": {k: f.to_dict() for k, f in self.ipc.items()},
            "agents": {a: {"fits": {k: f.to_dict() for k, f in p.fits.items()},
                           "output_lengths": list(p.output_lengths),
                           "prompt_lengths": list(p.prompt_lengths),
                           "stops": p.stops, "weights_bytes": p.weights_bytes}
                       for a, p in self.agents.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalProfile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, expected {PROFILE_VERSION}")
        agents = {
            a: AgentProfile({k: Fit.from_dict(f) for k, f in p["fits"].items()},
                            [int(v) for v in p.get("output_lengths", [])],
                            [int(v) for v in p.get("prompt_lengths", [])],
                            bool(p.get("stops", False)), int(p.get("weights_bytes", 0)))
            for a, p in d["agents"].items()
        }
        return cls(d["config"], int(d["torch_threads"]), agents,
                   {k: Fit.from_dict(f) for k, f in d["ipc"].items()},
                   float(d.get("parent_per_request_s", 0.0)), dict(d.get("machine", {})),
                   float(d.get("measured_s", 0.0)), float(d.get("parent_per_train_call_s", 0.0)),
                   {k: float(v) for k, v in d.get("worker_scale", {}).items()},
                   [float(v) for v in d.get("contention", [])])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> LocalProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def machine_info() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in load]}


_SPIN = """
import sys, time
seconds = float(sys.argv[1])
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
c0, t0 = time.process_time(), time.perf_counter()
x = 0
while time.perf_counter() - t0 < seconds:
    for _ in range(10000):
        x += 1
print(time.process_time() - c0)
"""


def _machine_busy_s(niced: bool = True) -> float | None:
    """CPU-seconds the whole machine has spent busy (all CPUs, from /proc/stat), with or
    without the niced processes' (the `nice` column); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    left_out = idle if niced else idle + fields[1]
    return (sum(fields[:8]) - left_out) / (os.sysconf("SC_CLK_TCK") or 100)


def _peers_s() -> float | None:
    """`_machine_busy_s` of the work that competes with this process as an equal: niced work
    (nice > 0) yields to a process at nice 0 (CFS weight 110 against 1024 at nice 10), so it is
    left out unless this process is niced too."""
    return _machine_busy_s(niced=os.nice(0) > 0)


def _own_cpu_s() -> float:
    """CPU-seconds of this process and its joined children (the run's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _tree_cpu_s(root: int | None = None) -> float | None:
    """CPU-seconds of process `root` (default: this one) and all its live descendants, each
    with its reaped children's (/proc/PID/stat utime + stime + cutime + cstime); None where
    there is no /proc."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK") or 100
    children: dict[int, list[int]] = defaultdict(list)
    cpu: dict[int, float] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(name)
        children[int(fields[1])].append(pid)
        cpu[pid] = sum(float(v) for v in fields[11:15]) / tick
    if root not in cpu:
        return None
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


class OtherLoad:
    """Other users' CPU work while a block runs: the machine's busy CPU time (/proc/stat) less
    this process tree's own, over the wall time, in CPUs (`with OtherLoad() as load: ...;
    load.cpus`). Unlike the spinning probe before and after (`measure_external_load`) it sees
    load that comes and goes during the run. Niced work (/proc/stat's `nice` column) hardly
    competes with the run's processes at nice 0 and is left out of `cpus` (`niced` has it),
    unless this process is niced itself. With `every` > 0 a thread also samples it every
    `every` seconds (the tree's CPU time from /proc/PID/stat, live workers included) into
    `series`: [(seconds since the start, other CPUs over the interval ending then), ...].
    0.0 (and no series) where /proc/stat is missing."""

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.series: list[tuple[float, float]] = []

    def __enter__(self) -> OtherLoad:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> OtherLoad:
        import threading

        self.cpus = self.niced = 0.0
        self.measured = False  # /proc/stat was read at both ends
        self.series = []
        self._t0, self._busy0, self._own0 = time.perf_counter(), _peers_s(), _own_cpu_s()
        self._all0 = _machine_busy_s()
        self._stop = threading.Event()
        self._thread = None
        if self.every > 0 and self._busy0 is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        last = (0.0, _peers_s(), _tree_cpu_s())
        while not self._stop.wait(self.every):
            now = (time.perf_counter() - self._t0, _peers_s(), _tree_cpu_s())
            if None in now or None in last or now[0] <= last[0]:
                last = now
                continue
            other = (now[1] - last[1]) - (now[2] - last[2])  # type: ignore[operator]
            self.series.append((round(now[0], 3), round(max(0.0, other / (now[0] - last[0])),
                                                        3)))
            last = now

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        busy, wall = _peers_s(), time.perf_counter() - self._t0
        every = _machine_busy_s()
        if busy is None or self._busy0 is None or every is None or self._all0 is None \
                or wall <= 0:
            return
        other = (busy - self._busy0) - (_own_cpu_s() - self._own0)
        self.cpus = max(0.0, other / wall)
        self.measured = True
        self.niced = max(0.0, ((every - self._all0) - (busy - self._busy0)) / wall)


def profiled_load(machine: dict[str, Any]) -> float:
    """The other load a profile was measured under, in CPUs: other users' work during the
    profiling (`other_load`, the `OtherLoad` measure the calibration takes of a real run too),
    or, for an older profile without it, the spinning probe before profiling (`external_load`).
    The probe counts runnable work against spinners of its own and reads higher than the CPU
    time others get next to busy work (one spinning process: 1.2 against 0.9 here), so the two
    are not mixed."""
    if machine.get("other_load") is not None:
        return float(machine["other_load"])
    return float(machine.get("external_load", 0.0) or 0.0)


def measure_external_load(seconds: float = 1.0, cpus: int | None = None) -> float:
    """How many CPUs' worth of other work is runnable on this machine right now: `cpus` spinning
    processes (plain interpreters, started together) get `capacity` CPU-seconds per second
    between them; under processor sharing with E other runnable tasks,
    capacity = cpus * cpus / (cpus + E)."""
    import subprocess
    import sys

    cpus = cpus or os.cpu_count() or 1
    start = time.time() + 0.3
    procs = [subprocess.Popen([sys.executable, "-S", "-c", _SPIN, str(seconds), str(start)],
                              stdout=subprocess.PIPE, text=True) for _ in range(cpus)]
    got = [float(p.communicate()[0].strip() or 0.0) for p in procs]
    capacity = max(1e-6, sum(got) / seconds)
    return max(0.0, cpus * cpus / capacity - cpus)


# --- contention: how fast each of k busy processes runs ---------------------------------------
def _contention_worker(conn: Any, dims: dict[str, int], threads: int, rows: int,
                       width: int) -> None:
    """A spawned probe process (plain torch, `threads` threads): a stack shaped like the
    config's model (per layer: attention projections h -> 4h, an MLP h -> 2i -> h; an LM head
    h -> vocab) on `rows` x `width` tokens. On ("go", start, seconds) it waits for the
    wall-clock `start`, then repeats one unit (a no-grad forward, as a rollout step, and a
    forward + backward, as a micro-batch) for `seconds` and answers (units, elapsed)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(0)
    h, inter, vocab = dims["hidden"], dims["intermediate"], dims["vocab"]
    layers: list[Any] = []
    for _ in range(dims["layers"]):
        layers += [torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h), torch.nn.Linear(
            h, 2 * inter), torch.nn.SiLU(), torch.nn.Linear(2 * inter, h)]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(h, vocab))
    x = torch.randn(rows * width, h)

    def unit() -> None:
        with torch.no_grad():
            net(x)
        net.zero_grad(set_to_none=True)
        torch.log_softmax(net(x), -1).mean().backward()

    for _ in range(3):  # warm-up
        unit()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] != "go":
            return
        _, start, seconds = msg
        while time.time() < start:
            time.sleep(0.0005)
        t0, units = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            unit()
            units += 1
        conn.send((units, time.perf_counter() - t0))


def measure_contention(cfg: Any, vocab: int, max_len: int, *, max_procs: int | None = None,
                       reps: int = 5, seconds: float = 0.2) -> list[float]:
    """This machine's speed curve: `curve[k-1]` is how fast each of k processes busy at once
    runs, relative to one alone (`curve[0]` = 1). Work done is counted, not CPU time: k spawned
    processes (multiprocessing spawn, as the local runtime's workers; `runtime.torch_threads`
    each) run torch work shaped like the config's first model (`_contention_worker`: forward,
    and forward + backward, of up to 8 rows x 16 tokens) for `seconds`, started together on a
    wall-clock mark, and count the units they finish. k = 1 .. `max_procs` (default cpus + 1,
    at least 2, at most 8), the levels interleaved round by round (k = 1, 2, 3, .. then again)
    so that slow drifts of the machine's load hit every level alike; each level's speed is the
    median over `reps` rounds of its mean per-process rate over the same round's k = 1 rate.
    Two "CPUs" may be hyperthreads of one core or share caches and memory bandwidth, so two
    busy processes may each run well below full speed, which processor sharing (`cores / n`)
    does not see. Other users' load at the time is in the curve, as it is in the profiled
    costs. Takes a few seconds (mostly the processes' start-up: torch, not transformers)."""
    import multiprocessing as mp

    cpus = os.cpu_count() or 1
    k_max = max(2, max_procs or min(8, cpus + 1))
    model = next(iter(cfg.agents.values())).model
    dims = {"hidden": model.hidden_size, "intermediate": model.intermediate_size,
            "layers": max(1, model.num_layers), "vocab": vocab}
    rows = max(1, min(8, cfg.rollout.max_batch_seqs))
    width = max(2, min(16, max_len))
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    try:
        for _ in range(k_max):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_contention_worker, daemon=True,
                            args=(child, dims, cfg.runtime.torch_threads, rows, width))
            p.start()
            conns.append(parent)
            procs.append(p)
        for c in conns:
            if c.recv() != "ready":
                raise RuntimeError("contention probe: a worker did not start")
        ratios: dict[int, list[float]] = defaultdict(list)
        for _ in range(reps):
            solo = 0.0
            for k in range(1, k_max + 1):
                start = time.time() + 0.02
                for c in conns[:k]:
                    c.send(("go", start, seconds))
                got = [c.recv() for c in conns[:k]]
                rate = statistics.mean(u / max(e, 1e-9) for u, e in got)
                if k == 1:
                    solo = rate
                ratios[k].append(rate / max(solo, 1e-9))
    finally:
        for c in conns:
            try:
                c.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [1.0] + [round(min(1.0, statistics.median(ratios[k])), 4)
                    for k in range(2, k_max + 1)]


# --- measurement helpers ----------------------------------------------------------------------
# How repeated timings of one point are summarised: the median is the typical cost at the
# machine's current load (what a run sees next to the same load); "min" the least-disturbed one.
STATISTIC = "median"


def _stat(xs: Sequence[float]) -> float:
    return float(min(xs) if STATISTIC == "min" else statistics.median(xs))


def _timed(fn: Callable[[], Any], reps: int = 5) -> float:
    """`_stat` of the wall times of `fn` over `reps` runs (after the caller's warm-up)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return _stat(out)


def _grid(upper: int, points: Sequence[int]) -> list[int]:
    return sorted({max(1, min(upper, p)) for p in points})


def profile_engine(model: Any, max_seqs: int, max_width: int, vocab: int,
                   reps: int = 5) -> dict[str, Fit]:
    """Prefill and decode of one model through the real continuous batcher."""
    from flexmarl.policy.sampling import GenerationRequest
    from flexmarl.rollout.engine import HFEngine

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
                t0 = time.perf_counter()
                engine.admit(batch)
                times.append(time.perf_counter() - t0)
                engine.reset()
            px.append({"seqs": n, "tokens": n * w})
            py.append(_stat(times))
            engine.admit(requests(n, w))
            engine.step()  # the first step after admission: not a steady one
            steps = []
            for _ in range(reps):
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            dx.append({"seqs": n, "tokens": n * (w + 2 + reps / 2)})
            dy.append(_stat(steps))
            engine.reset()
    return {"prefill": fit_linear(["1", "seqs", "tokens"], px, py),
            "decode": fit_linear(["1", "seqs", "tokens"], dx, dy)}


def _samples(n: int, prompt: int, response: int, vocab: int, version: int, tag: str,
             allowed: list[int] | None) -> list[Any]:
    from flexmarl.training.trainer import Sample

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
    from flexmarl.runtime.local.workers import publish_form, state_to_numpy
    from flexmarl.training.host import TrainHost

    slot = TrainHost(cfg, vocab, max_seq_len)
    t0 = time.perf_counter()
    slot.bind(agent, None)
    build_s = time.perf_counter() - t0
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
                t0 = time.perf_counter()
                trainer.accumulate(batch)
                times.append(time.perf_counter() - t0)
            ax.append({"rows": rows, "tokens": rows * (p + r)})
            ay.append(_stat(times))
            t0 = time.perf_counter()
            trainer.step()
            publish_form(trainer.weights(), agent, trainer.version)
            steps.append(time.perf_counter() - t0)
    weights_s = _timed(lambda: publish_form(trainer.weights(), agent, trainer.version), reps)
    state_s = _timed(lambda: state_to_numpy(trainer.get_state()), reps)
    # swapping: another agent's trainer takes the slot, then this one comes back
    outs, ins = [], []
    spare = TrainHost(cfg, vocab, max_seq_len)
    for _ in range(reps):
        _, state, timings = _swap_out(slot, agent)
        outs.append(timings["swap_out_s"])
        t0 = time.perf_counter()
        spare.bind(agent, state)  # rebuild + restore, as a slot swapping the agent back in
        ins.append(time.perf_counter() - t0)
        slot, spare = spare, slot
    return {
        "accumulate": fit_linear(["1", "rows", "tokens"], ax, ay),
        "step": constant(steps, STATISTIC),
        "weights": constant([weights_s]),
        "get_state": constant([state_s]),
        "swap_out": constant(outs, STATISTIC),
        "swap_in": constant(ins, STATISTIC),
        "build": constant([build_s]),
    }


def _swap_out(slot: Any, agent: str) -> tuple[str | None, Any, dict[str, float]]:
    """Evict `agent` from `slot` exactly as `TrainHost.bind` does for a newcomer."""
    from flexmarl.training import state as st

    t0 = time.perf_counter()
    trainer = slot.trainers.pop(agent)
    captured = st.capture(trainer, frozen=False)
    out_state = ("host", st.to_wire(captured))
    return agent, out_state, {"swap_out_s": time.perf_counter() - t0}


def profile_load_weights(model: Any, agent: str, reps: int = 5) -> Fit:
    from flexmarl.policy.model import weights_of
    from flexmarl.rollout.engine import HFEngine
    from flexmarl.runtime.local.workers import from_numpy, publish_form

    engine = HFEngine(model, 4)
    wire = publish_form(weights_of(model), agent, 1)
    return constant([_timed(lambda: engine.load_weights(from_numpy(wire)), reps)])


# --- message round trips through the real WorkerProxy ------------------------------------------
def echo_worker_main(conn: Any, spec: Any) -> None:
    """Speaks the local workers' protocol and answers every command at once: generate requests
    with `max_new_tokens` tokens (the first allowed token), published weights as a blob of
    `spec` bytes (the real wire form's size), the rest with what a real worker returns."""
    from flexmarl.policy.sampling import GenerationResult

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
            result = (None, None, {})
        elif command == "accumulate":
            result = {"rows": float(len(payload[1]))} if payload else {}
        elif command == "step":
            result = ({}, blob)
        elif command == "weights":
            result = blob
        elif command == "get_state":
            result = ({}, {"version": 0})
        conn.send((msg_id, True, result, []))


async def _ipc_measure(samples_of: Callable[[int], Any], wire: Any,
                       reps: int) -> dict[str, Fit]:
    from flexmarl.policy.sampling import GenerationRequest
    from flexmarl.runtime.local.runtime import WorkerProxy

    proxy = WorkerProxy("profile", 0, echo_worker_main, None, _NullSpans())
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


class _NullSpans:
    def span(self, *args: Any) -> None:
        pass


class _Spans:
    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        self.spans.append((start, end))


async def _start_replica(cfg: Any, vocab: int, max_len: int, names: list[str]) -> tuple:
    """A real rollout replica process (`rollout_worker_main`) hosting `names`, and the sink
    its busy spans go to."""
    from flexmarl.runtime.local.runtime import WorkerProxy
    from flexmarl.runtime.local.workers import WorkerSpec, rollout_worker_main

    rt = cfg.runtime
    spec = WorkerSpec(cfg.model_dump(mode="json"), vocab, max_len, names, rt.torch_threads,
                      rt.deterministic, cfg.rollout.max_batch_seqs,
                      heartbeat_s=rt.heartbeat_interval_s)
    sink = _Spans()
    proxy = WorkerProxy("rollout", 0, rollout_worker_main, spec, sink)
    await proxy.start()
    return proxy, sink


def _engine_time(prof: AgentProfile, n: int, prompt: int, out: int) -> float:
    """What the engine fits predict for `n` requests of `prompt` tokens decoding `out`."""
    fits = prof.fits
    return fits["prefill"](seqs=n, tokens=n * prompt) + sum(
        fits["decode"](seqs=n, tokens=n * (prompt + t + 1)) for t in range(1, out))


async def _replica_measure(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                           allowed: dict[str, list[int] | None], reps: int) -> Fit:
    """A real rollout replica process (`rollout_worker_main`, the config's models) serving
    batches of requests: its busy time (the spans it reports) beyond what the engine fits
    predict is the worker loop's own work (messages, queues, replies), per reply and per
    request."""
    from flexmarl.policy.sampling import GenerationRequest

    rt = cfg.runtime
    names = list(agents)
    proxy, sink = await _start_replica(cfg, vocab, max_len, names)
    rng = np.random.default_rng(1)
    ids = itertools.count()
    xs, ys = [], []
    max_seqs = 1 if rt.deterministic else cfg.rollout.max_batch_seqs
    try:
        for agent in names:
            prof = agents[agent]
            p = max(1, round(statistics.median(prof.prompt_lengths or [8])))
            out = max(1, round(statistics.median(prof.output_lengths or [1])))
            for n in _grid(max_seqs, [1, 8, max_seqs]):
                busy_times = []
                for _ in range(reps + 1):
                    reqs = [GenerationRequest(f"r{next(ids)}", agent, 0,
                                              rng.integers(3, vocab, size=p).tolist(), out,
                                              allowed.get(agent)) for _ in range(n)]
                    sink.spans.clear()
                    await asyncio.gather(*(proxy.submit(r, (0, i, 0))
                                           for i, r in enumerate(reqs)))
                    busy_times.append(sum(e - s for s, e in sink.spans))
                best = _stat(busy_times[1:])  # the first batch warms the replica up
                engine = _engine_time(prof, n, p, out)
                xs.append({"requests": n})
                ys.append(max(0.0, best - engine))
    finally:
        await proxy.stop()
    return fit_linear(["1", "requests"], xs, ys)


def _ratio(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """Measured over predicted, as a median of per-round ratios (1.0 without data)."""
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if p > 0]
    return _stat(ratios) if ratios else 1.0


async def _replica_scale(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                         allowed: dict[str, list[int] | None], reps: int) -> float:
    """A real rollout replica serving every agent at once, as in a run (the models take turns):
    its busy time over what the fits (`prefill`, `decode`, `replica_overhead`) predict for the
    same work. The fits were measured one model at a time, in hot loops; a replica whose
    models alternate runs slower than that (caches hold the other models' weights)."""
    from flexmarl.policy.sampling import GenerationRequest

    rt = cfg.runtime
    names = list(agents)
    proxy, sink = await _start_replica(cfg, vocab, max_len, names)
    rng = np.random.default_rng(2)
    ids = itertools.count()
    n = max(1, min(1 if rt.deterministic else cfg.rollout.max_batch_seqs, 32))
    measured, predicted = [], []
    try:
        for rep in range(reps + 1):
            reqs, expect = [], 0.0
            for agent in names:
                prof = agents[agent]
                p = max(1, round(statistics.median(prof.prompt_lengths or [8])))
                out = max(1, round(statistics.median(prof.output_lengths or [1])))
                reqs += [GenerationRequest(f"s{next(ids)}", agent, 0,
                                           rng.integers(3, vocab, size=p).tolist(), out,
                                           allowed.get(agent)) for _ in range(n)]
                expect += _engine_time(prof, n, p, out)
                if "replica_overhead" in prof.fits:  # as the mirror: admission and last turn
                    over = prof.fits["replica_overhead"]
                    expect += over(requests=n) + (over(requests=0) if out > 2 else 0.0)
            sink.spans.clear()
            await asyncio.gather(*(proxy.submit(r, (0, i, 0)) for i, r in enumerate(reqs)))
            if rep:  # the first round warms the replica up
                measured.append(sum(e - s for s, e in sink.spans))
                predicted.append(expect)
    finally:
        await proxy.stop()
    return _ratio(measured, predicted)


async def _train_scale(cfg: Any, vocab: int, max_len: int, agents: dict[str, AgentProfile],
                       allowed: dict[str, list[int] | None], reps: int) -> dict[str, float]:
    """A real training worker (`train_worker_main`) given the run's commands in the run's
    order: micro-batches of the trainable agents in turn (each `bind` swaps the resident out
    and the next agent in when agents share the slot), samples over the pipe, then every
    agent's `step`. Per command kind, the spans it reports over what the in-process fits
    (`swap_out` + `swap_in`, `accumulate`, `step`) predict."""
    from flexmarl.runtime.local.runtime import WorkerProxy
    from flexmarl.runtime.local.workers import WorkerSpec, train_worker_main

    rt = cfg.runtime
    trainable = [a for a in agents if cfg.agents[a].trainable]
    if not trainable:
        return {}
    spec = WorkerSpec(cfg.model_dump(mode="json"), vocab, max_len, trainable, rt.torch_threads,
                      rt.deterministic, cfg.rollout.max_batch_seqs,
                      heartbeat_s=rt.heartbeat_interval_s)
    labels: list[tuple[str, float]] = []

    class Sink:
        def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
            labels.append((label.split(":")[0], end - start))

    proxy = WorkerProxy("train", 0, train_worker_main, spec, Sink())
    await proxy.start()
    rows = max(1, cfg.train.micro_batch_size)
    swapped: dict[str, Any] = {}
    versions = dict.fromkeys(trainable, 0)
    tags = itertools.count()
    kinds = {"swap": "bind", "acc": "accumulate", "step": "step"}
    measured: dict[str, list[float]] = defaultdict(list)
    predicted: dict[str, list[float]] = defaultdict(list)
    try:
        for rep in range(reps + 1):
            want: dict[str, float] = defaultdict(float)
            labels.clear()
            for _ in range(2):  # two micro-batches per agent per round, agents in turn
                for agent in trainable:
                    fits = agents[agent].fits
                    out_agent, out_state, _ = await proxy.call(
                        "bind", (agent, swapped.pop(agent, None)))
                    if out_agent is not None:
                        swapped[out_agent] = out_state
                    if len(trainable) > 1:
                        want["bind"] += fits["swap_out"]() + fits["swap_in"]()
                    p = max(1, round(statistics.mean(agents[agent].prompt_lengths or [8])))
                    o = max(1, round(statistics.mean(agents[agent].output_lengths or [1])))
                    batch = _samples(rows, p, o, vocab, versions[agent], f"t{next(tags)}",
                                     allowed.get(agent))
                    await proxy.call("accumulate", (agent, batch))
                    want["accumulate"] += fits["accumulate"](rows=rows, tokens=rows * (p + o))
            for agent in trainable:
                out_agent, out_state, _ = await proxy.call(
                    "bind", (agent, swapped.pop(agent, None)))
                if out_agent is not None:
                    swapped[out_agent] = out_state
                if len(trainable) > 1:
                    want["bind"] += agents[agent].fits["swap_out"]() + \
                        agents[agent].fits["swap_in"]()
                await proxy.call("step", agent)
                versions[agent] += 1
                want["step"] += agents[agent].fits["step"]()
            if rep:  # the first round builds the trainers
                got: dict[str, float] = defaultdict(float)
                for label, d in labels:
                    if label in kinds:
                        got[kinds[label]] += d
                for kind, value in want.items():
                    measured[kind].append(got[kind])
                    predicted[kind].append(value)
    finally:
        await proxy.stop()
    return {f"train_{k}": _ratio(measured[k], predicted[k]) for k in measured}


# --- lengths from a short real rollout --------------------------------------------------------
class _InProcessRollout(RolloutPool):
    """The config's models behind one in-process continuous batch each (the real engine
    under the production `ReplicaScheduler`); used once to measure the task's real prompt and
    output lengths per agent."""

    n_workers: int

    def __init__(self, engines: dict[str, Any]) -> None:
        from flexmarl.rollout.scheduler import ReplicaScheduler

        self.sched = ReplicaScheduler({a: [a] for a in engines}, engines, max_batch_seqs=max(
            (e.max_seqs for e in engines.values()), default=1))
        self.n_workers = 1
        self.kick = asyncio.Event()
        self.lengths: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)
        self.allowed: dict[str, list[int] | None] = {}
        self.task = asyncio.ensure_future(self._drive())

    async def generate(self, request: Any, priority: tuple) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self.sched.submit(fut, request, priority)
        self.kick.set()
        result = await fut
        self.allowed.setdefault(request.agent, request.allowed_tokens)
        self.lengths[request.agent].append((len(request.prompt), len(result.tokens),
                                            bool(request.stop_tokens)))
        return result

    async def _drive(self) -> None:
        from flexmarl.rollout.scheduler import Reply

        while True:
            if not self.sched.has_work():
                self.kick.clear()
                await self.kick.wait()
            await asyncio.sleep(0)
            for ev in self.sched.step():
                if not isinstance(ev, Reply) or ev.key.done():
                    continue
                if ev.ok:
                    ev.key.set_result(ev.result)
                else:
                    ev.key.set_exception(RuntimeError(ev.result))

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        pass

    def end_iteration(self, k: int, stats: Any) -> None:
        return None


class _NullTrain(TrainPool):
    n_workers = 1

    async def accumulate(self, agent: str, samples: list[Any]) -> dict[str, float]:
        return {"rows": float(len(samples))}

    async def step(self, agent: str) -> tuple[dict[str, float], dict]:
        return {}, {}

    async def weights(self, agent: str) -> dict:
        return {}

    async def save(self, agent: str, directory: str) -> str:
        return directory


def measure_lengths(cfg: Any, task: Any, models: dict[str, Any]
                    ) -> tuple[dict[str, list[tuple]], dict[str, list[int] | None]]:
    """One sync iteration of the real task through the real engine, in process."""
    from flexmarl.orchestrator.joint import JointOrchestrator
    from flexmarl.rollout.engine import HFEngine
    from flexmarl.telemetry.recorder import Telemetry

    one = cfg.model_copy(update={
        "train": cfg.train.model_copy(update={"iterations": 1}),
        "pipeline": cfg.pipeline.model_copy(update={"mode": "sync"}),
    })

    async def main() -> tuple[dict[str, list[tuple]], dict[str, list[int] | None]]:
        from flexmarl.policy.device import CPU_MAX_BATCH_TOKENS

        kv_budget = cfg.rollout.max_batch_tokens or CPU_MAX_BATCH_TOKENS
        engines = {a: HFEngine(m, cfg.rollout.max_batch_seqs, kv_budget)
                   for a, m in models.items()}
        pool = _InProcessRollout(engines)
        try:
            await JointOrchestrator(one, task, pool, _NullTrain(), Telemetry(None)).run()
        finally:
            pool.task.cancel()
        return dict(pool.lengths), pool.allowed

    return asyncio.run(main())


# --- the profiler ----------------------------------------------------------------------------
def profile_local(cfg: Any, task: Any, *, reps: int = 5, ipc: bool = True,
                  parent: bool = True, log: Callable[[str], None] | None = None) -> LocalProfile:
    """Measure `cfg`'s agents on this machine (see the module docstring)."""
    import torch

    from flexmarl.policy.model import build_model, weights_of
    from flexmarl.runtime.local.workers import publish_form

    log = log or (lambda s: None)
    started = time.perf_counter()
    log("machine load: other runnable work, in CPUs")
    external = measure_external_load()
    during = OtherLoad().start()  # other users' work over the whole profiling
    log("contention: the speed of each of k busy processes (spawned, torch work)")
    contention = measure_contention(cfg, task.vocab_size, task.max_seq_len, reps=reps)
    log("contention: " + ", ".join(f"{k} busy x{v:.2f}" for k, v in enumerate(contention, 1)))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.runtime.torch_threads)
    try:
        vocab, max_len = task.vocab_size, task.max_seq_len
        models = {a: build_model(a, cfg.agents[a].model, vocab, max_len, cfg.seed)
                  for a in cfg.agents if cfg.agents[a].backend.kind == "hf"}
        log(f"lengths: one iteration of {cfg.name} through the real engine")
        lengths, allowed = measure_lengths(cfg, task, models)
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
                    fits.update(profile_trainer(
                        cfg, agent, vocab, max_len, max(1, round(statistics.mean(prompts))),
                        max(1, round(statistics.mean(outs))), allowed.get(agent), reps))
                cache[key] = fits
            nbytes = len(pickle.dumps(publish_form(weights_of(model), agent, 1)))
            agents[agent] = AgentProfile(dict(cache[key]), outs[:2048], prompts[:2048],
                                         any(s for _, _, s in seen), nbytes)
        ipc_fits: dict[str, Fit] = {}
        scale: dict[str, float] = {}
        if ipc:
            log("message round trips through a spawned worker")
            first = next(iter(models))
            p = max(1, round(statistics.mean(agents[first].prompt_lengths or [8])))
            o = max(1, round(statistics.mean(agents[first].output_lengths or [1])))
            wire = publish_form(weights_of(models[first]), first, 1)
            ipc_fits = asyncio.run(_ipc_measure(
                lambda n: (first, _samples(n, p, o, vocab, 0, "ipc", None)), wire, reps))
            log("a real rollout replica: the worker loop's own work")
            replica = asyncio.run(_replica_measure(cfg, vocab, max_len, agents, allowed, reps))
            for prof in agents.values():
                prof.fits["replica_overhead"] = replica
            log("the run's order of work in real workers: agents interleaved")
            scale["rollout"] = asyncio.run(_replica_scale(cfg, vocab, max_len, agents, allowed,
                                                          reps))
            scale.update(asyncio.run(_train_scale(cfg, vocab, max_len, agents, allowed, reps)))
            log("worker scale: " + ", ".join(f"{k} x{v:.2f}" for k, v in scale.items()))
        parent_s = (0.0, 0.0)
        if parent:
            log("orchestrator overhead per request and training call (zero-cost workers, "
                "real time)")
            parent_s = measure_parent_overhead(cfg, task, agents)
    finally:
        torch.set_num_threads(threads)
    during.stop()
    machine = machine_info()
    machine["external_load"] = external
    machine["other_load"] = round(during.cpus, 3)
    return LocalProfile(cfg.name, cfg.runtime.torch_threads, agents, ipc_fits, parent_s[0],
                        machine, time.perf_counter() - started, parent_s[1], scale, contention)


def measure_parent_overhead(cfg: Any, task: Any, agents: dict[str, AgentProfile]
                            ) -> tuple[float, float]:
    """The parent's own CPU time, which virtual time leaves out: the production orchestrator and
    pools (`LocalRolloutPool`, `LocalTrainPool`, `WorkerProxy` with its reader and sender
    threads) run one sync iteration in real time against spawned echo workers that answer at
    once (`echo_worker_main`). Returns this process's CPU seconds per generate request (the
    rollout phase) and per training command (the rest); message latency is not in it (the
    `ipc_*` fits), nor the echo workers' own time."""
    return asyncio.run(_parent_measure(cfg, task, agents))


async def _parent_measure(cfg: Any, task: Any, agents: dict[str, AgentProfile]
                          ) -> tuple[float, float]:
    from flexmarl.orchestrator.joint import JointOrchestrator
    from flexmarl.rollout.balancer import Balancer
    from flexmarl.runtime.local.runtime import LocalRolloutPool, LocalTrainPool, WorkerProxy
    from flexmarl.sim.local_mirror import mirror_config
    from flexmarl.telemetry.recorder import Telemetry

    rt = cfg.runtime
    trainable = [a for a in cfg.agents if cfg.agents[a].trainable]
    nbytes = max((p.weights_bytes for p in agents.values()), default=0)
    sink = _NullSpans()
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

        w.call = counted  # type: ignore[method-assign]
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


# --- the profile behind the simulator's CostModel interface ------------------------------------
class ProfiledCostModel:
    """`sim.cost.CostModel`'s interface backed by a `LocalProfile`, for `SimRuntime(wl, features,
    cost=ProfiledCostModel(profile))`: a workload model's `name` is the profiled agent's name.
    Durations are this machine's (one CPU process per replica / slot: `tp` and `n_accel` must be
    1), so a sim workload built from a local config can be timed with measured costs. The
    calibration itself runs on `sim.local_mirror`, which also mirrors the local runtime's
    worker layout and message costs."""

    def __init__(self, profile: LocalProfile, max_num_seqs: int = 64) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs

    def _fits(self, model: Any) -> dict[str, Fit]:
        try:
            return self.profile.agents[model.name].fits
        except KeyError:
            raise KeyError(f"profile {self.profile.config!r} has no agent {model.name!r} "
                           f"(profiled: {', '.join(self.profile.agents)})") from None

    def _get(self, model: Any, name: str, **x: float) -> float:
        fit = self._fits(model).get(name)
        return max(0.0, fit(**x)) if fit is not None else 0.0

    def prefill_time(self, model: Any, tp: int, prompt_tokens: float) -> float:
        return self._get(model, "prefill", seqs=1, tokens=prompt_tokens)

    def decode_step_time(self, model: Any, tp: int, batch: int, kv_tokens: float) -> float:
        return self._get(model, "decode", seqs=batch, tokens=kv_tokens + batch)

    def train_compute_time(self, model: Any, n_accel: int, tokens: float) -> float:
        mb = max(1, round(tokens / max(1, self._mean_tokens(model))))
        return self._get(model, "accumulate", rows=mb, tokens=tokens)

    def policy_forwards_time(self, model: Any, n_accel: int, tokens: float,
                             passes: int) -> float:
        # the profiled `accumulate` is what the local trainer measurably runs per micro-batch,
        # whatever forward passes it includes: nothing to add
        return 0.0

    def _mean_tokens(self, model: Any) -> float:
        p = self.profile.agents[model.name]
        prompts = p.prompt_lengths or [1]
        outs = p.output_lengths or [1]
        return statistics.mean(prompts) + statistics.mean(outs)

    def optimizer_step_time(self, model: Any, n_accel: int) -> float:
        return self._get(model, "step")

    def weight_transfer_time(self, model: Any, *, inter_node: bool, links: int = 1) -> float:
        return self._get(model, "load_weights")

    def min_train_accelerators(self, model: Any) -> int:
        return 1

    def engine_sleep_time(self, model: Any, tp: int, *, kv_bytes: float = 0.0) -> float:
        return 0.0

    def engine_wake_time(self, model: Any, tp: int, *, kv_bytes: float = 0.0) -> float:
        return 0.0

    def train_state_swap_time(self, model: Any, n_accel: int) -> float:
        return self._get(model, "swap_out") + self._get(model, "swap_in")
