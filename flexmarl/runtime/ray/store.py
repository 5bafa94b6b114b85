"""The experience store on Ray: payloads in the object store, one table actor per agent.

- `RayObjectStore` is the drop-in payload store for `ExperienceStore` (same interface as
  `LocalObjectStore`): `put` returns a `TensorRef` whose key is a `ray.ObjectRef`.
- `AgentTableActor` holds one agent's rows (the spine's `AgentTable`, statuses and the
  consistency contract included) on any node. Rows carry small fields by value and payloads as
  ObjectRefs created by whoever produced them; the table never fetches a payload, and a
  micro-batch it serves carries the refs, so the consumer (a trainer actor) fetches the bytes
  from the object store itself, never through the driver.

- `RayExperienceStore` is what a `runtime.kind: ray` run uses: the spine's `ExperienceStore`
  interface (so the orchestrator is unchanged) over one `AgentTableActor` per agent. The driver
  keeps a metadata mirror (statuses, versions, rewards: what the orchestrator reads on its hot
  path; exact, as the driver is the tables' only writer) and no payload bytes; its writes reach
  the table actors as one `apply` call per agent per event-loop tick. A micro-batch is served
  as a `RayMicroBatch`: the trainer actor pulls the rows from the table actor and the payloads
  from the object store itself.

A payload reference is either an `ObjectRef` (the whole object is the row's array) or
`(ObjectRef, i)`: row i of a block a producer put once for a whole generation batch. Blocks
keep `ray.put` off the per-row path (one put costs ~0.1-1 ms; a batch holds up to 64 rows).
Producers hand their blocks to the agent's table actor (`adopt`), which puts them, so it owns
them (Ray 2.56 removed `ray.put(_owner=...)`): a payload outlives the rollout replica that made
it, and a killed replica loses no stored row. The bytes go producer -> table actor -> object
store, never through the driver.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexmarl.store.experience import (
    AgentTable,
    ConsistencyError,
    ExperienceStore,
    Row,
    Status,
    StoreError,
    TensorRef,
    check_row,
)


class RayObjectStore:
    """Arrays by ObjectRef in Ray's object store; `free` drops this store's reference."""

    def __init__(self) -> None:
        self._live: dict[str, Any] = {}

    def put(self, array: np.ndarray) -> TensorRef:
        import ray

        array = np.ascontiguousarray(array)
        ref = ray.put(array)
        self._live[ref.hex()] = ref
        return TensorRef(ref, tuple(array.shape), str(array.dtype))

    def get(self, ref: TensorRef) -> np.ndarray:
        import ray

        if ref.key.hex() not in self._live:
            raise StoreError(f"object {ref.key.hex()} is not in the object store (freed?)")
        return ray.get(ref.key)

    def free(self, ref: TensorRef) -> None:
        self._live.pop(ref.key.hex(), None)

    def __len__(self) -> int:
        return len(self._live)


ROW_FIELDS = ("sample_id", "node", "input_id", "turn", "trajectory_id", "iteration",
              "policy_version", "version_vector")


class AgentTableActor:
    """One agent's table as an actor. Use `ray.remote(AgentTableActor)`; rows arrive as dicts
    `{ROW_FIELDS..., "data": {...}, "refs": {name: ObjectRef}}` (refs nested, so Ray passes
    them as references and never resolves them here)."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.table = AgentTable(agent)
        # The owner pins what it adopted: relying on borrowers alone loses the object when the
        # borrower that carried the reference to the driver is killed before Ray has recorded
        # the driver's borrow (Ray's ReferenceCountingAssertionError). The last two of each kind
        # are kept: the driver holds the previous restart point (swapped-out training state)
        # until the new one has reached it.
        self.adopted: dict[str, deque[Any]] = {}

    def where(self) -> dict[str, Any]:
        from flexmarl.runtime.ray.actors import where

        return where()

    def add_generated(self, rows: list[dict[str, Any]]) -> int:
        """Insert rows and mark them generated (the payload refs are stored, not fetched)."""
        for item in rows:
            row = Row(agent=self.agent, **{k: item[k] for k in ROW_FIELDS})
            self.table.insert(row)
            self.table.transition(row.sample_id, Status.GENERATED)
            row.data.update(item.get("data", {}))
            for name, ref in item.get("refs", {}).items():
                row.refs[name] = TensorRef(ref, (), "")
        return len(rows)

    def set_rewarded(self, rewards: list[tuple[str, float]]) -> int:
        for sample_id, reward in rewards:
            self.table.transition(sample_id, Status.REWARDED).data["reward"] = float(reward)
        return len(rewards)

    def set_scored(self, items: list[tuple[str, float, float]]) -> int:
        """(sample_id, reward, advantage): rewarded then ready, in one call per batch."""
        for sample_id, reward, adv in items:
            self.table.transition(sample_id, Status.REWARDED).data["reward"] = float(reward)
            self.table.transition(sample_id, Status.READY).data["advantage"] = float(adv)
        return len(items)

    def set_ready(self, advantages: list[tuple[str, float]]) -> int:
        for sample_id, adv in advantages:
            self.table.transition(sample_id, Status.READY).data["advantage"] = float(adv)
        return len(advantages)

    def adopt(self, value: Any, kind: str = "block") -> list[Any]:
        """Put `value` into the object store from this actor, which then owns it (it lives as
        long as this table, not as long as its producer); the reference comes back nested.
        `kind` ("restart": a restart point, "swap": a swapped-out training state, "block": a
        replica's payload block) pins the last two of each kind apart."""
        import ray

        ref = ray.put(value)
        self.adopted.setdefault(kind, deque(maxlen=2)).append(ref)
        return [ref]

    def apply(self, ops: list[tuple], objects: list[Any] | None = None) -> int:
        """The driver's writes of one event-loop tick, in order (see `RayExperienceStore`).
        "generated" ops name their payloads as (index into `objects`, row or None): a tick's
        rows share a few blocks, each then deserialised once."""
        for op in ops:
            kind = op[0]
            if kind == "add":
                self.table.insert(Row(agent=self.agent, **op[1]))
            elif kind == "generated":
                _, sid, data, refs = op
                row = self.table.transition(sid, Status.GENERATED)
                row.data.update(data)
                for name, (k, i) in refs.items():
                    obj = (objects or [])[k]
                    row.refs[name] = TensorRef(obj if i is None else (obj, i), (), "")
            elif kind == "rewarded":
                self.table.transition(op[1], Status.REWARDED).data["reward"] = float(op[2])
            elif kind == "ready":
                self.table.transition(op[1], Status.READY).data["advantage"] = float(op[2])
            elif kind == "failed":
                row = self.table.transition(op[1], Status.FAILED)
                row.error = op[2]
                row.refs.clear()  # the payload goes once no one else refers to it
            elif kind == "evict":
                self.evict(op[1])
            else:
                raise StoreError(f"table actor {self.agent!r}: unknown operation {kind!r}")
        return len(ops)

    def take_ready(
        self, version: int, max_rows: int, step: int,
        expected_vector: dict[str, int] | None = None,
        sample_ids: list[str] | None = None, replay: bool = False,
    ) -> list[dict[str, Any]]:
        """Consume up to `max_rows` ready rows of `version` (sample_id order, or exactly
        `sample_ids` in that order), exactly once; the reply holds small fields by value and
        payloads as ObjectRefs. `replay`: a restarted trainer re-accumulating a micro-batch
        its lost predecessor took may also get rows consumed by this same `step` again."""
        return expand(self.serve(version, max_rows, step, expected_vector, sample_ids, replay))

    def serve(
        self, version: int, max_rows: int, step: int,
        expected_vector: dict[str, int] | None = None,
        sample_ids: list[str] | None = None, replay: bool = False,
    ) -> dict[str, Any]:
        """`take_ready` in compact form for trainers: each payload object is listed once in
        `objects` and rows name it by index (64 rows of one block would otherwise serialise
        64 nested references; see `expand`)."""
        if sample_ids is None:
            ids = sorted(self.table.ids_with(Status.READY, version))[:max_rows]
        else:
            ids = list(sample_ids)[:max_rows]
        rows = [self.table.get(i) for i in ids]
        for row in rows:
            if replay and row.status is Status.CONSUMED:
                if row.consumed_by_step != step or row.policy_version != version:
                    raise ConsistencyError(
                        f"agent {self.agent!r}: row {row.sample_id} (version "
                        f"{row.policy_version}) was consumed by step {row.consumed_by_step}; "
                        f"it cannot be replayed into step {step}")
                continue
            check_row(row, self.agent, version, expected_vector, step)
        out = []
        objects: dict[str, tuple[int, Any]] = {}  # object hex -> (index, ObjectRef)
        for row in rows:
            if row.status is not Status.CONSUMED:
                self.table.transition(row.sample_id, Status.CONSUMED)
                row.consumed_by_step = step
            refs = {}
            for name, ref in row.refs.items():
                obj, i = ref.key if isinstance(ref.key, tuple) else (ref.key, None)
                index = objects.setdefault(obj.hex(), (len(objects), obj))[0]
                refs[name] = (index, i)
            out.append({**{k: getattr(row, k) for k in ROW_FIELDS},
                        "data": dict(row.data), "refs": refs})
        return {"rows": out, "objects": [obj for _, obj in objects.values()]}

    def rows(self) -> list[dict[str, Any]]:
        """Every row held, with its status and payload references (inspection, tests)."""
        return [{**{k: getattr(r, k) for k in ROW_FIELDS}, "status": r.status.value,
                 "refs": {name: ref.key for name, ref in r.refs.items()}}
                for r in self.table.rows.values()]

    def evict(self, version: int) -> int:
        """Drop consumed/failed rows of `version`: their payload refs go with them."""
        n = 0
        for status in (Status.CONSUMED, Status.FAILED):
            for sid in self.table.ids_with(status, version):
                self.table.remove(sid)
                n += 1
        return n

    def counts(self) -> dict[str, int]:
        return {s.value: self.table.count(s) for s in Status}


def expand(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """`serve`'s compact form -> rows whose refs are ObjectRef or (ObjectRef, i) again."""
    objects = batch["objects"]
    return [{**r, "refs": {name: objects[k] if i is None else (objects[k], i)
                           for name, (k, i) in r["refs"].items()}} for r in batch["rows"]]


def fetch_payloads(refs: list[Any]) -> list[np.ndarray]:
    """Resolve payload references (ObjectRef or (ObjectRef, i)), fetching each object once."""
    import ray

    unique: dict[str, Any] = {}
    for r in refs:
        obj = r[0] if isinstance(r, tuple) else r
        unique.setdefault(obj.hex(), obj)
    values = dict(zip(unique, ray.get(list(unique.values())), strict=True))
    return [values[r[0].hex()][r[1]] if isinstance(r, tuple) else values[r.hex()]
            for r in refs]


def samples_from_rows(rows: list[dict[str, Any]] | dict[str, Any]) -> list[Any]:
    """Trainer-side: fetch the micro-batch's log-probs from the object store (each object once,
    in one `ray.get`), build Samples. `rows`: `take_ready`'s rows or `serve`'s compact form."""
    import ray

    from flexmarl.training.trainer import Sample  # torch: only where a trainer runs

    items: list[dict[str, Any]]
    if isinstance(rows, dict):
        values = ray.get(rows["objects"]) if rows["objects"] else []
        items = rows["rows"]
        logprobs = [values[k] if i is None else values[k][i]
                    for k, i in (r["refs"]["logprobs"] for r in items)]
    else:
        items = rows
        logprobs = fetch_payloads([r["refs"]["logprobs"] for r in items])
    return [
        Sample(
            sample_id=r["sample_id"], prompt=r["data"]["prompt"], response=r["data"]["response"],
            old_logprobs=np.asarray(lp).tolist(), advantage=r["data"]["advantage"],
            allowed=r["data"].get("allowed"), temperature=r["data"].get("temperature", 1.0),
            policy_version=r["policy_version"], reward=r["data"].get("reward", 0.0),
        )
        for r, lp in zip(items, logprobs, strict=True)
    ]


@dataclass(frozen=True)
class RayMicroBatch:
    """A micro-batch served by reference: which rows of which table, for which step. The
    trainer actor pulls them from `table` once `after` (the driver's last write) is applied."""

    agent: str
    table: Any  # ActorHandle of the agent's AgentTableActor
    sample_ids: tuple[str, ...]
    version: int
    step: int
    expected_vector: dict[str, int] | None
    after: Any = None  # ObjectRef of the last `apply` call, or None

    def __len__(self) -> int:
        return len(self.sample_ids)


class RayExperienceStore(ExperienceStore):
    """The experience store of a Ray run: per-agent table actors behind the spine's interface.

    The driver-side tables are a metadata mirror (payload references, never payload bytes);
    every write is validated there first (so errors name the row at once) and queued for the
    agent's table actor, which gets one `apply` call per event-loop tick. Ray runs an actor's
    calls from one caller in order, and a trainer pulls only after the last write it depends on
    (`RayMicroBatch.after`), so the table actor sees what the mirror saw. The table actor
    re-checks the consistency contract when it serves a micro-batch.
    """

    def __init__(self, tables: dict[str, Any]) -> None:
        super().__init__(list(tables))
        self.actors = dict(tables)
        self._ops: dict[str, list[tuple]] = {a: [] for a in tables}
        self._flush_pending = False
        self._last_apply: dict[str, Any] = {}
        self._unchecked: list[tuple[str, Any]] = []
        self._taken: dict[tuple[str, tuple[str, ...]], tuple[int, int, dict | None]] = {}
        # Payload arrays the driver resolved: only `fetch` (not used on this runtime's path)
        # and checkpoint snapshots do; a live run's counter stays at 0.
        self.payload_fetches = 0
        self.snapshot_fetches = 0

    # --- batching of writes -----------------------------------------------------------------
    def _queue(self, agent: str, op: tuple) -> None:
        self._ops[agent].append(op)
        if self._flush_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script, a test): write through
            self.flush()
            return
        self._flush_pending = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send every queued write: one `apply` call per agent with pending writes."""
        self._flush_pending = False
        for agent, ops in self._ops.items():
            if ops:
                self._ops[agent] = []
                objects: dict[str, tuple[int, Any]] = {}
                for j, op in enumerate(ops):
                    if op[0] == "generated":
                        refs = {}
                        for name, key in op[3].items():
                            obj, i = key if isinstance(key, tuple) else (key, None)
                            refs[name] = (objects.setdefault(obj.hex(), (len(objects), obj))[0], i)
                        ops[j] = (*op[:3], refs)
                ref = self.actors[agent].apply.remote(ops, [o for _, o in objects.values()])
                self._last_apply[agent] = ref
                self._unchecked.append((agent, ref))

    def check(self, wait: bool = False) -> None:
        """Raise the first write a table actor refused (it would mean the mirror and the
        table disagree); `wait` also waits for writes still in flight."""
        import ray

        if not self._unchecked:
            return
        refs = [r for _, r in self._unchecked]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=None if wait else 0)
        finished = {r.hex() for r in done}
        remaining = []
        for agent, ref in self._unchecked:
            if ref.hex() not in finished:
                remaining.append((agent, ref))
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise StoreError(f"table actor of agent {agent!r} refused a write: {exc}") from exc
        self._unchecked = remaining

    # --- writes: mirror first, then queued for the table actor -----------------------------
    def _put(self, agent: str, array: np.ndarray) -> TensorRef:
        """A payload the driver itself stores (a row restored from a checkpoint, a benchmark's
        rows): adopted by the table actor, like the replicas' blocks."""
        import ray

        array = np.ascontiguousarray(array)
        (ref,) = ray.get(self.actors[agent].adopt.remote(array))
        return TensorRef(ref, tuple(array.shape), str(array.dtype))

    def add(self, row: Row) -> Row:
        super().add(row)
        self._queue(row.agent, ("add", {k: getattr(row, k) for k in ROW_FIELDS}))
        return row

    def set_generated(
        self, agent: str, sample_id: str, data: dict[str, Any], arrays: dict[str, Any]
    ) -> Row:
        row = super().set_generated(agent, sample_id, data, arrays)
        self._queue(agent, ("generated", sample_id, dict(data),
                            {name: ref.key for name, ref in row.refs.items()}))
        return row

    def set_rewarded(self, agent: str, sample_id: str, reward: float) -> Row:
        row = super().set_rewarded(agent, sample_id, reward)
        self._queue(agent, ("rewarded", sample_id, float(reward)))
        return row

    def set_ready(self, agent: str, sample_id: str, advantage: float) -> Row:
        row = super().set_ready(agent, sample_id, advantage)
        self._queue(agent, ("ready", sample_id, float(advantage)))
        return row

    def set_failed(self, agent: str, sample_id: str, error: str) -> Row:
        row = super().set_failed(agent, sample_id, error)
        row.refs.clear()
        self._queue(agent, ("failed", sample_id, error))
        return row

    def _free(self, row: Row) -> None:
        pass  # payloads are Ray objects: freed when the last reference (a table row) goes

    def evict(self, agent: str, version: int) -> int:
        n = super().evict(agent, version)
        self._queue(agent, ("evict", version))
        self.check()
        return n

    # --- reads ------------------------------------------------------------------------------
    def take_ready(
        self,
        agent: str,
        version: int,
        max_rows: int,
        step: int,
        expected_vector: dict[str, int] | None = None,
        sample_ids: list[str] | None = None,
    ) -> list[Row]:
        """Check and consume on the mirror; the table actor consumes the same rows when the
        trainer pulls the micro-batch (`micro_batch`)."""
        rows = super().take_ready(agent, version, max_rows, step, expected_vector, sample_ids)
        if rows:
            ids = tuple(r.sample_id for r in rows)
            self._taken[(agent, ids)] = (version, step, expected_vector)
        return rows

    def micro_batch(self, agent: str, rows: list[Row]) -> RayMicroBatch:
        ids = tuple(r.sample_id for r in rows)
        try:
            version, step, vector = self._taken.pop((agent, ids))
        except KeyError:
            raise StoreError(f"agent {agent!r}: rows {list(ids)[:3]}... were not taken together "
                             "by take_ready; only a taken micro-batch can be served") from None
        self.flush()  # the rows' last writes travel before the trainer asks for them
        return RayMicroBatch(agent, self.actors[agent], ids, version, step,
                             dict(vector) if vector is not None else None,
                             self._last_apply.get(agent))

    def fetch(self, row: Row, name: str) -> np.ndarray:
        self.payload_fetches += 1
        return fetch_payloads([row.refs[name].key])[0]

    def snapshot(self, min_iteration: int) -> list[dict[str, Any]]:
        """As the spine's, with the payloads of rewarded / ready rows (the only ones a resume
        restores) fetched from the object store: a checkpoint is written on the driver."""
        from flexmarl.types import encode_array

        keep = (Status.REWARDED, Status.READY)
        rows = [r for t in self.tables.values() for r in t.rows.values()
                if r.iteration >= min_iteration]
        wanted = [(r, name) for r in rows if r.status in keep for name in r.refs]
        values = fetch_payloads([r.refs[name].key for r, name in wanted]) if wanted else []
        self.snapshot_fetches += len(values)
        arrays: dict[str, dict[str, Any]] = {}
        for (r, name), value in zip(wanted, values, strict=True):
            arrays.setdefault(r.sample_id, {})[name] = encode_array(np.asarray(value))
        return [{
            "sample_id": r.sample_id, "agent": r.agent, "node": r.node,
            "input_id": r.input_id, "turn": r.turn, "trajectory_id": r.trajectory_id,
            "iteration": r.iteration, "policy_version": r.policy_version,
            "version_vector": dict(r.version_vector), "status": r.status.value,
            "data": dict(r.data), "arrays": arrays.get(r.sample_id, {}), "error": r.error,
        } for r in rows]

    def release(self, rows: Iterable[Row]) -> None:
        """Nothing to free yet: a restarted trainer may pull the micro-batch again until the
        step it belongs to is done; `evict` drops the rows (and so their payloads) then."""
        for row in rows:
            if row.status is not Status.CONSUMED:
                raise StoreError(f"row {row.sample_id} released while {row.status.value}")
