"""The actors of the Ray runtime: a rollout replica and a training worker.

They reuse the local workers' pieces (engines and the `rollout.scheduler.ReplicaScheduler`,
`training.trainer.AgentTrainer`) and differ only in transport: calls are actor methods, weights
arrive as ObjectRefs resolved from the object store on the replica's node, never via the driver.
Every reply carries the `(start, end, label)` spans of the work it covers, as locally.

`owners` maps each agent to its table actor: objects that must outlive the actor that made them
(a replica's log-prob blocks, a trainer's restart point) are handed to it (`adopt`), so it owns
them and they survive the replica or trainer being killed and restarted.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flexmarl.runtime.local.workers import (
    WorkerSpec,
    _error,
    _setup_torch,
    chaos_stall,
)

Span = tuple[float, float, str]


def where() -> dict[str, Any]:
    """Which node and process this actor runs in (for the placement log)."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "actor_id": ctx.get_actor_id(),
    }


class RolloutReplica:
    """Hosts every agent's model under the shared `ReplicaScheduler`, as the local replica.

    An async actor: requests and weight loads arrive on the event loop while the scheduler's
    turns (admission + one decode step) run on the single compute thread; between turns the
    driver task feeds in what arrived, so requests join the running batch between decode
    steps (continuous batching) and a finished sequence is answered at once.
    """

    def __init__(self, spec: WorkerSpec, owners: dict[str, Any] | None = None) -> None:
        _setup_torch(spec)
        from flexmarl.config.schema import RunConfig
        from flexmarl.runtime.local.workers import build_scheduler

        self.spec = spec
        self.owners = owners or {}
        cfg = RunConfig.model_validate(spec.config)
        self.cfg = cfg
        self.sched, self.memory = build_scheduler(cfg, spec)
        self.spans: list[Span] = []
        self._inbox: list[tuple[str, Any, Any]] = []  # ("generate" | "load", future, payload)
        self._driver: asyncio.Task | None = None
        self._busy_since: float | None = None
        # Every reply not yet given: a driver task that dies answers them all (`_guarded`).
        self._pending: set[asyncio.Future] = set()
        self.on_crash: Callable[[BaseException], None] = _exit_for_restart
        # One compute thread: loads and decodes never overlap, the event loop stays free.
        self._compute = ThreadPoolExecutor(1, initializer=_setup_torch, initargs=(spec,))

    def where(self) -> dict[str, Any]:
        return where()

    def _kick(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._guarded())

    def _future(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    async def _guarded(self) -> None:
        """The driver task, guarded: an unexpected exception in it (a scheduler invariant, an
        engine that raises outside a batch) would leave every waiting call hanging. Instead
        each waiting call gets the error, and the process ends (`on_crash`), so the runtime's
        supervisor restarts the replica from the published weights, as after a crash, and the
        requests go again."""
        try:
            await self._drive()
        except Exception as exc:  # noqa: BLE001 - answered to every waiting call
            err = RuntimeError(f"rollout replica driver failed: {_error(exc)}")
            for fut in list(self._pending):
                if not fut.done():
                    fut.set_exception(err)
            self._inbox.clear()
            self.on_crash(err)

    async def load_weights(self, agent: str, version: int, weights: dict) -> tuple[int, list]:
        """Load `version` once `agent` has no running sequence (requests for it wait)."""
        fut = self._future()
        self._inbox.append(("load", fut, (agent, version, weights)))
        self._kick()
        return await fut

    async def generate(self, items: list[tuple[Any, tuple]]) -> tuple[list, list[Span]]:
        """`items` are (GenerationRequest, priority); replies are (ok, result-or-error)."""
        futures = []
        for request, priority in items:
            fut = self._future()
            self._inbox.append(("generate", fut, (request, priority)))
            futures.append(fut)
        self._kick()
        results = await asyncio.gather(*futures)
        spans, self.spans = self.spans, []
        return list(results), spans

    async def _drive(self) -> None:
        """Feed the inbox to the scheduler and run its turns on the compute thread until it
        has nothing to do; only this task touches the scheduler."""
        from flexmarl.rollout.scheduler import Loaded

        loop = asyncio.get_running_loop()
        sched = self.sched
        while self._inbox or sched.has_work():
            await asyncio.sleep(0)  # let the requests sent in the same tick join
            inbox, self._inbox = self._inbox, []
            events: list[Any] = []
            for kind, fut, payload in inbox:
                if kind == "generate":
                    sched.submit(fut, *payload)
                else:
                    events += await loop.run_in_executor(self._compute, sched.load, fut,
                                                         *payload)
            if sched.has_work():
                if self._busy_since is None:
                    self._busy_since = time.time()
                events += await loop.run_in_executor(self._compute, sched.step)
            replies: dict[str, list[tuple[asyncio.Future, Any]]] = {}
            for ev in events:
                if isinstance(ev, Loaded):
                    if ev.ok:
                        _resolve(ev.key, (ev.version, [(ev.start, ev.end, f"load:{ev.agent}")]))
                    elif not ev.key.done():
                        ev.key.set_exception(RuntimeError(ev.error))
                elif ev.ok:
                    replies.setdefault(ev.agent, []).append((ev.key, ev.result))
                else:
                    _resolve(ev.key, (False, ev.result))
            if replies:
                now = time.time()
                label = f"gen:{'+'.join(dict.fromkeys([*replies, *sched.busy_agents()]))}"
                self.spans.append((self._busy_since or now, now, label))
                self._busy_since = now if sched.has_work() else None
            for agent, done in replies.items():
                results = [r for _, r in done]
                try:
                    await self._store_payloads(agent, results)
                except Exception as exc:  # noqa: BLE001 - reported to the driver per request
                    err = _error(exc)
                    for fut, _ in done:
                        _resolve(fut, (False, err))
                    continue
                for fut, r in done:
                    _resolve(fut, (True, r))

    async def _store_payloads(self, agent: str, results: list) -> None:
        """Put the batch's log-probs into the object store as one block owned by the agent's
        table actor; each result then carries `TensorRef((block, i))`, so the driver only ever
        sees the reference and the trainer fetches the bytes."""
        owner = self.owners.get(agent)
        if owner is None or not results:
            return
        import numpy as np

        from flexmarl.store.experience import TensorRef

        arrays = [np.asarray(r.logprobs, dtype=np.float32) for r in results]
        (block,) = await owner.adopt.remote(arrays)
        for i, (r, a) in enumerate(zip(results, arrays, strict=True)):
            r.logprobs = TensorRef((block, i), tuple(a.shape), "float32")


def _exit_for_restart(err: BaseException) -> None:
    """A replica whose driver failed ends its process: Ray reports the actor dead to every
    caller and the supervisor restarts it (its state is only the published weights)."""
    import sys

    print(f"flexmarl: {err}; exiting so that the replica is restarted", file=sys.stderr,
          flush=True)
    asyncio.get_running_loop().call_later(0.1, os._exit, 70)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


class TrainWorker:
    """A training slot as an actor: the shared `TrainHost` (the local training worker's too),
    its commands as actor methods. The resident agent changes with `bind`; states move through
    the object store, owned by the agent's table actor: a swapped-out state and a restart point
    outlive this actor. Weights leave it as one `ray.put` each."""

    def __init__(self, spec: WorkerSpec, owners: dict[str, Any] | None = None,
                 tables_own_weights: bool = False) -> None:
        """`tables_own_weights`: published weights are handed to the agent's table actor (one
        more copy), so they outlive this actor also when the agent has moved to another slot
        meanwhile (agents time-share slots); otherwise this actor owns them and the supervisor
        re-puts them from the restored trainer."""
        _setup_torch(spec)
        from flexmarl.config.schema import RunConfig
        from flexmarl.training.host import TrainHost

        self.owners = owners or {}
        self.tables_own_weights = tables_own_weights
        cfg = RunConfig.model_validate(spec.config)
        # on this actor's device (set by _setup_torch); swapped states go to the object store
        self.host = TrainHost(cfg, spec.vocab_size, spec.max_seq_len)

    def where(self) -> dict[str, Any]:
        return where()

    def _adopt(self, agent: str, value: Any, kind: str) -> Any:
        """`value` into the object store, owned (and pinned as `kind`) by the agent's table."""
        import ray

        owner = self.owners.get(agent)
        if owner is None:
            raise RuntimeError(f"agent {agent!r}: no table actor to keep its {kind} state")
        (ref,) = ray.get(owner.adopt.remote(value, kind))
        return ref

    def bind(self, agent: str, incoming: Any) -> tuple[tuple[str | None, Any, dict], list[Span]]:
        """Swap `agent` in (`incoming`: None, or `("ref", [ObjectRef])` of its swapped-out
        state) and the resident out (its state comes back as `("ref", [ObjectRef])`)."""
        import ray

        t0 = time.time()
        if incoming is not None and incoming[0] == "ref":
            incoming = ("host", ray.get(incoming[1][0]))
        out_agent, out_state, timings = self.host.bind(agent, incoming)
        if out_agent is not None and out_state is not None and out_state[0] == "host":
            out_state = ("ref", [self._adopt(out_agent, out_state[1], "swap")])
        return (out_agent, out_state, timings), [(t0, time.time(), f"swap:{agent}")]

    def accumulate(self, agent: str, samples: list) -> tuple[dict[str, float], list[Span]]:
        chaos_stall("train", "accumulate")
        t0 = time.time()
        result = self.host.accumulate(agent, samples)
        return result, [(t0, time.time(), f"acc:{agent}:{len(samples)}")]

    def accumulate_from_table(
        self, agent: str, table: Any, version: int, max_rows: int, step: int,
        expected_vector: dict[str, int] | None = None, sample_ids: list[str] | None = None,
        replay: bool = False, after: Any = None,
    ) -> tuple[dict[str, float], list[Span]]:
        """Pull a micro-batch from the agent's table actor and fetch its payloads by reference:
        the driver hands over only the table handle and the rows' ids. `after` (an ObjectRef
        of the driver's last write to the table, resolved by Ray before this runs) orders the
        pull after it."""
        import ray

        from flexmarl.runtime.ray.store import samples_from_rows

        chaos_stall("train", "accumulate")
        t0 = time.time()
        rows = ray.get(table.serve.remote(version, max_rows, step, expected_vector,
                                          sample_ids, replay))
        samples = samples_from_rows(rows)
        t1 = time.time()
        result = self.host.accumulate(agent, samples)
        return result, [(t0, t1, f"pull:{agent}:{len(samples)}"),
                        (t1, time.time(), f"acc:{agent}:{len(samples)}")]

    def _weights_ref(self, agent: str) -> Any:
        import ray

        if self.tables_own_weights:
            return self._adopt(agent, self.host.weights(agent), "weights")
        # Owned by this actor (publication stays one copy); after a restart the supervisor
        # re-publishes `latest` from the restored trainer.
        return ray.put(self.host.weights(agent))

    def get_state(self, agent: str) -> tuple[tuple[dict, dict], list[Span]]:
        """The trainer's full state (weights, AdamW moments, RNG, version), by value: a
        checkpoint is written on the driver."""
        t0 = time.time()
        state = self.host.get_state(agent)
        return state, [(t0, time.time(), f"state:{agent}")]

    def restart_point(self, agent: str) -> tuple[list, list[Span]]:
        """The full state into the object store, owned by the agent's table actor: what a
        successor of this actor restores if it dies. Nested in a list: the driver keeps the
        reference only."""
        t0 = time.time()
        ref = self._adopt(agent, self.host.get_state(agent), "restart")
        return [ref], [(t0, time.time(), f"keep:{agent}")]

    def restore_point(self, agent: str, state: tuple[dict, dict]) -> tuple[int, list[Span]]:
        """`state`: a `restart_point` (Ray resolves the reference before this runs)."""
        return self.set_state(agent, *state)

    def set_state(self, agent: str, arrays: dict, meta: dict) -> tuple[int, list[Span]]:
        t0 = time.time()
        version = self.host.set_state(agent, arrays, meta)
        return version, [(t0, time.time(), f"restore:{agent}")]

    def step(self, agent: str) -> tuple[tuple[dict[str, float], list], list[Span]]:
        t0 = time.time()
        metrics = self.host.trainers[agent].step()
        ref = self._weights_ref(agent)  # nested in a list: the driver gets the ref, not the data
        return (metrics, [ref]), [(t0, time.time(), f"step:{agent}")]

    def weights(self, agent: str) -> tuple[list, list[Span]]:
        t0 = time.time()
        ref = self._weights_ref(agent)
        return [ref], [(t0, time.time(), f"weights:{agent}")]

    def save(self, agent: str) -> tuple[dict[str, bytes], list[Span]]:
        """The checkpoint files' bytes: this actor may run on a node without the driver's disk."""
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="fm-ckpt-") as tmp:
            path = Path(self.host.save(agent, tmp))
            files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        return files, [(t0, time.time(), f"save:{agent}")]
