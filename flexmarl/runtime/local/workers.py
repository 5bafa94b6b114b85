"""Worker processes of the local runtime: a rollout replica and a training worker.

Each runs a loop over one pipe, with its own torch thread count, so the rollout pool and the
training pool really compute at the same time. Messages are `(msg_id, command, payload)`;
replies are `(msg_id, ok, result, spans)` where spans are `(start, end, label)` wall times.
Tensors cross the pipe as numpy arrays (plain pickling, no shared-memory file descriptors).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from flexmarl.policy.device import Placement
from flexmarl.runtime.heap import settle as settle_heap


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
    heartbeat_s: float = 2.0
    swap_dir: str | None = None  # training slots: where swapped-out states go (None: host)
    placement: Placement = Placement()  # the device(s) this worker computes on


HEARTBEAT = -3  # message id of a liveness beat: `(HEARTBEAT, True, time, [])`


class LockedConnection:
    """A pipe end shared by the worker loop and its heartbeat thread (sends must not interleave)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self._lock:
            self._conn.send(msg)

    def recv(self) -> Any:
        return self._conn.recv()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)


def start_heartbeat(conn: Connection, spec: WorkerSpec) -> LockedConnection:
    """Beat every `spec.heartbeat_s` from a daemon thread, so a worker stuck in a long
    computation still shows it is alive and a hung or frozen one shows that it is not."""
    locked = LockedConnection(conn)

    def beat() -> None:
        while True:
            time.sleep(spec.heartbeat_s)
            try:
                locked.send((HEARTBEAT, True, time.time(), []))
            except (OSError, ValueError):
                return

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return locked


def state_to_numpy(state: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict, dict]:
    arrays, meta = state
    return {k: np.asarray(v) for k, v in arrays.items()}, meta


def _setup_torch(spec: WorkerSpec) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flexmarl.policy.device import set_process_device

    set_process_device(spec.placement)  # before any CUDA call: this worker sees its GPUs only
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
    """A rollout replica hosting the models of `spec.agents`, one continuous batch per model.

    Between decode steps it reads new requests and admits them into its model's running batch
    as budgets allow; a finished sequence is answered at once, not when its batch ends. Models
    sharing the replica take decode steps in turn.
    """
    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    from flexmarl.config.schema import RunConfig

    cfg = RunConfig.model_validate(spec.config)
    # Deterministic mode decodes each sequence alone: numerics then never depend on which
    # requests happened to share a batch.
    max_seqs = 1 if spec.deterministic else spec.max_batch_seqs
    from flexmarl.policy.adapters import engine_groups

    # one engine per model: agents on a shared base (`models:`) share one engine, whose
    # continuous batch mixes their requests (each row through its agent's adapter)
    groups = engine_groups(cfg, spec.agents)
    group_engines: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    engines: dict[str, Any] = {}  # by agent
    for key, members in groups.items():
        group_engines[key], memory[key] = make_engine(key, members, cfg, spec, max_seqs)
        for a in members:
            engines[a] = group_engines[key]
    set_kv_budgets(group_engines, cfg)
    versions = dict.fromkeys(spec.agents, 0)
    settle_heap()
    waiting: dict[str, list[tuple[int, Any]]] = {a: [] for a in spec.agents}
    priorities: dict[int, tuple] = {}
    running_ids: dict[str, dict[str, int]] = {g: {} for g in groups}  # sample_id -> sub_id
    deferred: dict[str, tuple[int, int, Any]] = {}  # agent -> (msg_id, version, weights)
    busy_since: float | None = None
    step_turn = itertools.count()
    running = True
    total = sum(m.pop("resident_bytes", 0) for m in memory.values())
    conn.send((-1, True, {"ready": True, "memory": {"resident_mb": _mb(total),
                                                    "models": memory}}, []))

    def busy(agent: str) -> int:
        """Running sequences of `agent` (its weights must not change under them)."""
        engine = engines[agent]
        return engine.active_for(agent) if hasattr(engine, "active_for") else engine.active

    def load(agent: str, msg_id: int, version: int, weights: Any) -> None:
        t0 = time.time()
        try:
            engine = engines[agent]
            if getattr(engine, "adapters", None) is not None:
                engine.load_weights(from_numpy(weights), agent)
            else:
                engine.load_weights(from_numpy(weights))
            versions[agent] = version
            conn.send((msg_id, True, version, [(t0, time.time(), f"load:{agent}")]))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send((msg_id, False, _error(exc), []))

    def has_work() -> bool:
        """Something to decode now: running sequences, or requests the loaded weights serve
        (requests for a newer version wait for its weights without spinning)."""
        return any(e.active for e in group_engines.values()) or any(
            r.version <= versions[a] for a, queue in waiting.items() for _, r in queue)

    while running:
        messages = [] if has_work() else [conn.recv()]  # block only when idle
        while conn.poll(0):
            messages.append(conn.recv())
        for msg_id, command, payload in messages:
            if command == "generate":
                for sub_id, request, priority in payload:
                    waiting[request.agent].append((sub_id, request))
                    priorities[sub_id] = priority
            elif command == "load_weights":
                agent, version, weights = payload
                if busy(agent):  # never swap weights under running sequences
                    deferred[agent] = (msg_id, version, weights)
                else:
                    load(agent, msg_id, version, weights)
            elif command == "stop":
                running = False
                conn.send((msg_id, True, None, []))
        for agent in list(deferred):
            if not busy(agent):
                load(agent, *deferred.pop(agent))
        if not running or not has_work():
            continue
        replies: list[tuple[int, bool, Any]] = []
        # requests for an older version than the replica holds can never be served
        for agent, queue in waiting.items():
            stale = [(i, r) for i, r in queue if r.version < versions[agent]]
            for sub_id, r in stale:
                replies.append((sub_id, False, f"agent {agent!r}: request {r.sample_id} wants "
                                f"version {r.version}, replica holds {versions[agent]}"))
                priorities.pop(sub_id, None)
            if stale:
                waiting[agent] = [item for item in queue if item not in stale]

        candidates = [g for g, e in group_engines.items() if e.active or any(
            r.version == versions[a] for a in groups[g] for _, r in waiting[a])]
        if busy_since is None:
            busy_since = time.time()
        if candidates:
            # models sharing a replica take decode steps in turn: an upstream agent with a few
            # short requests is never starved behind another model's long generations
            turn = next(step_turn)
            group = candidates[turn % len(candidates)]
            engine = group_engines[group]
            queue = sorted(((sub_id, r) for a in groups[group] for sub_id, r in waiting[a]),
                           key=lambda item: priorities[item[0]])
            take: list[tuple[int, Any]] = []
            tokens = 0
            for sub_id, r in queue:
                if r.version != versions[r.agent] or not engine.fits(r, len(take), tokens):
                    continue
                take.append((sub_id, r))
                tokens += len(r.prompt) + r.max_new_tokens
            if take:
                taken = {sub_id for sub_id, _ in take}
                for a in groups[group]:
                    waiting[a] = [item for item in waiting[a] if item[0] not in taken]
                for sub_id, r in take:
                    running_ids[group][r.sample_id] = sub_id
            try:
                finished = engine.admit([r for _, r in take]) + engine.step()
            except Exception as exc:  # noqa: BLE001 - fail this model's batch, keep serving
                err = _error(exc)
                finished = []
                for sub_id in running_ids[group].values():
                    replies.append((sub_id, False, err))
                    priorities.pop(sub_id, None)
                running_ids[group].clear()
                engine.reset()
            for result in finished:
                sub_id = running_ids[group].pop(result.sample_id)
                priorities.pop(sub_id, None)
                replies.append((sub_id, True, result))
        if replies:
            now = time.time()
            label = f"gen:{'+'.join(a for a in engines if busy(a)) or 'idle'}"
            conn.send((-2, True, replies, [(busy_since, now, label)]))
            busy_since = now if has_work() else None


def _mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 3)


def make_engine(key: str, agents: list[str], cfg: Any, spec: WorkerSpec, max_seqs: int
                ) -> tuple[Any, dict[str, Any]]:
    """The engine of one model on this replica and what it holds in memory: transformers (hf)
    or vLLM for one agent's own model; for agents on a shared base (`key` "base:NAME"), one hf
    engine over the base with each agent's adapter. The hf model sits on this process's
    device in the agent's compute dtype."""
    from flexmarl.policy.adapters import build_replica_model, resident_bytes
    from flexmarl.policy.device import CPU_MAX_BATCH_TOKENS, compute_dtype, process_device
    from flexmarl.policy.model import build_model
    from flexmarl.rollout.engine import HFEngine

    acfg = cfg.agents[agents[0]]
    kv_tokens = cfg.rollout.max_batch_tokens or CPU_MAX_BATCH_TOKENS
    dev = process_device()
    dtype = compute_dtype(acfg.model.dtype, dev)
    if acfg.model.base is not None:
        model, names, mem = build_replica_model(cfg, agents, spec.vocab_size, spec.max_seq_len,
                                                dev, dtype)
        memory = {"agents": agents, "resident_bytes": resident_bytes(model),
                  "base_mb": _mb(mem["base_bytes"]),
                  "agent_mb": {a: _mb(b) for a, b in mem["agent_bytes"].items()}}
        return HFEngine(model, max_seqs, kv_tokens, adapters=names,
                        tokenizer=tokenizer_loader(agents[0], acfg, spec.vocab_size)), memory
    agent = agents[0]
    if acfg.backend.kind == "vllm":
        from flexmarl.rollout.backends.vllm import VLLMEngine

        return VLLMEngine(agent, acfg, max_seqs), {"agents": agents}
    model = build_model(agent, acfg.model, spec.vocab_size, spec.max_seq_len, cfg.seed, dev, dtype)
    nbytes = resident_bytes(model)
    return HFEngine(model, max_seqs, kv_tokens,
                    tokenizer=tokenizer_loader(agent, acfg, spec.vocab_size)), {
        "agents": agents, "resident_bytes": nbytes, "agent_mb": {agent: _mb(nbytes)}}


def tokenizer_loader(agent: str, acfg: Any, vocab_size: int) -> Any:
    """The agent's tokenizer, loaded on the first request with stop strings."""
    from flexmarl.policy.tokenizer import agent_tokenizer

    return lambda: agent_tokenizer(agent, acfg.model, vocab_size)


def set_kv_budgets(engines: dict[str, Any], cfg: Any) -> None:
    """Unless `rollout.max_batch_tokens` is set, each hf engine of a GPU replica gets an equal
    share of `rollout.kv_memory_fraction` of the memory left once every model is loaded."""
    from flexmarl.policy.device import kv_token_budget
    from flexmarl.rollout.engine import HFEngine

    hf = [e for e in engines.values() if isinstance(e, HFEngine)]
    for engine in hf:
        engine.max_tokens = kv_token_budget(cfg.rollout.max_batch_tokens, engine.model,
                                            cfg.rollout.kv_memory_fraction / len(hf))


def train_worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A training slot: a `TrainHost` running the slot protocol's commands from the parent's
    `LocalTrainPool` (`bind` swaps the resident out and the new agent in)."""
    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    from flexmarl.config.schema import RunConfig
    from flexmarl.training.host import TrainHost

    cfg = RunConfig.model_validate(spec.config)
    host = TrainHost(cfg, spec.vocab_size, spec.max_seq_len, spec.swap_dir)
    settle_heap()
    conn.send((-1, True, "ready", []))
    while True:
        msg_id, command, payload = conn.recv()
        t0 = time.time()
        try:
            if command == "stop":
                conn.send((msg_id, True, None, []))
                return
            result, label = host.handle(command, payload)
            conn.send((msg_id, True, result, [(t0, time.time(), label)]))
        except Exception as exc:  # noqa: BLE001
            conn.send((msg_id, False, _error(exc), []))
