"""Publication MB/s trainer -> replicas: `runtime.publication` pipe against collective, side by
side in one run (alternating rounds), through the runtime's own pieces.

A slot process and replica processes, no models: the slot flattens a weights dict of the given
size (`publish_form` for the pipe, `SlotPublisher.keep` for the collective, as its `step` does);
- pipe: the wire form goes slot -> driver over the slot's pipe, then driver -> each replica over
  its pipe (one sender thread per replica, as `WorkerProxy`), and the replica unpacks it
  (`from_numpy`);
- collective: the slot sends the flat buffer to each replica over their pair group
  (`SlotPublisher.send`, `receive`), gloo on CPUs, NCCL between processes on different GPUs.
A figure is the payload's MB over the wall time from the slot's flatten to the last replica
holding the tensors (so with 2 replicas, the MB of one copy).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from flexmarl.runtime.local.publication import PairGroups, SlotPublisher, pair_key, receive
from flexmarl.training.state import from_numpy, publish_form

MB = 2**20


def _weights(mb: float, device: str, dtype: str) -> dict[str, Any]:
    """About `mb` MB of tensors of 4 MB (the last one smaller)."""
    import torch  # start-up cost: torch only where it runs

    dt = getattr(torch, dtype)
    per = 4 * MB // torch.empty(0, dtype=dt).element_size()
    total = int(mb * MB) // torch.empty(0, dtype=dt).element_size()
    out, i = {}, 0
    while total > 0:
        n = min(per, total)
        out[f"layer{i}.weight"] = torch.randn(n, device=device).to(dt)
        total -= n
        i += 1
    return out


def _setup(device: str, visible: str | None) -> str:
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    import torch  # start-up cost: torch only where it runs

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
        return "cuda:0"
    return "cpu"


def _slot_main(conn: Connection, store: tuple[str, int, float], device: str,
               visible: str | None, dtype: str) -> None:
    dev = _setup(device, visible)
    publisher = SlotPublisher(PairGroups(*store))
    weights: dict[str, Any] = {}
    while True:
        command, payload = conn.recv()
        if command == "make":
            weights = _weights(payload, dev, dtype)
            conn.send(sum(v.numel() * v.element_size() for v in weights.values()))
        elif command == "pipe":
            conn.send(publish_form(weights, "bench", payload))
        elif command == "keep":
            conn.send(publisher.keep("bench", payload, weights))
        elif command == "send":
            conn.send(publisher.send("bench", *payload))
        else:
            return


def _replica_main(conn: Connection, store: tuple[str, int, float], device: str,
                  visible: str | None) -> None:
    _setup(device, visible)
    groups = PairGroups(*store)
    while True:
        command, payload = conn.recv()
        if command == "wire":
            tensors = from_numpy(payload)
        elif command == "recv":
            tensors = receive(groups, *payload).tensors
        else:
            return
        conn.send(len(tensors))
        del tensors


class _Rig:
    """A slot process and `n_rep` replica processes joined by the driver's TCPStore: the
    moving parts one measurement round drives."""

    def __init__(self, device: str, dtype: str, n_rep: int, timeout_s: float) -> None:
        import torch  # start-up cost: torch only where it runs
        import torch.distributed as dist  # start-up cost: torch only where it runs

        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        self.apart = gpus > n_rep
        self.gpus = gpus
        self.backend = "nccl" if self.apart else "gloo"
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.info = ("127.0.0.1", self.store.port, timeout_s)
        self.ctx = mp.get_context("spawn")
        self.slot, self.slot_proc = self._start(_slot_main, device, self._vis(0), dtype)
        self.reps = [self._start(_replica_main, device, self._vis(i + 1)) for i in range(n_rep)]

    def _start(self, target: Any, *args: Any) -> tuple[Connection, Any]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(child, self.info, *args), daemon=True)
        proc.start()
        return parent, proc

    def _vis(self, i: int) -> str | None:  # CUDA_VISIBLE_DEVICES of process i (0: the slot)
        return str(i) if self.apart else ("0" if self.gpus else None)

    def to_replicas(self, n: int, msgs: list[Any]) -> None:
        threads = [threading.Thread(target=self.reps[i][0].send, args=(msgs[i],))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(n):
            self.reps[i][0].recv()

    def once(self, mode: str, n: int, version: int) -> float:
        """Seconds from the slot's flatten to the last of `n` replicas holding the tensors."""
        t0 = time.perf_counter()
        if mode == "pipe":
            self.slot.send(("pipe", version))
            wire = self.slot.recv()
            self.to_replicas(n, [("wire", wire)] * n)
        else:
            self.slot.send(("keep", version))
            ref = self.slot.recv()
            dests = [(pair_key(0, 0, i, 0), self.backend) for i in range(n)]
            self.slot.send(("send", (version, dests)))
            self.to_replicas(n, [("recv", (ref, key, b)) for key, b in dests])
            errors = self.slot.recv()
            if any(errors):
                raise RuntimeError(f"collective publication failed: {errors}")
        return time.perf_counter() - t0

    def close(self) -> None:
        for conn, proc in [(self.slot, self.slot_proc), *self.reps]:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def measure(sizes_mb: list[float], replicas: list[int], rounds: int = 3, device: str = "cpu",
            dtype: str = "float32", timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Rows of (size, replicas, mode, MB/s median and range over `rounds`); every round runs
    every (size, replicas, mode), the mode order alternating from round to round. On CUDA
    the slot gets GPU 0 and the replicas GPUs 1.. (NCCL) when there are enough GPUs, else all
    share GPU 0 (gloo through host memory: NCCL refuses two ranks on one GPU)."""
    rig = _Rig(device, dtype, max(replicas), timeout_s)
    rows: list[dict[str, Any]] = []
    version = 0
    try:
        for mb in sizes_mb:
            rig.slot.send(("make", mb))
            nbytes = rig.slot.recv()
            times: dict[tuple[int, str], list[float]] = {}
            for n in replicas:  # warm-up: pair groups, allocator
                for mode in ("pipe", "collective"):
                    version += 1
                    rig.once(mode, n, version)
            for r in range(rounds):
                for n in replicas:
                    order = ("pipe", "collective") if r % 2 == 0 else ("collective", "pipe")
                    for mode in order:
                        version += 1
                        times.setdefault((n, mode), []).append(rig.once(mode, n, version))
            for (n, mode), ts in sorted(times.items()):
                mbs = [nbytes / MB / t for t in ts]
                rows.append({"mb": round(nbytes / MB), "replicas": n, "mode": mode,
                             "backend": "pipe" if mode == "pipe" else rig.backend,
                             "mbs": statistics.median(mbs), "min": min(mbs), "max": max(mbs)})
    finally:
        rig.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table, pipe and collective side by side per (size, replicas)."""
    lines = ["| MB | replicas | pipe MB/s (min-max) | collective MB/s (min-max) | backend | "
             "collective / pipe |", "|---|---|---|---|---|---|"]
    by = {(r["mb"], r["replicas"], r["mode"]): r for r in rows}
    for mb, n in dict.fromkeys((r["mb"], r["replicas"]) for r in rows):
        p, c = by[(mb, n, "pipe")], by[(mb, n, "collective")]
        lines.append(f"| {mb} | {n} | {p['mbs']:.0f} ({p['min']:.0f}-{p['max']:.0f}) | "
                     f"{c['mbs']:.0f} ({c['min']:.0f}-{c['max']:.0f}) | {c['backend']} | "
                     f"{c['mbs'] / p['mbs']:.2f}x |")
    return "\n".join(lines)
