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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flexmarl.runtime.local.workers import (
    WorkerSpec,
    _error,
    _setup_torch,
    publish_form,
    state_to_numpy,
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
        # One compute thread: loads and decodes never overlap, the event loop stays free.
        self._compute = ThreadPoolExecutor(1, initializer=_setup_torch, initargs=(spec,))

    def where(self) -> dict[str, Any]:
        return where()

    def _kick(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())

    async def load_weights(self, agent: str, version: int, weights: dict) -> tuple[int, list]:
        """Load `version` once `agent` has no running sequence (requests for it wait)."""
        fut = asyncio.get_running_loop().create_future()
        self._inbox.append(("load", fut, (agent, version, weights)))
        self._kick()
        return await fut

    async def generate(self, items: list[tuple[Any, tuple]]) -> tuple[list, list[Span]]:
        """`items` are (GenerationRequest, priority); replies are (ok, result-or-error)."""
        loop = asyncio.get_running_loop()
        futures = []
        for request, priority in items:
            fut = loop.create_future()
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
                label = f"gen:{'+'.join(sched.busy_agents() or replies)}"
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


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


class TrainWorker:
    """Holds the trainers of the agents bound to it; weights leave it as one ray.put each."""

    def __init__(self, spec: WorkerSpec, owners: dict[str, Any] | None = None) -> None:
        _setup_torch(spec)
        from flexmarl.config.schema import RunConfig
        from flexmarl.training.trainer import AgentTrainer

        self.owners = owners or {}
        cfg = RunConfig.model_validate(spec.config)
        self.trainers = {  # on this actor's device (set by _setup_torch)
            a: AgentTrainer(a, cfg.agents[a], spec.vocab_size, spec.max_seq_len, cfg.seed,
                            max_staleness=cfg.pipeline.max_staleness)
            for a in spec.agents
        }

    def where(self) -> dict[str, Any]:
        return where()

    def _trainer(self, agent: str):
        try:
            return self.trainers[agent]
        except KeyError:
            raise KeyError(f"agent {agent!r} is not bound to this train worker "
                           f"(holds {sorted(self.trainers)})") from None

    def accumulate(self, agent: str, samples: list) -> tuple[dict[str, float], list[Span]]:
        t0 = time.time()
        result = self._trainer(agent).accumulate(samples)
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

        t0 = time.time()
        rows = ray.get(table.serve.remote(version, max_rows, step, expected_vector,
                                          sample_ids, replay))
        samples = samples_from_rows(rows)
        t1 = time.time()
        result = self._trainer(agent).accumulate(samples)
        return result, [(t0, t1, f"pull:{agent}:{len(samples)}"),
                        (t1, time.time(), f"acc:{agent}:{len(samples)}")]

    def _weights_ref(self, agent: str) -> Any:
        import ray

        # Owned by this actor (publication stays one copy); after a restart the supervisor
        # re-publishes `latest` from the restored trainer.
        trainer = self._trainer(agent)
        # the wire form carries any dtype (bf16/fp16 have no numpy equivalent)
        return ray.put(publish_form(trainer.weights(), agent, trainer.version))

    def get_state(self, agent: str) -> tuple[tuple[dict, dict], list[Span]]:
        """The trainer's full state (weights, AdamW moments, RNG, version), as checkpoints and
        the local runtime hold it; a restart point for a lost actor."""
        t0 = time.time()
        state = state_to_numpy(self._trainer(agent).get_state())
        return state, [(t0, time.time(), f"state:{agent}")]

    def restart_point(self, agent: str) -> tuple[list, list[Span]]:
        """The full state into the object store, owned by the agent's table actor: what a
        successor of this actor restores if it dies. Nested in a list: the driver keeps the
        reference only."""
        import ray

        t0 = time.time()
        state = state_to_numpy(self._trainer(agent).get_state())
        owner = self.owners.get(agent)
        if owner is None:
            raise RuntimeError(f"agent {agent!r}: no table actor to keep its restart point")
        (ref,) = ray.get(owner.adopt.remote(state))
        return [ref], [(t0, time.time(), f"keep:{agent}")]

    def restore_point(self, agent: str, state: tuple[dict, dict]) -> tuple[int, list[Span]]:
        """`state`: a `restart_point` (Ray resolves the reference before this runs)."""
        return self.set_state(agent, *state)

    def set_state(self, agent: str, arrays: dict, meta: dict) -> tuple[int, list[Span]]:
        t0 = time.time()
        self._trainer(agent).set_state(arrays, meta)
        return int(meta["version"]), [(t0, time.time(), f"restore:{agent}")]

    def step(self, agent: str) -> tuple[dict[str, float], list, list[Span]]:
        t0 = time.time()
        metrics = self._trainer(agent).step()
        ref = self._weights_ref(agent)  # nested in a list: the driver gets the ref, not the data
        return metrics, [ref], [(t0, time.time(), f"step:{agent}")]

    def weights(self, agent: str) -> tuple[list, list[Span]]:
        t0 = time.time()
        ref = self._weights_ref(agent)
        return [ref], [(t0, time.time(), f"weights:{agent}")]

    def save(self, agent: str) -> tuple[dict[str, bytes], list[Span]]:
        """The checkpoint files' bytes: this actor may run on a node without the driver's disk."""
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="fm-ckpt-") as tmp:
            path = Path(self._trainer(agent).save(tmp))
            files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        return files, [(t0, time.time(), f"save:{agent}")]
