"""The replay table: the experience store's one OFF-POLICY table (value-decomposition learners).

The on-policy contract of docs/design.md section 5 does not apply here: rows are joint
transitions of every agent, produced by any earlier version of the policy, and sampled many
times. What the table guarantees instead (the enterprise document's configuration):
- learning starts only once it holds `min_size` transitions (default 5000);
- a sampled batch draws `priority_fraction` of its rows (default 15-20%: 0.15) in proportion
  to priority**alpha (priority = |TD error| + eps, new rows at the current maximum) and the
  rest uniformly;
- each sampled row carries the age weight w = 1 / (1 + log(age)), age = steps since it was
  inserted + 1 (w = 1 for a fresh row, decaying slowly), which the learner multiplies into
  its loss so that stale behaviour counts for less;
- a ring buffer of `capacity` rows: the oldest goes first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexmarl.errors import UserError


class ReplayError(UserError, ValueError):
    """A replay configuration that cannot work: names the field."""


def age_weight(age: np.ndarray) -> np.ndarray:
    """w = 1 / (1 + log(age)), age >= 1 (steps since insertion + 1)."""
    age = np.asarray(age, dtype=np.float64)
    if (age < 1).any():
        raise ReplayError("age must be >= 1 (steps since insertion + 1)")
    return 1.0 / (1.0 + np.log(age))


@dataclass
class ReplayBatch:
    index: np.ndarray  # [B] slots, for priority updates
    data: dict[str, np.ndarray]  # field -> [B, ...]
    age_weight: np.ndarray  # [B]
    prioritized: np.ndarray  # [B] bool: drawn by priority (else uniformly)


class ReplayTable:
    """A ring buffer of named fields with priorities and insertion steps."""

    def __init__(self, capacity: int, min_size: int = 5000, priority_fraction: float = 0.15,
                 alpha: float = 0.6, eps: float = 1e-3) -> None:
        if capacity < min_size:
            raise ReplayError(f"replay.capacity ({capacity}) must be >= replay.min_size "
                              f"({min_size})")
        if not 0 <= priority_fraction <= 1:
            raise ReplayError(f"replay.priority_fraction must be in [0, 1], got "
                              f"{priority_fraction}")
        self.capacity, self.min_size = capacity, min_size
        self.priority_fraction, self.alpha, self.eps = priority_fraction, alpha, eps
        self.fields: dict[str, np.ndarray] = {}
        self.priority = np.zeros(capacity, np.float64)
        self.inserted = np.zeros(capacity, np.int64)
        self.size = 0
        self.cursor = 0

    def __len__(self) -> int:
        return self.size

    @property
    def ready(self) -> bool:
        return self.size >= self.min_size

    def add(self, rows: dict[str, np.ndarray], step: int) -> None:
        """Insert n rows (every field [n, ...]) at `step`, at the current maximum priority."""
        n = len(next(iter(rows.values())))
        for name, value in rows.items():
            if name not in self.fields:
                self.fields[name] = np.zeros((self.capacity, *value.shape[1:]), value.dtype)
        top = self.priority[: self.size].max() if self.size else 1.0
        idx = (self.cursor + np.arange(n)) % self.capacity
        for name, value in rows.items():
            self.fields[name][idx] = value
        self.priority[idx] = top
        self.inserted[idx] = step
        self.cursor = int((self.cursor + n) % self.capacity)
        self.size = min(self.capacity, self.size + n)

    def sample(self, batch_size: int, step: int, rng: np.random.Generator) -> ReplayBatch:
        if not self.ready:
            raise ReplayError(f"replay table holds {self.size} rows, fewer than min_size "
                              f"{self.min_size}")
        n_prio = int(round(self.priority_fraction * batch_size))
        p = self.priority[: self.size] ** self.alpha
        prio = rng.choice(self.size, size=n_prio, p=p / p.sum()) if n_prio else \
            np.zeros(0, np.int64)
        uni = rng.integers(self.size, size=batch_size - n_prio)
        idx = np.concatenate([prio, uni]).astype(np.int64)
        age = step - self.inserted[idx] + 1
        return ReplayBatch(idx, {k: v[idx] for k, v in self.fields.items()}, age_weight(age),
                           np.arange(batch_size) < n_prio)

    def update_priorities(self, index: np.ndarray, td_error: np.ndarray) -> None:
        self.priority[index] = np.abs(td_error) + self.eps
