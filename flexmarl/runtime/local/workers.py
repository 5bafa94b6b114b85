"""Worker processes of the local runtime: a rollout replica and a training worker.

Each runs a loop over one pipe, with its own torch thread count, so the rollout pool and the
training pool really compute at the same time. Messages are `(msg_id, command, payload)`;
replies are `(msg_id, ok, result, spans)` where spans are `(start, end, label)` wall times.
Tensors cross the pipe as numpy arrays (plain pickling, no shared-memory file descriptors).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from flexmarl.policy.device import Placement, set_process_device
from flexmarl.runtime.heap import settle as settle_heap
from flexmarl.training.state import from_numpy, publish_form, state_to_numpy  # noqa: F401 - the workers' wire forms


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
    # runtime.publication collective: (host, port, timeout_s) of the driver's TCPStore
    publication: tuple[str, int, float] | None = None
    # a sharded training slot (K > 1): the placements of its ranks 1..K-1 (rank 0 starts
    # them, `slot_ranks.form_slot`), and the folder its ranks swap and restart through
    slot_ranks: tuple[Placement, ...] = ()
    shard_dir: str | None = None
    # what starts ranks 1..K-1 (`slot_ranks.form_slot`): None, child processes; Ray, actors
    rank_launcher: Any = None


HEARTBEAT = -3  # message id of a liveness beat: `(HEARTBEAT, True, time, [])`


class LockedConnection:
    """A pipe end shared by the worker loop and its heartbeat thread (sends must not interleave)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self._lock:
            self._conn.send(msg)

    def send_if_free(self, msg: Any) -> None:
        """Send unless another send holds the pipe (whose message will count as a beat)."""
        if self._lock.acquire(blocking=False):
            try:
                self._conn.send(msg)
            finally:
                self._lock.release()

    def recv(self) -> Any:
        return self._conn.recv()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)


class BeatingPipe:
    """A local worker's end of its pipe, with a clock in shared memory (`beat`, seconds of
    `time.monotonic`, one clock for every process of the machine) that its heartbeat thread
    sets. A beat on the pipe waits behind whatever the worker is sending: a large message (a
    model's published weights) on a loaded machine can take longer than the heartbeat limit
    to cross, and the worker would be declared lost while it works. Everything else is the
    pipe's (`send`, `recv`, `poll`, ...)."""

    def __init__(self, conn: Connection, beat: Any) -> None:
        self.conn, self.beat = conn, beat

    def __getattr__(self, name: str) -> Any:
        if name in ("conn", "beat"):  # not set yet: unpickling in the worker
            raise AttributeError(name)
        return getattr(self.conn, name)


def start_heartbeat(conn: Connection, spec: WorkerSpec) -> LockedConnection:
    """Beat every `spec.heartbeat_s` from a daemon thread, so a worker stuck in a long
    computation still shows it is alive and a hung or frozen one shows that it is not: into
    the shared clock of a `BeatingPipe` (local processes), and on the pipe (every transport)."""
    locked = LockedConnection(conn)
    clock = getattr(conn, "beat", None)

    def beat() -> None:
        while True:
            time.sleep(spec.heartbeat_s)
            if clock is not None:
                clock.value = time.monotonic()
            try:  # never behind a long send: the shared clock must keep beating
                locked.send_if_free((HEARTBEAT, True, time.time(), []))
            except (OSError, ValueError):
                return

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    return locked


def _setup_torch(spec: WorkerSpec) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    set_process_device(spec.placement)  # before any CUDA call: this worker sees its GPUs only
    torch.set_num_threads(spec.torch_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if spec.deterministic:
        torch.use_deterministic_algorithms(True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"


def rollout_worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A rollout replica hosting the models of `spec.agents`, one continuous batch per model.

    A thin loop around the shared `ReplicaScheduler` (queues, versions, deferred loads, turns
    between models): between decode steps it reads new messages and feeds them in; a finished
    sequence is answered at once, not when its batch ends.
    """
    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.config.schema import RunConfig
    from flexmarl.rollout.scheduler import Loaded, Reply

    cfg = RunConfig.model_validate(spec.config)
    sched, memory = build_scheduler(cfg, spec)
    groups = None
    if spec.publication is not None:
        # start-up cost: a spawned worker imports only its own role's stack
        from flexmarl.runtime.local.publication import PairGroups

        groups = PairGroups(*spec.publication)
    settle_heap()
    busy_since: float | None = None
    running = True
    total = sum(m.pop("resident_bytes", 0) for m in memory.values())
    conn.send((-1, True, {"ready": True, "memory": {"resident_mb": _mb(total),
                                                    "models": memory}}, []))
    while running:
        messages = [] if sched.has_work() else [conn.recv()]  # block only when idle
        while conn.poll(0):
            messages.append(conn.recv())
        events: list[Any] = []
        for msg_id, command, payload in messages:
            chaos_stall("rollout", command)
            if command == "generate":
                for sub_id, request, priority in payload:
                    sched.submit(sub_id, request, priority)
            elif command == "load_weights":
                events += sched.load(msg_id, *payload)
            elif command == "load_collective":  # (ref, pair key, backend): from the slot
                try:
                    assert groups is not None, "collective publication is not set up"
                    events += sched.load(msg_id, payload[0].agent, payload[0].version,
                                         receive_collective(groups, *payload))
                except Exception as exc:  # noqa: BLE001 - the driver recovers the peer
                    conn.send((msg_id, False, _error(exc), []))
            elif command in ("sleep", "wake", "memory"):  # runtime.colocate
                t0 = time.time()
                try:
                    if command == "memory":
                        result, spans = sched.memory(), []
                    else:  # payload: the agents whose engines sleep or wake (None: all)
                        result = getattr(sched, command)(payload)
                        who = "+".join(payload) if payload else ""
                        spans = [(t0, time.time(), f"{command}:{who}")]
                    conn.send((msg_id, True, result, spans))
                except Exception as exc:  # noqa: BLE001 - reported to the driver
                    conn.send((msg_id, False, _error(exc), []))
            elif command == "stop":
                running = False
                conn.send((msg_id, True, None, []))
        if running and sched.has_work():
            if busy_since is None:
                busy_since = time.time()
            events += sched.step()
        replies: list[tuple[int, bool, Any]] = []
        answered: dict[str, None] = {}
        for ev in events:
            if isinstance(ev, Loaded):
                conn.send((ev.key, True, ev.version, [(ev.start, ev.end, f"load:{ev.agent}")])
                          if ev.ok else (ev.key, False, ev.error, []))
            elif isinstance(ev, Reply):
                replies.append((ev.key, ev.ok, ev.result))
                answered[ev.agent] = None
        if replies and running:
            now = time.time()
            # the agents decoded since the last span: those answered and those still running
            label = f"gen:{'+'.join(dict.fromkeys([*answered, *sched.busy_agents()]))}"
            conn.send((-2, True, replies, [(busy_since or now, now, label)]))
            busy_since = now if sched.has_work() else None


def receive_collective(groups: Any, ref: Any, key: str, backend: str) -> Any:
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.runtime.local.publication import receive

    return receive(groups, ref, key, backend)


def build_scheduler(cfg: Any, spec: WorkerSpec) -> tuple[Any, dict[str, Any]]:
    """The replica's engines (one per model: agents on a shared base (`models:`) share one,
    whose batch mixes their requests, each row through its agent's adapter) under one
    `ReplicaScheduler`; and what each model holds in memory. Deterministic mode decodes each
    sequence alone: numerics then never depend on which requests shared a batch."""
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.policy.adapters import engine_groups
    from flexmarl.rollout.scheduler import ReplicaScheduler

    max_seqs = 1 if spec.deterministic else spec.max_batch_seqs
    groups = engine_groups(cfg, spec.agents)
    engines: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for key, members in groups.items():
        engines[key], memory[key] = make_engine(key, members, cfg, spec, max_seqs)
    set_kv_budgets(engines, cfg)
    sched = ReplicaScheduler(groups, engines, max_batch_seqs=spec.max_batch_seqs,
                             deterministic=spec.deterministic, clock=time.time,
                             convert=from_numpy, describe=_error)
    return sched, memory


def _mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 3)


def make_engine(key: str, agents: list[str], cfg: Any, spec: WorkerSpec, max_seqs: int
                ) -> tuple[Any, dict[str, Any]]:
    """The engine of one model on this replica and what it holds in memory: transformers (hf)
    for one agent's own model; for agents on a shared base (`key` "base:NAME"), one hf
    engine over the base with each agent's adapter. The hf model sits on this process's
    device in the agent's compute dtype."""
    # start-up cost: a spawned worker imports only its own role's stack
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
    model = build_model(agent, acfg.model, spec.vocab_size, spec.max_seq_len, cfg.seed, dev, dtype)
    nbytes = resident_bytes(model)
    return HFEngine(model, max_seqs, kv_tokens,
                    tokenizer=tokenizer_loader(agent, acfg, spec.vocab_size)), {
        "agents": agents, "resident_bytes": nbytes, "agent_mb": {agent: _mb(nbytes)}}


def tokenizer_loader(agent: str, acfg: Any, vocab_size: int) -> Any:
    """The agent's tokenizer, loaded on the first request with stop strings."""
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.policy.tokenizer import agent_tokenizer

    return lambda: agent_tokenizer(agent, acfg.model, vocab_size)


def set_kv_budgets(engines: dict[str, Any], cfg: Any) -> None:
    """Unless `rollout.max_batch_tokens` is set, each hf engine of a GPU replica gets an equal
    share of `rollout.kv_memory_fraction` of the memory left once every model is loaded."""
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.policy.device import kv_token_budget
    from flexmarl.rollout.engine import HFEngine

    hf = [e for e in engines.values() if isinstance(e, HFEngine)]
    for engine in hf:
        engine.max_tokens = kv_token_budget(cfg.rollout.max_batch_tokens, engine.model,
                                            cfg.rollout.kv_memory_fraction / len(hf))
        if engine.device.type == "cuda":
            engine.reserve_kv()  # the paged pool, reserved once


def train_worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """A training slot: a `TrainHost` running the slot protocol's commands from the parent's
    `LocalTrainPool` (`bind` swaps the resident out and the new agent in)."""
    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.config.schema import RunConfig
    from flexmarl.training.host import TrainHost

    cfg = RunConfig.model_validate(spec.config)
    leader = None
    if spec.slot_ranks:  # a sharded slot: this is rank 0, the others follow its commands
        # start-up cost: a spawned worker imports only its own role's stack
        from flexmarl.runtime.local.slot_ranks import end_rank, form_slot

        leader = form_slot(spec)
    host = TrainHost(cfg, spec.vocab_size, spec.max_seq_len, spec.swap_dir,
                     world=1 + len(spec.slot_ranks), shard_dir=spec.shard_dir)
    side: dict[str, Callable[[Any], tuple[Any, str]]] = {}
    if spec.publication is not None:
        # start-up cost: a spawned worker imports only its own role's stack
        from flexmarl.runtime.local.publication import PairGroups, SlotPublisher

        publisher = host.publisher = SlotPublisher(PairGroups(*spec.publication))
        side["pub_send"] = lambda p: (publisher.send(*p), f"publish:{p[0]}")
    settle_heap()
    handle = host.handle if leader is None else leader.lead(host.handle)
    serve_slot(conn, handle, side)
    if leader is not None:
        leader.stop()
        # a local worker process ends here (`end_rank`); on Ray this main is an actor's thread
        end_rank(exit_process=threading.current_thread() is threading.main_thread())


def slot_follower_main(args: tuple | None = None) -> None:
    """The main of ranks 1..K-1 of a sharded training slot (started by rank 0's
    `slot_ranks.form_slot`: its spec on stdin, or `args` from a Ray rank actor)."""
    # start-up cost: a spawned worker imports only its own role's stack
    from flexmarl.runtime.local.slot_ranks import follower_main

    follower_main(_setup_torch, args)


def chaos_stall(pool: str, command: str) -> None:
    """Fault injection for the test suite: a stuck compute thread. If the file named by
    FLEXMARL_CHAOS_STALL holds `pool:command`, the first worker of that pool to run that
    command claims the file (removes it) and its main thread blocks for good, while its
    heartbeat thread keeps beating (`runtime.progress_timeout_s` must find it)."""
    path = os.environ.get("FLEXMARL_CHAOS_STALL")
    if not path:
        return
    try:
        with open(path) as f:
            wanted = f.read().strip()
        if wanted != f"{pool}:{command}":
            return
        os.unlink(path)  # exactly one worker wins
    except OSError:
        return
    while True:
        time.sleep(3600)


def serve_slot(conn: Connection, handle: Callable[[str, Any], tuple[Any, str]],
               side: dict[str, Callable[[Any], tuple[Any, str]]] | None = None,
               pool: str = "train") -> None:
    """The command loop of a worker process that answers one command at a time (every
    training slot kind: LLM `TrainHost`, classic MARL a `TrainHost` of network learners; the
    classic MARL rollout worker): say ready, then run each command through `handle` -> (result,
    span label) and answer it, until `stop`. A failing command is answered with its error.

    `side` commands run on a thread of their own, in order, answered as soon as they are
    done: a publication's send must not wait behind a long accumulate of the slot."""
    conn.send((-1, True, "ready", []))
    if side:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        sideq: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    inbox.put((None, "stop", None))  # the parent is gone
                    return
                (sideq if msg[1] in side else inbox).put(msg)

        def serve_side() -> None:
            while True:
                msg_id, command, payload = sideq.get()
                t0 = time.time()
                try:
                    result, label = side[command](payload)
                    conn.send((msg_id, True, result, [(t0, time.time(), label)]))
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    conn.send((msg_id, False, _error(exc), []))

        threading.Thread(target=read, name="slot-reader", daemon=True).start()
        threading.Thread(target=serve_side, name="slot-side", daemon=True).start()
        recv: Callable[[], Any] = inbox.get
    else:
        recv = conn.recv
    while True:
        msg_id, command, payload = recv()
        if msg_id is None:
            return
        t0 = time.time()
        try:
            if command == "stop":
                conn.send((msg_id, True, None, []))
                return
            chaos_stall(pool, command)
            result, label = handle(command, payload)
            conn.send((msg_id, True, result, [(t0, time.time(), label)]))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send((msg_id, False, _error(exc), []))
