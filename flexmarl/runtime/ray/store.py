"""The experience store on Ray: payloads in the object store, one table actor per agent.

- `RayObjectStore` is the drop-in payload store for `ExperienceStore` (same interface as
  `LocalObjectStore`): `put` returns a `TensorRef` whose key is a `ray.ObjectRef`.
- `AgentTableActor` holds one agent's rows (the spine's `AgentTable`, statuses and the
  consistency contract included) on any node. Rows carry small fields by value and payloads as
  ObjectRefs created by whoever produced them; the table never fetches a payload, and a
  micro-batch it serves carries the refs, so the consumer (a trainer actor) fetches the bytes
  from the object store itself, never through the driver.

A payload reference is either an `ObjectRef` (the whole object is the row's array) or
`(ObjectRef, i)`: row i of a block a producer put once for a whole generation batch. Blocks
keep `ray.put` off the per-row path (one put costs ~0.1-1 ms; a batch holds up to 64 rows).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexmarl.store.experience import AgentTable, Row, Status, StoreError, TensorRef, check_row


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

    def take_ready(
        self, version: int, max_rows: int, step: int,
        expected_vector: dict[str, int] | None = None,
    ) -> list[dict[str, Any]]:
        """Consume up to `max_rows` ready rows of `version` (sample_id order), exactly once;
        the reply holds small fields by value and payloads as ObjectRefs."""
        ids = sorted(self.table.ids_with(Status.READY, version))[:max_rows]
        rows = [self.table.get(i) for i in ids]
        for row in rows:
            check_row(row, self.agent, version, expected_vector)
        out = []
        for row in rows:
            self.table.transition(row.sample_id, Status.CONSUMED)
            row.consumed_by_step = step
            out.append({
                **{k: getattr(row, k) for k in ROW_FIELDS},
                "data": dict(row.data),
                "refs": {name: ref.key for name, ref in row.refs.items()},
            })
        return out

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


def samples_from_rows(rows: list[dict[str, Any]]) -> list[Any]:
    """Trainer-side: fetch the micro-batch's log-probs from the object store, build Samples."""
    from flexmarl.training.trainer import Sample  # torch: only where a trainer runs

    logprobs = fetch_payloads([r["refs"]["logprobs"] for r in rows])
    return [
        Sample(
            sample_id=r["sample_id"], prompt=r["data"]["prompt"], response=r["data"]["response"],
            old_logprobs=np.asarray(lp).tolist(), advantage=r["data"]["advantage"],
            allowed=r["data"].get("allowed"), temperature=r["data"].get("temperature", 1.0),
            policy_version=r["policy_version"],
        )
        for r, lp in zip(rows, logprobs, strict=True)
    ]
