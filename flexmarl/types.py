"""Torch-free contracts shared across layers: what rollout is asked and answers, what a trainer
reads from the store, what a training slot's swap returns, and how arrays travel in
checkpoints and journals.

Lower layers (the store, the runtime interfaces) import these without pulling in torch or a
model; the modules that do the work (`policy.sampling`, `training.trainer`) use the same types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass
class GenerationRequest:
    """One node's call to its agent: prompt ids, budget, decoding constraints, sampling key."""

    sample_id: str
    agent: str
    version: int
    prompt: list[int]
    max_new_tokens: int
    allowed_tokens: list[int] | None = None
    stop_tokens: list[int] = field(default_factory=list)
    temperature: float = 1.0
    seed: int = 0
    # stop strings (matched on the decoded response; the engine needs the agent's tokenizer)
    stop: list[str] = field(default_factory=list)
    # nucleus sampling; log-probs stay those of the tempered distribution before the cut
    top_p: float = 1.0
    # An explicit sampling seed (requests served over HTTP carry one); when None the noise
    # stream is keyed by (seed, sample_id, version), see `policy.sampling.noise_seed_of`.
    noise_seed: int | None = None


@dataclass
class GenerationResult:
    """The sampled ids and their log-probs, with the version that sampled them."""

    sample_id: str
    tokens: list[int]
    logprobs: list[float]
    version: int
    admitted_at: float = 0.0  # when a batch slot took the request (the clock of its replica)
    finished_at: float = 0.0
    queue_s: float = 0.0  # time from submission to admission, filled in by the rollout pool


@dataclass
class Sample:
    """One row as the trainer needs it (the store's data contract, by named keys)."""

    sample_id: str
    prompt: list[int]
    response: list[int]
    old_logprobs: list[float]
    advantage: float
    allowed: list[int] | None
    temperature: float
    policy_version: int
    reward: float = 0.0
    # the token budget ended the completion before its stop token or string
    truncated: bool = False


class Bound(NamedTuple):
    """A training slot's `bind` result (the slot protocol, `training.host`): the agent it
    swapped out (None: the slot was free or held `agent` already), that agent's state as it
    leaves, the token under which this process keeps that state in its kept trainer (None:
    not kept; sent back as `("kept", token)` it swaps in without moving), and the swap's
    seconds and bytes."""

    evicted: str | None
    state: Any
    parked: int | None
    timings: dict[str, float]


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """An array as plain fields (dtype, shape, bytes) for msgpack checkpoints and journals."""
    a = np.ascontiguousarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=d["dtype"]).reshape(d["shape"]).copy()
