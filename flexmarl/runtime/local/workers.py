"""Worker processes of the local runtime: a rollout replica and a training worker.

Each runs a loop over one pipe, with its own torch thread count, so the rollout pool and the
training pool really compute at the same time. Messages are `(msg_id, command, payload)`;
replies are `(msg_id, ok, result, spans)` where spans are `(start, end, label)` wall times.
Tensors cross the pipe as numpy arrays (plain pickling, no shared-memory file descriptors).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its models, independent of the parent's state."""

    config: dict[str, Any]
    vocab_size: int
    max_seq_len: int
    agents: list[str]
    torch_threads: int
    deterministic: bool
    max_batch_seqs: int = 64
    swap_dir: str | None = None  # training slots: where swapped-out states go (None: host)


def _setup_torch(spec: WorkerSpec) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(spec.torch_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if spec.deterministic:
        torch.use_deterministic_algorithms(True)


def to_numpy(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in weights.items()}


def from_numpy(weights: Any) -> dict[str, Any]:
    """Tensors from a numpy dict, or from the state interface's wire form (`publish_form`)."""
    import torch

    if isinstance(weights, tuple):
        from flexmarl.training.state import from_wire

        return from_wire(weights).tensors
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}


def publish_form(weights: dict[str, Any], agent: str, version: int) -> Any:
    """Published weights travel as a `TrainingState` in wire form: one flat buffer, any dtype."""
    from flexmarl.training.state import TrainingState, to_wire

    return to_wire(TrainingState(weights, {"agent": agent, "version": version}))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"


def rollout_worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A rollout replica hosting the models of `spec.agents`; batches waiting requests."""
    _setup_torch(spec)
    from flexmarl.config.schema import RunConfig
    from flexmarl.policy.model import build_model
    from flexmarl.policy.sampling import generate

    cfg = RunConfig.model_validate(spec.config)
    models = {
        a: build_model(a, cfg.agents[a].model, spec.vocab_size, spec.max_seq_len, cfg.seed)
        for a in spec.agents
    }
    versions = dict.fromkeys(spec.agents, 0)
    pending: list[tuple[int, Any]] = []  # (msg_id, GenerationRequest) in arrival order
    priorities: dict[int, tuple] = {}
    running = True
    conn.send((-1, True, "ready", []))
    while running:
        # Block only when idle; otherwise drain whatever arrived while we computed.
        if not pending:
            messages = [conn.recv()]
        else:
            messages = []
        while conn.poll(0):
            messages.append(conn.recv())
        for msg_id, command, payload in messages:
            if command == "generate":
                for sub_id, request, priority in payload:
                    pending.append((sub_id, request))
                    priorities[sub_id] = priority
            elif command == "load_weights":
                agent, version, weights = payload
                t0 = time.time()
                try:
                    # a version may carry only the tensors that changed (LoRA: adapted layers)
                    models[agent].load_state_dict(from_numpy(weights), strict=False)
                    versions[agent] = version
                    conn.send((msg_id, True, version, [(t0, time.time(), f"load:{agent}")]))
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    conn.send((msg_id, False, _error(exc), []))
            elif command == "stop":
                running = False
                conn.send((msg_id, True, None, []))
        if not running or not pending:
            continue
        # The next batch: the agent of the highest-priority waiting request, then that agent's
        # requests in priority order (episodes that started first finish first).
        pending.sort(key=lambda item: priorities[item[0]])
        agent = pending[0][1].agent
        # Deterministic mode decodes each sequence alone: numerics then never depend on which
        # requests happened to share a batch.
        limit = 1 if spec.deterministic else spec.max_batch_seqs
        chosen = [item for item in pending if item[1].agent == agent][:limit]
        chosen_ids = {sub_id for sub_id, _ in chosen}
        pending = [item for item in pending if item[0] not in chosen_ids]
        replies = []
        try:
            stale = [r for _, r in chosen if r.version != versions[agent]]
            if stale:
                raise RuntimeError(
                    f"agent {agent!r}: request {stale[0].sample_id} wants version "
                    f"{stale[0].version}, replica holds {versions[agent]}"
                )
            t0 = time.time()
            results = generate(models[agent], [r for _, r in chosen])
            t1 = time.time()
            for (sub_id, _), result in zip(chosen, results, strict=True):
                replies.append((sub_id, True, result))
            span = (t0, t1, f"gen:{agent}:{len(chosen)}")
        except Exception as exc:  # noqa: BLE001
            err = _error(exc)
            replies = [(sub_id, False, err) for sub_id, _ in chosen]
            span = None
        for sub_id, _ in chosen:
            priorities.pop(sub_id, None)
        conn.send((-2, True, replies, [span] if span else []))


def train_worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A training slot: hosts the trainer of whichever agent the parent's allocator binds to it
    (`bind` swaps the resident out and the new agent in); the other commands act on it."""
    _setup_torch(spec)
    from flexmarl.config.schema import RunConfig
    from flexmarl.training.slots import TrainSlot

    cfg = RunConfig.model_validate(spec.config)
    slot = TrainSlot(cfg, spec.vocab_size, spec.max_seq_len, spec.swap_dir)
    trainers = slot.trainers  # the resident trainer(s), by agent
    conn.send((-1, True, "ready", []))
    while True:
        msg_id, command, payload = conn.recv()
        t0 = time.time()
        try:
            if command == "stop":
                conn.send((msg_id, True, None, []))
                return
            if command == "bind":
                agent, incoming = payload
                result = slot.bind(agent, incoming)
                label = f"swap:{agent}"
            elif command == "accumulate":
                agent, samples = payload
                result = trainers[agent].accumulate(samples)
                label = f"acc:{agent}:{len(samples)}"
            elif command == "step":
                agent = payload
                metrics = trainers[agent].step()
                trainer = trainers[agent]
                result = (metrics, publish_form(trainer.weights(), agent, trainer.version))
                label = f"step:{agent}"
            elif command == "weights":
                agent = payload
                trainer = trainers[agent]
                result = publish_form(trainer.weights(), agent, trainer.version)
                label = f"weights:{agent}"
            elif command == "save":
                agent, directory = payload
                result = str(trainers[agent].save(directory))
                label = f"save:{agent}"
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send((msg_id, True, result, [(t0, time.time(), label)]))
        except Exception as exc:  # noqa: BLE001
            conn.send((msg_id, False, _error(exc), []))
