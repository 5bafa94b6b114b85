"""The experience store: the only channel between rollout and training.

One table per agent. A row is one node invocation (one sample of one agent), keyed by
`sample_id = {input_id}_{turn}_{trajectory_id}` and the `policy_version` that produced it.
Simple fields travel by value; tensors by reference (handles into an object store), so a row is
cheap to move and its payload is fetched only by whoever trains on it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from flexmarl.errors import UserError
from flexmarl.types import Sample, decode_array, encode_array


class StoreError(UserError, RuntimeError):
    """A store operation that would corrupt the data: names the agent, row and states."""


class ConsistencyError(StoreError):
    """A row that would break the on-policy contract if it were trained on."""


class Status(StrEnum):
    PENDING = "pending"
    GENERATED = "generated"
    REWARDED = "rewarded"
    READY = "ready"
    CONSUMED = "consumed"
    FAILED = "failed"


ALLOWED_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset({Status.GENERATED, Status.FAILED}),
    Status.GENERATED: frozenset({Status.REWARDED, Status.FAILED}),
    Status.REWARDED: frozenset({Status.READY, Status.FAILED}),
    Status.READY: frozenset({Status.CONSUMED}),
    Status.CONSUMED: frozenset(),
    Status.FAILED: frozenset(),
}


def make_sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    for name, part in (("input_id", input_id),):
        if "_" in part:
            raise StoreError(f"{name} {part!r} must not contain '_' (it separates sample_id parts)")
    return f"{input_id}_{turn}_{trajectory_id}"


def parse_sample_id(sample_id: str) -> tuple[str, int, int]:
    try:
        input_id, turn, traj = sample_id.rsplit("_", 2)
        return input_id, int(turn), int(traj)
    except ValueError as exc:
        raise StoreError(f"malformed sample_id {sample_id!r}") from exc


def sample_iteration(sample_id: str) -> int:
    """The iteration a row was generated in (its input id is `{iteration}-{index}`)."""
    input_id = parse_sample_id(sample_id)[0]
    try:
        return int(input_id.split("-", 1)[0])
    except ValueError as exc:
        raise StoreError(f"malformed sample_id {sample_id!r}: input id {input_id!r} does not "
                         "start with an iteration") from exc


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A handle to an array held by an object store (in-memory locally, Ray's on a cluster)."""

    key: Any
    shape: tuple[int, ...]
    dtype: str


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """`str(dtype)`, remembered: numpy builds the name in Python on every call, and every
    generated row stores an array."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


class LocalObjectStore:
    """In-process object store: arrays by handle, freed when their row is consumed or failed."""

    def __init__(self) -> None:
        self._objects: dict[int, np.ndarray] = {}
        self._next = 0

    def put(self, array: np.ndarray) -> TensorRef:
        array = np.ascontiguousarray(array)
        self._next += 1
        self._objects[self._next] = array
        return TensorRef(self._next, array.shape, _dtype_name(array.dtype))

    def get(self, ref: TensorRef) -> np.ndarray:
        try:
            return self._objects[ref.key]
        except KeyError as exc:
            raise StoreError(f"object {ref.key} is not in the object store (freed?)") from exc

    def free(self, ref: TensorRef) -> None:
        self._objects.pop(ref.key, None)

    def __len__(self) -> int:
        return len(self._objects)


@dataclass(slots=True)
class Row:
    sample_id: str
    agent: str
    node: str
    input_id: str
    turn: int
    trajectory_id: int
    iteration: int
    policy_version: int
    version_vector: dict[str, int]
    status: Status = Status.PENDING
    data: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, TensorRef] = field(default_factory=dict)
    error: str | None = None
    consumed_by_step: int | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)


class AgentTable:
    """All rows of one agent, indexed by sample_id and by (status, policy_version)."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.rows: dict[str, Row] = {}
        self._by_status: dict[tuple[Status, int], dict[str, None]] = {}

    def _index(self, row: Row) -> dict[str, None]:
        return self._by_status.setdefault((row.status, row.policy_version), {})

    def insert(self, row: Row) -> None:
        if row.agent != self.agent:
            raise StoreError(f"row {row.sample_id} of agent {row.agent!r} put in table "
                             f"{self.agent!r}")
        if row.sample_id in self.rows:
            raise StoreError(f"agent {self.agent!r}: row {row.sample_id} already exists")
        if row.status is not Status.PENDING:
            raise StoreError(f"agent {self.agent!r}: row {row.sample_id} must start pending")
        self.rows[row.sample_id] = row
        self._index(row)[row.sample_id] = None

    def get(self, sample_id: str) -> Row:
        try:
            return self.rows[sample_id]
        except KeyError as exc:
            raise StoreError(f"agent {self.agent!r}: no row {sample_id}") from exc

    def transition(self, sample_id: str, to: Status) -> Row:
        row = self.rows.get(sample_id) or self.get(sample_id)  # (get: the error naming it)
        if to not in ALLOWED_TRANSITIONS[row.status]:
            raise StoreError(
                f"agent {self.agent!r}: row {sample_id} cannot go from {row.status.value} "
                f"to {to.value}"
            )
        del self._by_status[(row.status, row.policy_version)][sample_id]
        row.status = to
        row.updated_at = time.time()
        self._index(row)[sample_id] = None
        return row

    def remove(self, sample_id: str) -> Row:
        row = self.get(sample_id)
        if row.status not in (Status.CONSUMED, Status.FAILED):
            raise StoreError(f"agent {self.agent!r}: row {sample_id} removed while "
                             f"{row.status.value}")
        del self._index(row)[sample_id]
        del self.rows[sample_id]
        return row

    def drop_unused(self, iteration: int) -> list[Row]:
        """Remove the finished rows of `iteration` (rewarded, ready or failed) that no step will
        take: a frozen agent's; rows still being generated stay."""
        dropped = []
        for (status, _), ids in self._by_status.items():
            if status not in (Status.REWARDED, Status.READY, Status.FAILED):
                continue
            for sid in [i for i in ids if self.rows[i].iteration == iteration]:
                del ids[sid]
                dropped.append(self.rows.pop(sid))
        return dropped

    def ids_with(self, status: Status, version: int) -> list[str]:
        return list(self._by_status.get((status, version), {}))

    def count(self, status: Status, version: int | None = None) -> int:
        if version is not None:
            return len(self._by_status.get((status, version), {}))
        return sum(len(v) for (s, _), v in self._by_status.items() if s is status)


@dataclass
class GenerationStats:
    rows: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0


class ExperienceStore:
    """The multi-table store. Single-writer (the orchestrator's event loop) by design."""

    def __init__(self, agents: Iterable[str], objects: LocalObjectStore | None = None) -> None:
        self.tables = {a: AgentTable(a) for a in agents}
        self.objects = objects if objects is not None else LocalObjectStore()
        self.evicted: dict[str, dict[str, int]] = {a: defaultdict(int) for a in self.tables}
        self._generation: dict[tuple[str, int], GenerationStats] = {}

    def table(self, agent: str) -> AgentTable:
        try:
            return self.tables[agent]
        except KeyError as exc:
            raise StoreError(f"unknown agent {agent!r} (tables: {', '.join(self.tables)})") from exc

    # --- writes ---------------------------------------------------------------------------
    def add(self, row: Row) -> Row:
        self.table(row.agent).insert(row)
        return row

    def set_generated(
        self, agent: str, sample_id: str, data: dict[str, Any], arrays: dict[str, np.ndarray]
    ) -> Row:
        """`arrays` values are arrays to store, or `TensorRef`s a producer already stored (a
        Ray rollout replica puts its payloads into the object store itself)."""
        row = self.table(agent).transition(sample_id, Status.GENERATED)
        row.data.update(data)
        for name, array in arrays.items():
            row.refs[name] = array if isinstance(array, TensorRef) else self._put(agent, array)
        stat = self._generation.setdefault((agent, row.iteration), GenerationStats())
        stat.rows += 1
        stat.prompt_tokens += len(data.get("prompt", ()))
        stat.response_tokens += len(data.get("response", ()))
        return row

    def _put(self, agent: str, array: np.ndarray) -> TensorRef:
        return self.objects.put(array)

    def generation_stats(self, iteration: int) -> dict[str, GenerationStats]:
        """Per agent: rows generated in `iteration` and their prompt / response token counts,
        the demand the rollout balancer plans from (kept after rows are evicted)."""
        return {a: self._generation.get((a, iteration), GenerationStats()) for a in self.tables}

    def set_rewarded(self, agent: str, sample_id: str, reward: float,
                     label: str | None = None) -> Row:
        row = self.table(agent).transition(sample_id, Status.REWARDED)
        row.data["reward"] = float(reward)
        if label is not None:  # the node's true class (`MEG.node(label=...)`)
            row.data["label"] = label
        return row

    def set_ready(self, agent: str, sample_id: str, advantage: float) -> Row:
        row = self.table(agent).transition(sample_id, Status.READY)
        row.data["advantage"] = float(advantage)
        return row

    def set_failed(self, agent: str, sample_id: str, error: str) -> Row:
        row = self.table(agent).transition(sample_id, Status.FAILED)
        row.error = error
        self._free(row)
        return row

    def _free(self, row: Row) -> None:
        for ref in row.refs.values():
            self.objects.free(ref)

    # --- reads ----------------------------------------------------------------------------
    def take_ready(
        self,
        agent: str,
        version: int,
        max_rows: int,
        step: int,
        expected_vector: dict[str, int] | None = None,
        sample_ids: list[str] | None = None,
    ) -> list[Row]:
        """Consume up to `max_rows` ready rows of `agent` produced by `version`, exactly once,
        for optimizer step `step`. `version` is the iteration's policy version of `agent` (its
        entry of the version vector: `step` itself on-policy, max(0, step-1) in one_step_off);
        every row must also come from iteration `step`.

        Rows are taken in sample_id order (or exactly `sample_ids`, in that order) so that the
        set consumed does not depend on timing. Every row is checked against the consistency
        contract before any is handed out.
        """
        table = self.table(agent)
        if sample_ids is None:
            ids = sorted(table.ids_with(Status.READY, version))[:max_rows]
        else:
            ids = list(sample_ids)[:max_rows]
        rows = [table.get(i) for i in ids]
        for row in rows:
            check_row(row, agent, version, expected_vector, step)
        for row in rows:
            table.transition(row.sample_id, Status.CONSUMED)
            row.consumed_by_step = step
        return rows

    def fetch(self, row: Row, name: str) -> np.ndarray:
        return self.objects.get(row.refs[name])

    def micro_batch(self, agent: str, rows: list[Row]) -> Any:
        """What the train pool's `accumulate` gets for rows just taken: here plain `Sample`s
        with their payloads fetched; a distributed store hands over a reference instead."""
        return [
            Sample(
                sample_id=r.sample_id, prompt=r.data["prompt"], response=r.data["response"],
                old_logprobs=self.fetch(r, "logprobs").tolist(),
                advantage=r.data["advantage"], allowed=r.data["allowed"],
                temperature=r.data["temperature"], policy_version=r.policy_version,
                reward=r.data["reward"], truncated=bool(r.data.get("truncated", False)),
            )
            for r in rows
        ]

    def release(self, rows: Iterable[Row]) -> None:
        """Free the payloads of rows already trained on."""
        for row in rows:
            if row.status is not Status.CONSUMED:
                raise StoreError(f"row {row.sample_id} released while {row.status.value}")
            self._free(row)

    def evict(self, agent: str, version: int) -> int:
        """Drop the consumed and failed rows of one version once its step is done (bounded
        memory); their counts stay in `evicted`. Rows still in flight are never dropped."""
        table = self.table(agent)
        n = 0
        for status in (Status.CONSUMED, Status.FAILED):
            for sid in table.ids_with(status, version):
                table.remove(sid)
                self.evicted[agent][status.value] += 1
                n += 1
        return n

    def discard(self, agent: str, iteration: int) -> int:
        """Drop an agent's rows of a finished iteration that no trainer takes (a frozen agent
        acts but is never trained): payloads freed, counts kept in `evicted` under their
        status, so memory stays bounded in long runs and `stats` still counts them."""
        rows = self.table(agent).drop_unused(iteration)
        for row in rows:
            self._free(row)
            self.evicted[agent][row.status.value] += 1
        return len(rows)

    # --- snapshots ------------------------------------------------------------------------
    def snapshot(self, min_iteration: int) -> list[dict[str, Any]]:
        """Rows of iterations >= `min_iteration` (those no committed step has trained on), as
        plain values with their status and whatever payload is still held, for a checkpoint."""

        out = []
        for table in self.tables.values():
            for row in table.rows.values():
                if row.iteration < min_iteration:
                    continue
                arrays = {}
                for name, ref in row.refs.items():
                    if ref.key in self.objects._objects:
                        arrays[name] = encode_array(self.objects.get(ref))
                out.append({
                    "sample_id": row.sample_id, "agent": row.agent, "node": row.node,
                    "input_id": row.input_id, "turn": row.turn,
                    "trajectory_id": row.trajectory_id, "iteration": row.iteration,
                    "policy_version": row.policy_version,
                    "version_vector": dict(row.version_vector), "status": row.status.value,
                    "data": dict(row.data), "arrays": arrays, "error": row.error,
                })
        return out

    def restore_row(self, d: dict[str, Any]) -> Row:
        """Re-insert a snapshotted row of a finished episode as `rewarded` (its group's
        advantages are computed again when the group is complete, exactly as the first time)."""

        if d["status"] not in (Status.REWARDED.value, Status.READY.value):
            raise StoreError(f"agent {d['agent']!r}: row {d['sample_id']} is {d['status']}; "
                             f"only rewarded or ready rows can be restored")
        row = self.add(Row(
            sample_id=d["sample_id"], agent=d["agent"], node=d["node"], input_id=d["input_id"],
            turn=d["turn"], trajectory_id=d["trajectory_id"], iteration=d["iteration"],
            policy_version=d["policy_version"], version_vector=dict(d["version_vector"]),
        ))
        data = {k: v for k, v in d["data"].items() if k not in ("reward", "advantage")}
        arrays = {k: decode_array(v) for k, v in d["arrays"].items()}
        self.set_generated(row.agent, row.sample_id, data, arrays)
        self.set_rewarded(row.agent, row.sample_id, d["data"]["reward"])
        return row

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            agent: {s.value: table.count(s) + self.evicted[agent].get(s.value, 0) for s in Status}
            for agent, table in self.tables.items()
        }


def check_row(
    row: Row, agent: str, version: int, expected_vector: dict[str, int] | None,
    step: int | None = None,
) -> None:
    """The consistency contract: a row of agent a's step k comes from iteration k, was made by
    `version` = a's entry of iteration k's version vector (k itself on-policy, max(0, k-1) in
    one_step_off), in an episode whose version vector is iteration k's, and is ready (never
    consumed before). `step` None: the iteration is not checked."""
    if row.agent != agent:
        raise ConsistencyError(f"row {row.sample_id} of agent {row.agent!r} offered to {agent!r}")
    if row.status is not Status.READY:
        raise ConsistencyError(
            f"agent {agent!r}: row {row.sample_id} is {row.status.value}, not ready"
        )
    if step is not None and row.iteration != step:
        raise ConsistencyError(
            f"agent {agent!r}: row {row.sample_id} has iteration {row.iteration}, but step "
            f"{step} trains only on rows of iteration {step}"
        )
    if row.policy_version != version:
        raise ConsistencyError(
            f"agent {agent!r}: row {row.sample_id} was generated by version "
            f"{row.policy_version} (policy_version), but "
            f"{'the trainer is at' if step is None else f'step {step} trains on'} version "
            f"{version}, the iteration's version vector entry"
        )
    if expected_vector is not None and row.version_vector != expected_vector:
        raise ConsistencyError(
            f"agent {agent!r}: row {row.sample_id} comes from an episode with version vector "
            f"{row.version_vector}, expected {expected_vector}"
        )
