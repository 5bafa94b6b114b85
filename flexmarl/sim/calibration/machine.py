"""The machine a calibration runs on: other users' CPU load (`OtherLoad`, the spinning probe),
the contention curve (`measure_contention`: how fast each of k busy processes runs) and the
host's speed (`speed_probe`: CPU seconds of a fixed piece of work)."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any


def machine_info() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in load]}


def speed_probe(units: int = 40, repeats: int = 4, gap_s: float = 0.15) -> float:
    """This thread's CPU seconds for one unit of fixed single-thread work (small matmuls and
    the Python around them, like a tiny model's step): the least of `repeats` medians of
    `units` each (about 0.1 s), `gap_s` apart (about 1 s in all). It is the host's
    speed now: on a shared virtual machine the same work's CPU time moves with the neighbours
    (11% slower within 40 minutes here, with no load or steal to show it), which neither the
    other load nor the profile's fits see. A profile keeps it (`machine["speed_probe_s"]`) and
    each compared run is simulated at its own over it.

    Interference only slows the unit, never speeds it up, so the least of a few readings is
    the host's speed: a single one taken right after a run read up to 10% slow for a second
    or two (2.18 against 1.97 ms; the run's processes winding down), and a profile whose end
    probe read so made every round look 6% faster than its profile."""
    import torch  # start-up cost: the load probes above need no torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(96, 96, generator=gen)
        b = torch.randn(96, 96, generator=gen)
        best = float("inf")
        for r in range(max(1, repeats)):
            if r:
                time.sleep(gap_s)
            times = []
            for _ in range(units):
                t0 = time.thread_time()
                for _ in range(100):
                    torch.relu(a @ b)
                times.append(time.thread_time() - t0)
            best = min(best, statistics.median(times))
        return best
    finally:
        torch.set_num_threads(threads)


def host_speed(machine: dict[str, Any], probe_s: float | None) -> float:
    """A run's `speed_probe` over the profile's (`machine["speed_probe_s"]`): how much longer a
    profiled CPU second of work took then (1.0 where either has none)."""
    at = machine.get("speed_probe_s")
    return probe_s / float(at) if at and probe_s else 1.0


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


def sched_times_s(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of process `pid`, summed over
    its threads, from /proc/PID/task/*/schedstat (nanoseconds, unlike /proc/PID/stat's 10 ms
    ticks, so a single command of a worker can be read); None where the kernel keeps none."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    on = wait = 0.0
    seen = False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            on += int(fields[0]) / 1e9
            wait += int(fields[1]) / 1e9
            seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread gone meanwhile
    return (on, wait) if seen else None


def on_cpu_share(before: tuple[float, float] | None, after: tuple[float, float] | None
                 ) -> float | None:
    """The share of a process's runnable time it spent on a CPU between two `sched_times_s`
    readings (1.0 on a machine nobody else used; less the more others' work preempted it);
    None where either reading is missing or it was never runnable in between."""
    if before is None or after is None:
        return None
    on, wait = after[0] - before[0], after[1] - before[1]
    if on <= 0 or wait < 0:
        return None
    return on / (on + wait)


def tree_cpu_s(root: int | None = None) -> float | None:
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
    Each reading is held to the CPUs this run's tree did not take (`_clamped`); the tree's own
    CPUs over the same intervals go into `own_series`.
    0.0 (and no series) where /proc/stat is missing."""

    def __init__(self, every: float = 0.0) -> None:
        self.every = every
        self.series: list[tuple[float, float]] = []
        self.own_series: list[tuple[float, float]] = []  # this run's own CPUs, alike

    def __enter__(self) -> OtherLoad:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> OtherLoad:
        self.cpus = self.niced = 0.0
        self.measured = False  # /proc/stat was read at both ends
        self.series = []
        self.own_series = []
        self._t0, self._busy0, self._own0 = time.perf_counter(), _peers_s(), _own_cpu_s()
        self.t0 = self._t0  # the series' time origin (perf_counter)
        self._all0 = _machine_busy_s()
        self._stop = threading.Event()
        self._thread = None
        if self.every > 0 and self._busy0 is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        last = (0.0, _peers_s(), tree_cpu_s())
        while not self._stop.wait(self.every):
            now = (time.perf_counter() - self._t0, _peers_s(), tree_cpu_s())
            if None in now or None in last or now[0] <= last[0]:
                last = now
                continue
            dt = now[0] - last[0]
            own = (now[2] - last[2]) / dt  # type: ignore[operator]
            other = ((now[1] - last[1]) - (now[2] - last[2])) / dt  # type: ignore[operator]
            self.series.append((round(now[0], 3), round(self._clamped(other, own), 3)))
            self.own_series.append((round(now[0], 3), round(max(0.0, own), 3)))
            last = now

    @staticmethod
    def _clamped(other: float, own: float) -> float:
        """Others' CPUs, at most the CPUs this run did not take: /proc's 10 ms ticks, and a
        child's CPU time missing from the tree between its exit and its reaping, can make the
        difference of two readings exceed the machine (2.21 of 2 CPUs was read)."""
        return max(0.0, min(other, float(os.cpu_count() or 1) - max(0.0, own)))

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        busy, wall = _peers_s(), time.perf_counter() - self._t0
        every = _machine_busy_s()
        if busy is None or self._busy0 is None or every is None or self._all0 is None \
                or wall <= 0:
            return
        own = _own_cpu_s() - self._own0
        self.cpus = self._clamped(((busy - self._busy0) - own) / wall, own / wall)
        self.measured = True
        self.niced = max(0.0, ((every - self._all0) - (busy - self._busy0)) / wall)


class IterationClock:
    """When a real run's iterations ran, in seconds since `t0` (its `OtherLoad`'s start, so
    the window can be cut from that load's series): pass `mark` as `train(...,
    on_iteration=...)`; `window()` is the iterations' [start, end], the last one's end less
    the run's makespan (its `time_s`, counted from the first iteration's start). A run's
    start-up and its teardown after the last iteration (stopping the workers, writing the
    trace: 1.6-10.6 s on this machine under load, next to 6-17 s of iterations) are both
    left out; reading the window back from the run's total wall time put the teardown in."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.marks: list[tuple[float, float]] = []  # (seconds since t0, the record's time_s)

    def mark(self, record: dict[str, Any]) -> None:
        self.marks.append((time.perf_counter() - self.t0, float(record.get("time_s", 0.0))))

    def window(self) -> tuple[float, float] | None:
        if not self.marks:
            return None
        end, makespan = self.marks[-1]
        return max(0.0, end - makespan), end


def window_load(series: list[tuple[float, float]], start: float, end: float,
                default: float) -> float:
    """The time-weighted mean of an `OtherLoad.series` over [start, end] (seconds since its
    start; each point the load over the interval ending then); `default` where no sampled
    interval overlaps it. A run's iterations leave out its start-up (workers spawned, models
    built), when its own processes are mostly idle and other users' take more."""
    total = weight = 0.0
    prev = 0.0
    for t, v in series:
        lo, hi = max(prev, start), min(float(t), end)
        if hi > lo:
            total += float(v) * (hi - lo)
            weight += hi - lo
        prev = float(t)
    return total / weight if weight > 0 else default


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
    import torch  # start-up cost: torch only where it runs

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
        t0, c0, units = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - t0 < seconds:
            unit()
            units += 1
        conn.send((units, time.perf_counter() - t0, time.process_time() - c0))


def measure_contention(cfg: Any, vocab: int, max_len: int, *, max_procs: int | None = None,
                       reps: int = 5, seconds: float = 0.2,
                       spread: dict[str, float] | None = None,
                       per_cpu_second: bool = False) -> list[float]:
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
    costs. With `per_cpu_second` the rates are work per CPU second each process got, not per
    wall second: how much slower a CPU second of work is with k busy (shared cores, caches,
    memory bandwidth, switching), time-sharing left out; other users' load then is not in
    it. `spread`, if given, receives each level's (max - min) / median over the rounds
    (`contention_K`). Takes a few seconds (mostly the processes' start-up: torch, not
    transformers)."""
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
                rate = statistics.mean(u / max(c if per_cpu_second else e, 1e-9)
                                       for u, e, c in got)
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
    if spread is not None:
        for k in range(2, k_max + 1):
            mid = statistics.median(ratios[k])
            spread[f"contention_{k}"] = round((max(ratios[k]) - min(ratios[k])) / mid, 4) \
                if mid else 0.0
    return [1.0] + [round(min(1.0, statistics.median(ratios[k])), 4)
                    for k in range(2, k_max + 1)]

