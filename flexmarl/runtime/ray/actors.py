"""The actors of the Ray runtime: a rollout replica and a training worker.

They reuse the local workers' pieces (model building, `policy.sampling.generate`,
`training.trainer.AgentTrainer`) and differ only in transport: calls are actor methods, weights
arrive as ObjectRefs resolved from the object store on the replica's node, never via the driver.
Every reply carries the `(start, end, label)` spans of the work it covers, as locally.

`owners` maps each agent to its table actor: objects that must outlive the actor that made them
(a replica's log-prob blocks, a trainer's restart point) are handed to it (`adopt`), so it owns
them and they survive the replica or trainer being killed and restarted.
"""

from __future__ import annotations

import asyncio
import itertools
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
    from_numpy,
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
    """Hosts every agent's model; batches the requests waiting on it, highest priority first.

    An async actor: requests keep arriving while a batch decodes on the single compute thread,
    so the next batch sees everything that queued up meanwhile (as the local replica does).
    """

    def __init__(self, spec: WorkerSpec, owners: dict[str, Any] | None = None) -> None:
        _setup_torch(spec)
        from flexmarl.config.schema import RunConfig
        from flexmarl.policy.device import compute_dtype, process_device
        from flexmarl.policy.model import build_model

        self.spec = spec
        self.owners = owners or {}
        cfg = RunConfig.model_validate(spec.config)
        self.cfg = cfg
        dev = process_device()
        self.models = {
            a: build_model(a, cfg.agents[a].model, spec.vocab_size, spec.max_seq_len, cfg.seed,
                           dev, compute_dtype(cfg.agents[a].model.dtype, dev))
            for a in spec.agents
        }
        self.versions = dict.fromkeys(spec.agents, 0)
        self.pending: list[tuple[tuple, int, Any, asyncio.Future]] = []
        self.spans: list[Span] = []
        self._seq = itertools.count()
        self._batcher: asyncio.Task | None = None
        # One compute thread: loads and decodes never overlap, the event loop stays free.
        self._compute = ThreadPoolExecutor(1, initializer=_setup_torch, initargs=(spec,))

    def where(self) -> dict[str, Any]:
        return where()

    async def load_weights(self, agent: str, version: int, weights: dict) -> tuple[int, list]:
        t0 = time.time()
        model = self.models[agent]
        tensors = from_numpy(weights)
        await asyncio.get_running_loop().run_in_executor(
            self._compute, model.load_state_dict, tensors
        )
        self.versions[agent] = version
        return version, [(t0, time.time(), f"load:{agent}")]

    async def generate(self, items: list[tuple[Any, tuple]]) -> tuple[list, list[Span]]:
        """`items` are (GenerationRequest, priority); replies are (ok, result-or-error)."""
        loop = asyncio.get_running_loop()
        futures = []
        for request, priority in items:
            fut = loop.create_future()
            self.pending.append((priority, next(self._seq), request, fut))
            futures.append(fut)
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.ensure_future(self._drain())
        results = await asyncio.gather(*futures)
        spans, self.spans = self.spans, []
        return list(results), spans

    async def _drain(self) -> None:
        from flexmarl.policy.sampling import generate

        loop = asyncio.get_running_loop()
        while self.pending:
            await asyncio.sleep(0)  # let the requests sent in the same tick join
            self.pending.sort(key=lambda item: (item[0], item[1]))
            agent = self.pending[0][2].agent
            # Deterministic mode decodes each sequence alone, exactly as the local replica.
            limit = 1 if self.spec.deterministic else self.spec.max_batch_seqs
            chosen = [item for item in self.pending if item[2].agent == agent][:limit]
            taken = {item[1] for item in chosen}
            self.pending = [item for item in self.pending if item[1] not in taken]
            requests = [item[2] for item in chosen]
            try:
                stale = [r for r in requests if r.version != self.versions[agent]]
                if stale:
                    raise RuntimeError(
                        f"agent {agent!r}: request {stale[0].sample_id} wants version "
                        f"{stale[0].version}, replica holds {self.versions[agent]}"
                    )
                t0 = time.time()
                from flexmarl.runtime.local.workers import tokenizer_loader

                tok = tokenizer_loader(agent, self.cfg.agents[agent], self.spec.vocab_size)
                results = await loop.run_in_executor(
                    self._compute, generate, self.models[agent], requests, None, tok
                )
                self.spans.append((t0, time.time(), f"gen:{agent}:{len(requests)}"))
                await self._store_payloads(agent, results)
                replies: list[tuple[bool, Any]] = [(True, r) for r in results]
            except Exception as exc:  # noqa: BLE001 - reported to the driver per request
                replies = [(False, _error(exc))] * len(chosen)
            for item, reply in zip(chosen, replies, strict=True):
                if not item[3].done():
                    item[3].set_result(reply)

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
