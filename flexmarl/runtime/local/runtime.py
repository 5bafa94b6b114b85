"""The local runtime: the embedded default. Worker processes on this machine, no services.

The rollout pool and the training pool are separate sets of processes (sized by
`runtime.rollout_workers` / `runtime.train_workers`), each with its own torch thread count.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import tempfile
import threading
from typing import Any

from flexmarl.config.schema import RunConfig
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.runtime.base import SpanSink, Weights, WorkerError
from flexmarl.runtime.local.workers import WorkerSpec, rollout_worker_main, train_worker_main
from flexmarl.training.allocator import SlotAllocator
from flexmarl.training.trainer import Sample


class _NullSink:
    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        pass


class WorkerProxy:
    """Parent side of one worker process: futures by message id, a reader thread per pipe."""

    def __init__(self, pool: str, index: int, target: Any, spec: WorkerSpec, sink: SpanSink):
        self.pool, self.index, self.sink = pool, index, sink
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=target, args=(child, spec), name=f"flexmarl-{pool}-{index}", daemon=True
        )
        self._ids = itertools.count()
        self._futures: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._outbox: list[tuple] = []
        self._send_lock = threading.Lock()
        self.outstanding_tokens = 0
        self.alive = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.process.start()
        self.alive = True
        threading.Thread(target=self._read, name=f"reader-{self.pool}-{self.index}",
                         daemon=True).start()
        await self._ready

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._died)
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _died(self) -> None:
        self.alive = False
        err = WorkerError(f"{self.pool} worker {self.index} exited (code {self.process.exitcode})")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(err)
        self._futures.clear()

    def _dispatch(self, msg: tuple) -> None:
        msg_id, ok, result, spans = msg
        for span in spans:
            if span is not None:
                self.sink.span(self.pool, self.index, *span)
        if msg_id == -1:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(True)
            return
        if msg_id == -2:  # a batch of sub-replies
            for sub_id, sub_ok, sub_result in result:
                self._resolve(sub_id, sub_ok, sub_result)
            return
        self._resolve(msg_id, ok, result)

    def _resolve(self, msg_id: int, ok: bool, result: Any) -> None:
        fut = self._futures.pop(msg_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(result)
        else:
            fut.set_exception(WorkerError(f"{self.pool} worker {self.index}: {result}"))

    def _new_future(self) -> tuple[int, asyncio.Future]:
        if not self.alive:
            raise WorkerError(f"{self.pool} worker {self.index} is not running")
        assert self._loop is not None
        msg_id = next(self._ids)
        fut = self._loop.create_future()
        self._futures[msg_id] = fut
        return msg_id, fut

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    async def call(self, command: str, payload: Any) -> Any:
        msg_id, fut = self._new_future()
        self._send((msg_id, command, payload))
        return await fut

    def submit(self, item: Any, priority: tuple) -> asyncio.Future:
        """Queue a generate request; requests queued in one loop tick travel as one message."""
        msg_id, fut = self._new_future()
        if not self._outbox:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._outbox.append((msg_id, item, priority))
        return fut

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.alive:
            self._send((next(self._ids), "generate", batch))

    async def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            try:
                await asyncio.wait_for(self.call("stop", None), timeout)
            except (WorkerError, TimeoutError, OSError):
                pass
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.alive = False


class LocalRolloutPool:
    """Replicas each hosting every agent's model; requests go to the least-loaded replica."""

    def __init__(self, workers: list[WorkerProxy]) -> None:
        self.workers = workers
        self.n_workers = len(workers)

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        cost = len(request.prompt) + request.max_new_tokens
        worker = min(self.workers, key=lambda w: (w.outstanding_tokens, w.index))
        worker.outstanding_tokens += cost
        try:
            return await worker.submit(request, priority)
        finally:
            worker.outstanding_tokens -= cost

    async def publish(self, agent: str, version: int, weights: Weights) -> None:
        await asyncio.gather(
            *(w.call("load_weights", (agent, version, weights)) for w in self.workers)
        )


class LocalTrainPool:
    """Training slots (worker processes) bound to agents on demand by a `SlotAllocator`; with
    fewer slots than agents, agents time-share slots and their states are swapped."""

    def __init__(self, workers: list[WorkerProxy]) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        self.allocator = SlotAllocator(len(workers))
        self.swapped: dict[str, Any] = {}  # agent -> its state while on no slot (wire or path)
        self.swap_seconds = 0.0

    async def _call(self, agent: str, command: str, payload: Any) -> Any:
        lease = await self.allocator.acquire(agent)
        try:
            worker = self.workers[lease.slot]
            if lease.swap_in:
                await self.allocator.wait_state(agent)  # evicted elsewhere a moment ago?
                try:
                    out_agent, out_state, timings = await worker.call(
                        "bind", (agent, self.swapped.pop(agent, None)))
                except BaseException as exc:
                    if lease.evict is not None:
                        self.allocator.state_arrived(lease.evict, exc)
                    raise
                if out_agent is not None:
                    self.swapped[out_agent] = out_state
                if lease.evict is not None:
                    self.allocator.state_arrived(lease.evict)
                self.swap_seconds += timings.get("swap_out_s", 0.0) + timings.get("swap_in_s", 0.0)
            return await worker.call(command, payload)
        finally:
            self.allocator.release(lease)

    async def accumulate(self, agent: str, samples: list[Sample]) -> dict[str, float]:
        return await self._call(agent, "accumulate", (agent, samples))

    async def step(self, agent: str) -> tuple[dict[str, float], Weights]:
        return await self._call(agent, "step", agent)

    async def weights(self, agent: str) -> Weights:
        return await self._call(agent, "weights", agent)

    async def save(self, agent: str, directory: str) -> str:
        return await self._call(agent, "save", (agent, directory))


class LocalRuntime:
    def __init__(
        self, cfg: RunConfig, vocab_size: int, max_seq_len: int, sink: SpanSink | None = None
    ) -> None:
        self.cfg = cfg
        sink = sink or _NullSink()
        rt = cfg.runtime
        config = cfg.model_dump(mode="json")
        agents = list(cfg.agents)
        trainable = [a for a in agents if cfg.agents[a].trainable]

        self._swap_tmp = None
        swap_dir = None
        if rt.swap_to == "disk":
            self._swap_tmp = tempfile.TemporaryDirectory(prefix="flexmarl-swap-")
            swap_dir = self._swap_tmp.name

        def spec(names: list[str]) -> WorkerSpec:
            return WorkerSpec(config, vocab_size, max_seq_len, names, rt.torch_threads,
                              rt.deterministic, cfg.rollout.max_batch_seqs, swap_dir)

        self.rollout_workers = [
            WorkerProxy("rollout", i, rollout_worker_main, spec(agents), sink)
            for i in range(rt.rollout_workers)
        ]
        n_train = max(1, min(rt.train_workers, len(trainable)))
        self.train_workers = [
            WorkerProxy("train", i, train_worker_main, spec(trainable), sink)
            for i in range(n_train)
        ]
        self.rollout = LocalRolloutPool(self.rollout_workers)
        self.train = LocalTrainPool(self.train_workers)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start() for w in self.rollout_workers + self.train_workers))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(
            *(w.stop() for w in self.rollout_workers + self.train_workers),
            return_exceptions=True,
        )
        if self._swap_tmp is not None:
            self._swap_tmp.cleanup()

    def placement(self) -> dict[str, Any]:
        return {
            "rollout": [{"worker": w.index, "pid": w.process.pid} for w in self.rollout_workers],
            "train": [
                {"worker": w.index, "pid": w.process.pid,
                 "agents": [a for a, i in self.train.allocator.binding().items()
                            if i == w.index]}
                for w in self.train_workers
            ],
            "train_swaps": self.train.allocator.swaps,
        }
