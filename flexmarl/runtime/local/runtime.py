"""The local runtime: the embedded default. Worker processes on this machine, no services.

The rollout pool and the training pool are separate sets of processes (sized by
`runtime.rollout_workers` / `runtime.train_workers`), each with its own torch thread count.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import threading
import time
from typing import Any

from flexmarl.config.schema import RunConfig
from flexmarl.policy.model import approx_params
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.backends.openai import OpenAIBackend
from flexmarl.rollout.balancer import Balancer
from flexmarl.runtime.base import SpanSink, Weights, WorkerError
from flexmarl.runtime.local.workers import WorkerSpec, rollout_worker_main, train_worker_main
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
    """Replicas (each able to host every agent's model) behind the hierarchical balancer;
    agents served by an OpenAI-compatible endpoint bypass the replicas."""

    def __init__(
        self,
        workers: list[WorkerProxy],
        balancer: Balancer,
        remote: dict[str, OpenAIBackend] | None = None,
    ) -> None:
        self.workers = workers
        self.n_workers = len(workers)
        self.balancer = balancer
        self.remote = remote or {}

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        remote = self.remote.get(request.agent)
        if remote is not None:
            return await remote.generate(request)
        cost = self.balancer.expected_cost(request.agent, len(request.prompt),
                                           request.max_new_tokens)
        index = self.balancer.pick(request.agent, [w.outstanding_tokens for w in self.workers])
        worker = self.workers[index]
        worker.outstanding_tokens += cost
        submitted = time.time()
        try:
            result = await worker.submit(request, priority)
        finally:
            worker.outstanding_tokens -= cost
        result.queue_s = max(0.0, result.admitted_at - submitted)
        self.balancer.observe(request.agent, len(result.tokens))
        return result

    async def publish(self, agent: str, version: int, weights: Weights) -> None:
        if agent in self.remote:
            raise WorkerError(f"agent {agent!r} is served by an external endpoint: its weights "
                              "cannot be published")
        await asyncio.gather(
            *(w.call("load_weights", (agent, version, weights)) for w in self.workers)
        )

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any]:
        """Re-plan agents onto replicas from iteration k's measured demand."""
        plan = self.balancer.replan(k + 1, self.balancer.demand_from(stats))
        return plan.to_dict()


class LocalTrainPool:
    """Training workers; each trainable agent is bound to one of them (round robin)."""

    def __init__(self, workers: list[WorkerProxy], binding: dict[str, int]) -> None:
        self.workers = workers
        self.binding = binding
        self.n_workers = len(workers)

    def _worker(self, agent: str) -> WorkerProxy:
        return self.workers[self.binding[agent]]

    async def accumulate(self, agent: str, samples: list[Sample]) -> dict[str, float]:
        return await self._worker(agent).call("accumulate", (agent, samples))

    async def step(self, agent: str) -> tuple[dict[str, float], Weights]:
        return await self._worker(agent).call("step", agent)

    async def weights(self, agent: str) -> Weights:
        return await self._worker(agent).call("weights", agent)

    async def save(self, agent: str, directory: str) -> str:
        return await self._worker(agent).call("save", (agent, directory))


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

        def spec(names: list[str]) -> WorkerSpec:
            return WorkerSpec(config, vocab_size, max_seq_len, names, rt.torch_threads,
                              rt.deterministic, cfg.rollout.max_batch_seqs)

        self.rollout_workers = [
            WorkerProxy("rollout", i, rollout_worker_main, spec(agents), sink)
            for i in range(rt.rollout_workers)
        ]
        n_train = max(1, min(rt.train_workers, len(trainable)))
        binding = {a: i % n_train for i, a in enumerate(trainable)}
        self.train_workers = [
            WorkerProxy("train", i, train_worker_main,
                        spec([a for a in trainable if binding[a] == i]), sink)
            for i in range(n_train)
        ]
        local_agents = [a for a in agents if cfg.agents[a].backend.kind != "openai"]
        costs = {a: float(approx_params(cfg.agents[a].model, vocab_size)) for a in local_agents}
        balancer = Balancer(local_agents or agents, rt.rollout_workers, cfg.rollout.balance, costs)
        remote = {a: OpenAIBackend(a, cfg.agents[a].backend, cfg.seed)
                  for a in agents if cfg.agents[a].backend.kind == "openai"}
        self.rollout = LocalRolloutPool(self.rollout_workers, balancer, remote)
        self.train = LocalTrainPool(self.train_workers, binding)

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

    def placement(self) -> dict[str, Any]:
        return {
            "rollout": [{"worker": w.index, "pid": w.process.pid} for w in self.rollout_workers],
            "train": [
                {"worker": w.index, "pid": w.process.pid,
                 "agents": [a for a, i in self.train.binding.items() if i == w.index]}
                for w in self.train_workers
            ],
        }
