"""The training host: one implementation of training slots for every real runtime.

Two halves, written once and used by the local runtime (worker processes over pipes) and the
Ray runtime (actors over the object store) alike:

- `TrainHost`, the per-process part (a local training worker, a Ray `TrainWorker` actor): one
  slot holding the resident agent's trainer. Trainer objects (model, optimizer) are built once
  per agent and process, the first time the agent is bound here, and kept: a swap-out captures
  the state (it leaves the slot as wire bytes or a disk file), a swap-in loads a state into the
  agent's kept trainer; nothing is rebuilt on a swap. Same config and seed give the same
  initial weights in every process. `handle` runs the commands of the slot protocol.
- `SlotPool`, the driver-side part (a `TrainPool`): agent-centric slot allocation with sticky
  leases through `SlotAllocator`, one queue and runner per agent, swap accounting (`swaps`,
  `swap_s` per agent; the slots' `swap:<agent>` spans give `pool/train/swaps` and `swap_s` per
  iteration) and the recovery journal (each agent's restart point after its last step and the
  micro-batches accumulated since). A runtime subclasses it with its transport (`_run`,
  `_recover`) and, where it differs, the form of a few commands.

The slot protocol (command, payload) -> result:
  bind (agent, incoming)  -> Bound(evicted agent, its state, its parking token, timings)
  accumulate (agent, samples) -> metrics;   step agent -> (metrics, published weights)
  weights agent -> published weights;       save (agent, directory) -> path
  weights_pipe agent -> published weights in wire form, whatever the publication
  get_state agent -> (arrays, meta);        set_state (agent, arrays, meta) -> version
  keep_restart (agent, path) -> path;       restore_restart (agent, path) -> version
    (the restart point as a file the driver names and owns, `get_state`'s arrays and meta:
    a local slot's, so that only the file's name travels the pipe)
A state in transit is `("host", wire)`, `("disk", path)` or a runtime's own form (Ray: an
object-store reference, resolved by the actor before it reaches `bind`). A state coming back
to the process it left is `("kept", token)` (`Bound.parked`; runtimes that opt in
with `SlotPool._slot_generation`): the agent's kept trainer still holds it, so nothing moves.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from flexmarl.api.runtime import TrainPool, WorkerError, WorkerLost
from flexmarl.policy import adapters
from flexmarl.policy.device import process_device
from flexmarl.policy.model import build_model
from flexmarl.store.experience import parse_sample_id, sample_iteration
from flexmarl.training import state as st
from flexmarl.training.allocator import Lease, SlotAllocator
from flexmarl.training.learner import Learner, NetworkLearner, published_form
from flexmarl.training.policy_learner import agent_learner
from flexmarl.training.state import state_to_numpy
from flexmarl.training.trainer import AgentTrainer
from flexmarl.types import Bound

if TYPE_CHECKING:
    from flexmarl.config.schema import RunConfig
    from flexmarl.planning.planner import Plan

Command = tuple[str, Any]


class SlotError(RuntimeError):
    """A command for an agent that is not resident on this slot."""


# a slot's refusal of `("kept", token)` (it is another process, or the token is stale)
NOT_KEPT = "no state kept on this slot"


class _Resident(dict):
    """`TrainHost.trainers`: the resident trainer by agent, with a clear error for the others."""

    def __missing__(self, agent: str) -> Learner:
        raise SlotError(f"agent {agent!r} is not resident on this training slot "
                        f"(resident: {sorted(self) or 'none'})")


def published(trainer: Learner, publisher: Any = None, rank: int = 0) -> Any:
    """The learner's weights as published: the state interface's wire form
    (`training.learner.published_form`); with a collective `publisher`
    (runtime.publication), a `PublishedRef` to the copy the slot keeps and sends itself.
    Ranks > 0 of a sharded slot take part in the gathering and publish nothing (None)."""
    if rank > 0:
        trainer.weights()  # collective: each bucket is all-gathered on every rank
        return None
    # a network policy's weights are small and go to the driver, where its episodes act
    if publisher is not None and not isinstance(trainer, NetworkLearner):
        return publisher.keep(trainer.agent, trainer.version, trainer.weights())
    return published_form(trainer)


class TrainHost:
    """One training slot in one process (see the module docstring), hosting any `Learner`:
    LLM trainers built from the run's config (`cfg`), or the learners `build(agent)` makes
    (classic MARL's network learners: `marl/learner.py`'s `learner_host`)."""

    def __init__(self, cfg: RunConfig | None, vocab_size: int = 0, max_seq_len: int = 0,
                 swap_dir: str | None = None,
                 build: Callable[[str], Learner] | None = None,
                 world: int = 1, shard_dir: str | None = None) -> None:
        """`world` > 1: this process is one rank of a sharded slot (the default
        torch.distributed group, initialised by the caller): it builds `ShardedAgentTrainer`s,
        and swaps and restart points go per rank through `shard_dir`, a folder every rank
        and every slot can read."""
        if cfg is None and build is None:
            raise ValueError("TrainHost: give the run's config or a learner builder")
        if world > 1 and shard_dir is None:
            raise ValueError("TrainHost: a sharded slot needs a shard_dir")
        self.world = world
        self.rank = 0
        if world > 1:
            import torch.distributed as dist  # only sharded slots initialise a group

            self.rank = dist.get_rank()
        self.shard_dir = shard_dir
        self.mesh: Any = None  # the slot's DeviceMesh (sharded slots), made at the first build
        self.cfg = cfg
        self.build_learner = build
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.swap_dir = swap_dir  # None: swapped states go to the caller's host memory
        self.trainers: dict[str, Learner] = _Resident()  # resident (at most one)
        # every trainer built in this process, resident or not: swap-ins load into these
        self.kept: dict[str, Learner] = {}
        # shared bases (`models:`), built once per process: the trainers of the agents on one
        # wrap trees over its tensors, so the slot holds it once and a swap moves the adapter
        self.bases: dict[str, torch.nn.Module] = {}
        # a sharded slot's shared bases: one peft model per base with an adapter per agent,
        # sharded once over the slot's ranks (`training.sharded.shard_shared_base`)
        self.sharded_bases: dict[str, Any] = {}
        self.builds = 0  # trainers built (a swap never builds one)
        # agents whose trainer holds its whole state in the object (one-device LLM trainers:
        # `st.capture` reads only the trainer and torch's RNG), and for those swapped out of
        # this process: (token, torch RNG at the swap-out). Swapped back in here, a kept
        # trainer is exactly its swapped-out state once the RNG is put back.
        self.parkable: set[str] = set()
        self.parked: dict[str, tuple[int, Any]] = {}
        # tokens of this process only: a restarted slot never honours a predecessor's
        self._park_ids = itertools.count(int.from_bytes(os.urandom(3), "big") << 20)
        # runtime.publication collective (local runtime): keeps and sends published weights
        self.publisher: Any = None

    def _build(self, agent: str) -> Learner:
        if self.build_learner is not None:
            self.builds += 1
            return self.build_learner(agent)

        assert self.cfg is not None
        if agent not in self.cfg.agents:
            raise SlotError(f"agent {agent!r} is not in the run's config "
                            f"(agents: {sorted(self.cfg.agents)})")
        acfg = self.cfg.agents[agent]
        if acfg.network is not None:  # a hybrid run's network agent: MAPPO / IPPO
            self.builds += 1
            return agent_learner(agent, acfg, self.cfg.seed)
        shared = None
        if self.world > 1:
            return self._build_sharded(agent)
        if acfg.model.base is not None:
            name = acfg.model.base
            if name not in self.bases:
                self.bases[name] = build_model(f"models.{name}", acfg.model, self.vocab_size,
                                               self.max_seq_len, self.cfg.seed,
                                               process_device())
            shared = self.bases[name]
        self.builds += 1
        self.parkable.add(agent)
        return AgentTrainer(agent, acfg, self.vocab_size, self.max_seq_len,
                            self.cfg.seed, total_steps=self.cfg.train.iterations,
                            max_staleness=self.cfg.pipeline.max_staleness, shared_base=shared)

    def _build_sharded(self, agent: str) -> Learner:
        """A `ShardedAgentTrainer` over this slot's ranks; an agent on a shared base trains
        its adapter of the slot's one sharded peft model over that base (built at the first
        such agent, with an adapter for every trainable agent on the base)."""
        from flexmarl.training import sharded  # torch.distributed: only sharded slots

        assert self.cfg is not None
        acfg = self.cfg.agents[agent]
        device = str(process_device())
        if self.mesh is None:  # "cuda:0" -> "cuda"
            self.mesh = sharded.init_device_mesh(device.split(":")[0], (self.world,))
        policy = adapter = None
        name = acfg.model.base
        if name is not None and acfg.lora is not None:
            if name not in self.sharded_bases:
                base = build_model(f"models.{name}", acfg.model, self.vocab_size,
                                   self.max_seq_len, self.cfg.seed, device)
                on_base = {a: c for a, c in self.cfg.agents.items()
                           if c.model.base == name and c.lora is not None}
                self.sharded_bases[name] = sharded.shard_shared_base(
                    base, on_base, self.cfg.seed, self.mesh)
            policy, adapter = self.sharded_bases[name], adapters.adapter_name(agent)
        self.builds += 1
        return sharded.ShardedAgentTrainer(
            agent, acfg, self.vocab_size, self.max_seq_len, self.cfg.seed,
            total_steps=self.cfg.train.iterations, max_staleness=self.cfg.pipeline.max_staleness,
            device=device, state_dir=self.shard_dir, mesh=self.mesh, policy=policy,
            adapter=adapter)

    def resident_bytes(self, agents: list[str] | None = None) -> int:
        """Memory the slot holds: the kept trainers' (of `agents`, default all) weights,
        gradients and optimizer states, each shared base once."""

        if self.world > 1:  # this rank's shards (parameters, gradients, optimizer state)
            total = sum(  # the shared bases' frozen shards, once (adapters: the trainers')
                t.numel() * t.element_size() for policy in self.sharded_bases.values()
                for p in policy.parameters() if not p.requires_grad
                for t in [p.to_local() if hasattr(p, "to_local") else p])
            for agent, trainer in self.kept.items():
                if agents is None or agent in agents:
                    total += sum(trainer.local_nbytes().values())  # type: ignore[attr-defined]
            return total
        objects: list = list(self.bases.values())
        for agent, trainer in self.kept.items():
            if agents is None or agent in agents:
                objects += trainer.state_objects()
        return adapters.resident_bytes(*objects)

    def agent_bytes(self, agent: str) -> int:
        """What `agent` adds to the slot: an adapter agent its adapter, gradients and AdamW
        state (its base is shared); any other agent its whole model and optimizer."""
        return self.resident_bytes([agent]) - self.resident_bytes([])

    def bind(self, agent: str, incoming: Any, send_out: bool = True) -> Bound:
        """Make `agent` resident: swap out the current resident (its state goes back, as wire
        bytes or a disk path), then swap `agent` in from `incoming` (None: the agent's initial
        state, as built from its config, or a restart point `set_state` loads next;
        `("kept", token)`: the state it left this process with, still in its kept trainer).
        `send_out=False`: the driver can rebuild the resident's state (its restart point
        after its last step, and the journal of micro-batches since): a parkable resident's
        state then stays in its kept trainer only and goes back as `("restart", None)`."""
        timings: dict[str, float] = {}
        out_agent: str | None = None
        out_state: tuple[str, Any] | None = None
        out_token: int | None = None
        kept_in = isinstance(incoming, tuple) and incoming[0] == "kept"
        if kept_in and agent not in self.trainers:  # refused before anything moves
            parked = self.parked.get(agent)
            if parked is None or agent not in self.kept or parked[0] != incoming[1]:
                raise SlotError(f"agent {agent!r}: {NOT_KEPT} for token "
                                f"{incoming[1]!r} (the driver still holds its state)")
        for resident in [a for a in self.trainers if a != agent]:
            t0 = time.perf_counter()
            trainer = self.trainers.pop(resident)
            out_agent = resident
            if not send_out and self.world == 1 and resident in self.parkable:
                out_token = next(self._park_ids)
                self.parked[resident] = (out_token, torch.get_rng_state())
                out_state = ("restart", None)
                timings["swap_out_s"] = time.perf_counter() - t0
                continue
            captured = trainer.capture()  # a frozen base is kept in the object
            out_state = self._swap_out(captured, resident)
            if self.world == 1 and resident in self.parkable:
                out_token = next(self._park_ids)
                self.parked[resident] = (out_token, captured.tensors["rng/torch"])
            timings["swap_out_s"] = time.perf_counter() - t0
            timings["swap_bytes"] = float(captured.nbytes)
            del captured
        if agent not in self.trainers:
            t0 = time.perf_counter()
            parked = self.parked.pop(agent, None)
            kept = self.kept.get(agent)
            if kept_in:
                assert parked is not None and kept is not None  # checked above
                torch.set_rng_state(parked[1])  # the rest never left the kept trainer
                self.trainers[agent] = kept
                timings["swap_in_s"] = time.perf_counter() - t0
                timings["kept_in"] = 1.0
                return Bound(out_agent, out_state, out_token, timings)
            if kept is None:  # first binding in this process: built once, then kept
                trainer = self.kept[agent] = self._build(agent)
            else:
                trainer = kept
            if kept is not None and incoming is None:
                # kept, but its state is gone (lost with another slot): a restart point
                # follows; until then it is exactly the initial state, as a fresh build
                trainer.restore(self._initial(agent))
            if incoming is not None:
                trainer.restore(st.swap_in(self._own_part(agent, incoming)))
            self.trainers[agent] = trainer
            timings["swap_in_s"] = time.perf_counter() - t0
            timings["resident_bytes"] = float(self.resident_bytes())
            timings["agent_bytes"] = float(self.agent_bytes(agent))
        return Bound(out_agent, out_state, out_token, timings)

    def _swap_out(self, captured: st.TrainingState, agent: str) -> tuple[str, Any]:
        """A swapped-out state as it leaves the slot. A sharded slot's ranks each write their
        own shard to `shard_dir` (never gathered): `("shards", [path of rank 0, ...])`."""
        if self.world == 1:
            return st.swap_out(captured, self.swap_dir, agent)
        import torch.distributed as dist  # only sharded slots get here

        _, path = st.swap_out(captured, self.shard_dir, f"{agent}.rank{self.rank}of{self.world}")
        paths: list[Any] = [None] * self.world
        dist.all_gather_object(paths, path)
        return ("shards", paths)

    def _own_part(self, agent: str, incoming: tuple[str, Any]) -> tuple[str, Any]:
        """This rank's part of a swapped-in state (a sharded slot's: its own shard file)."""
        if incoming[0] != "shards":
            if self.world > 1:
                raise SlotError(f"agent {agent!r}: a one-device state offered to a slot of "
                                f"{self.world} ranks")
            return incoming
        paths = incoming[1]
        if len(paths) != self.world:
            raise SlotError(f"agent {agent!r}: its state is sharded over {len(paths)} ranks, "
                            f"this slot has {self.world}")
        return ("disk", paths[self.rank])

    def _initial(self, agent: str) -> st.TrainingState:
        """The agent's initial state (a trainer built from its config, then dropped; an
        adapter of a sharded shared base: the shard its trainer captured when built)."""
        initial = getattr(self.kept.get(agent), "initial", None)
        if initial is not None:
            return initial
        return self._build(agent).capture()

    # --- commands on the resident agent ------------------------------------------------------
    def accumulate(self, agent: str, samples: Any) -> dict[str, float]:
        return self.trainers[agent].accumulate(samples)

    def step(self, agent: str) -> tuple[dict[str, float], Any]:
        metrics = self.trainers[agent].step()
        return metrics, published(self.trainers[agent], self.publisher, self.rank)

    def weights(self, agent: str) -> Any:
        return published(self.trainers[agent], self.publisher, self.rank)

    def save(self, agent: str, directory: str) -> str:
        return str(self.trainers[agent].save(directory))

    def get_state(self, agent: str) -> tuple[dict, dict]:
        return state_to_numpy(self.trainers[agent].get_state())

    def set_state(self, agent: str, arrays: dict, meta: dict) -> int:
        self.trainers[agent].set_state(arrays, meta)
        return int(meta["version"])

    def weights_pipe(self, agent: str) -> Any:
        """The weights as they go through a pipe (never through the publisher)."""
        return published(self.trainers[agent], None, self.rank)

    def keep_restart(self, agent: str, path: str) -> str:
        """`get_state` written to `path` (a new name each time, chosen by the driver, which
        owns the folder): it outlives this process, and only its name crosses the pipe."""
        write_restart_point(path, *self.get_state(agent))
        return path

    def restore_restart(self, agent: str, path: str) -> int:
        """`set_state` from a file `keep_restart` wrote."""
        return self.set_state(agent, *read_restart_point(path))

    # the slot protocol's commands (methods of this class) and their span labels
    SPAN_LABELS = {"bind": "swap", "accumulate": "acc", "step": "step", "weights": "weights",
                   "weights_pipe": "weights", "save": "save", "get_state": "state",
                   "set_state": "restore", "keep_restart": "state",
                   "restore_restart": "restore"}

    def handle(self, command: str, payload: Any) -> tuple[Any, str]:
        """Run one command of the slot protocol; returns its result and its span label. A
        command's payload is its agent, or a tuple of the agent and the method's other
        arguments."""
        prefix = self.SPAN_LABELS.get(command)
        if prefix is None:
            raise ValueError(f"training slot: unknown command {command!r}")
        args = payload if isinstance(payload, tuple) else (payload,)
        result = getattr(self, command)(*args)
        count = f":{len(args[1])}" if command == "accumulate" else ""
        return result, f"{prefix}:{args[0]}{count}"


def write_restart_point(path: str, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """A restart point (`get_state`'s arrays and JSON-able meta) as one safetensors file,
    written under another name and renamed, so a reader never sees half of one."""
    tmp = f"{path}.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, tmp,
              metadata={"flexmarl": json.dumps(meta)})
    os.replace(tmp, path)


def read_restart_point(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with safe_open(path, framework="np") as f:
        meta = json.loads((f.metadata() or {})["flexmarl"])
        return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 - not a dict


# --- driver side ----------------------------------------------------------------------------
@dataclass
class _Job:
    """Commands of one agent that run on its slot under one lease, one after another.
    `build(retried)` gives them: a job run again after its slot was lost may need another
    form (Ray: a micro-batch its lost predecessor took from the table is replayed)."""

    build: Callable[[bool], list[Command]]
    priority: tuple
    future: asyncio.Future
    retry: bool = True
    # runs synchronously when the job succeeded, before any later job of the agent starts
    on_done: Callable[[list[Any]], None] | None = None
    kind: str = ""  # the first command's name (`_may_swap` reads it)
    retried: bool = False
    # its one command, already on its way to the slot behind the job running there
    # (`SlotPool._send_ahead`): the result to await instead of sending it again
    sent: asyncio.Future | None = None


def _sample_ids(batch: Any) -> Sequence[str]:
    """The rows of a micro-batch: samples (local) or ids served by reference (Ray)."""
    ids = getattr(batch, "sample_ids", None)
    return list(ids) if ids is not None else [s.sample_id for s in batch]


class SlotPool(TrainPool):
    """Training slots bound to agents on demand by a `SlotAllocator`; with fewer slots than
    agents, agents time-share slots and their states are swapped.

    Each agent's calls go through its own queue, served in order by one runner task: the runner
    takes a lease for the call at the head and keeps it while the agent has calls queued
    (sticky slots), unless the allocator says an older iteration's work waits for the slot.
    The orchestrator queues an agent's micro-batches as they become ready, so an agent drains
    them with one swap-in instead of one per micro-batch.

    With recovery on (`_recovers`), a journal: each agent's restart point (its full state
    after its last step) and the micro-batches accumulated since, so a restarted slot resumes
    from exactly there: no row lost, none counted twice in a gradient.

    Subclasses give the transport: `_run(slot, command, payload)` (raises `WorkerLost` when
    the slot is gone), `_recovers()`, `_recover(slot, lost)` (returns once the slot runs again,
    restored through `restore_slot`)."""

    n_workers: int

    def __init__(self, n_slots: int, slot_sizes: list[int] | None = None) -> None:
        self.n_workers = n_slots
        self.slots = n_slots  # agents time-share them when fewer than agents
        # the ranks (devices) of each slot: `pool/train/busy_frac` counts devices
        self.slot_sizes = list(slot_sizes or [1] * n_slots)
        self.allocator = SlotAllocator(n_slots)
        if len(set(self.slot_sizes)) > 1:
            self.allocator.sizes = self.slot_sizes
        self.swapped: dict[str, Any] = {}  # agent -> its state while on no slot
        # agent -> (slot, that slot's process generation, token): where its kept trainer
        # still holds the state it was last swapped out with (`TrainHost.bind`'s "kept")
        self.parked_on: dict[str, tuple[int, Any, int]] = {}
        self.swap_seconds = 0.0
        self.swaps_in: dict[str, int] = defaultdict(int)  # per agent: swap-ins (binds)
        # per slot: the bytes its trainers hold (weights, grads, optimizer; a shared base once)
        self.resident_bytes: dict[int, float] = {}
        self.agent_bytes: dict[str, float] = {}  # per agent: what it adds to a slot
        # per agent, cumulative: seconds waiting for a slot, swaps in, swap seconds (metrics),
        # seconds and number of its training calls (accumulate, step: the planner's demand)
        self.slot_stats: dict[str, dict[str, float]] = defaultdict(
            lambda: {"slot_wait_s": 0.0, "swaps": 0.0, "swap_s": 0.0, "train_s": 0.0,
                     "calls": 0.0})
        # recovery journal (see the class docstring): restart points in the form the
        # runtime's `_keep_command` returns them, and micro-batches as accumulated
        self.saved_state: dict[str, Any] = {}
        self.journal: dict[str, list[Any]] = defaultdict(list)
        # the iteration each agent is training on (its last micro-batch's) and its first turn
        # in the graph: slot priority
        self.iteration: dict[str, int] = {}
        self.turn: dict[str, int] = {}
        self.rank: dict[str, int] = {}  # the planner's order (`follow_plan`)
        self._queues: dict[str, deque[_Job]] = defaultdict(deque)
        self._runners: dict[str, asyncio.Task] = {}
        # micro-batches queued since the agent's last step, and in its last iteration
        self._since_step: dict[str, int] = defaultdict(int)
        self._per_iteration: dict[str, int] = {}

    # --- transport (subclasses) ---------------------------------------------------------------
    async def _run(self, slot: int, command: str, payload: Any) -> Any:
        raise NotImplementedError

    def _recovers(self) -> bool:
        """Whether lost slots are restarted (then the journal is kept)."""
        return False

    async def _recover(self, slot: int, lost: WorkerLost) -> None:
        raise lost

    def _slot_generation(self, slot: int) -> Any:
        """Which process serves `slot` now (a restarted slot's differs), for runtimes whose
        slots are `TrainHost`s that keep swapped-out trainers: an agent swapped back in to
        the process it left is sent `("kept", token)` instead of its state. None: never."""
        return None

    # --- command forms (the local slot protocol; a runtime may override) ----------------------
    def _accumulate_command(self, agent: str, batch: Any, replay: bool) -> Command:
        return ("accumulate", (agent, batch))

    def _keep_command(self, agent: str) -> Command:
        """The command whose result is the agent's restart point (kept in `saved_state`)."""
        return ("get_state", agent)

    def _restore_command(self, agent: str, saved: Any) -> Command:
        """The command that loads a restart point `_keep_command` returned."""
        return ("set_state", (agent, *saved))

    # --- TrainPool ----------------------------------------------------------------------------
    def training_slots(self) -> int | None:
        return self.slots

    def slot_counters(self) -> dict[str, dict[str, float]]:
        return self.slot_stats

    @property
    def binding(self) -> dict[str, int]:
        """Which slot each resident agent is on right now."""
        return self.allocator.binding()

    def _priority(self, agent: str, kind: int) -> tuple:
        """Slot priority of the agent's next call: older iterations first, then the planner's
        order (`follow_plan`; until there is one, agents earlier in the graph: their rows'
        turn, the next iteration's episodes need their steps first), then a step (0) before a
        micro-batch (1)."""
        return (self.iteration.get(agent, 0),
                self.rank.get(agent, self.turn.get(agent, 0)), kind)

    def follow_plan(self, plan: Plan) -> None:
        """Within an iteration, agents get slots in the planner's order (most critical
        first) instead of graph order. (Slots of different sizes: the plan's `slot_of` is
        recorded; an agent keeps the size it was bound to at the start, `bind_slots`, since
        its state is sharded over that many ranks.)"""
        self.rank = {a: i for i, a in enumerate(plan.train_order)}

    def fix_slots(self, slot_of: dict[str, int]) -> None:
        """`runtime.train_binding: fixed`: each agent trains on its slot in `slot_of` only
        (agents bound to one slot time-share it; no agent moves to a free slot)."""
        self.allocator.fixed = dict(slot_of)

    def bind_slots(self, slot_of: dict[str, int]) -> None:
        """Slots of different sizes: bind each agent to the size of its slot in `slot_of`
        before it trains (the runtime's initial `planning.bind_slots`)."""
        if self.allocator.sizes is not None:
            self.allocator.bind(slot_of)

    def _outranked(self, agent: str, lease: Any, priority: tuple) -> bool:
        """Whether the holder should yield its slot to a more critical agent (planner's order)
        of the same iteration that waits for this slot with enough queued to be worth a swap
        (`_may_swap`: half an iteration's micro-batches, or its step): the critical agents'
        rows then train while the rollout still runs and their steps come first after it, so
        the next iteration's nodes start sooner; the others train in what is left, overlapped
        with the next rollout. A holder otherwise drains its queue (sticky slots)."""
        mine = tuple(priority)[:2]
        if len(mine) < 2:
            return False
        home = self.allocator.binding()
        for w in self.allocator.waiting:
            if w.future.done() or w.agent == agent or tuple(w.priority)[:1] != mine[:1]:
                continue
            if (tuple(w.priority)[:2] < mine and home.get(w.agent, lease.slot) == lease.slot
                    and self._may_swap(w.agent)):
                return True
        return False

    async def accumulate(self, agent: str, batch: Any) -> dict[str, float]:
        """Queue one micro-batch; callers may queue several before the first is done (they
        run in order), which lets the agent keep its slot across them."""
        ids = _sample_ids(batch)
        if ids:
            self.iteration[agent] = sample_iteration(ids[0])
            self.turn[agent] = min(parse_sample_id(i)[1] for i in ids)
        self._since_step[agent] += 1

        def journal(_: list[Any]) -> None:
            if self._recovers():
                self.journal[agent].append(batch)

        (result,) = await self._submit(
            agent, lambda retried: [self._accumulate_command(agent, batch, retried)],
            self._priority(agent, 1), on_done=journal)
        return result

    async def step(self, agent: str) -> tuple[dict[str, float], Any]:
        """The step and, with recovery on, the restart point after it, under one lease: a loss
        of either restores the last restart point, replays the journal and steps again."""
        self._per_iteration[agent] = self._since_step.pop(agent, 0)
        return await self._then_restart_point(agent, ("step", agent), self._priority(agent, 0))

    async def _then_restart_point(self, agent: str, command: Command,
                                  priority: tuple = ()) -> Any:
        """`command`, then (recovery on) the restart point after it, under one lease."""
        recovers = self._recovers()
        commands = [command, self._keep_command(agent)] if recovers else [command]

        def restart_point(results: list[Any]) -> None:
            if recovers:
                self._kept(agent, results[1])

        results = await self._submit(agent, lambda _: commands, priority,
                                     on_done=restart_point)
        return results[0]

    def _kept(self, agent: str, saved: Any) -> None:
        self.saved_state[agent] = saved
        self.journal[agent] = []

    async def keep_restart_point(self, agent: str) -> None:
        """The agent's state now becomes its restart point (a run's start, a resume)."""
        def keep(results: list[Any]) -> None:
            self._kept(agent, results[0])

        await self._submit(agent, lambda _: [self._keep_command(agent)], on_done=keep)

    async def get_state(self, agent: str) -> tuple[dict, dict]:
        return await self._call(agent, "get_state", agent)

    async def set_state(self, agent: str, state: tuple[dict, dict]) -> None:
        await self._then_restart_point(agent, ("set_state", (agent, *state)))

    async def weights(self, agent: str) -> Any:
        return await self._call(agent, "weights", agent)

    async def save(self, agent: str, directory: str) -> str:
        return await self._call(agent, "save", (agent, directory))

    # --- queues and leases --------------------------------------------------------------------
    def _submit(self, agent: str, build: Callable[[bool], list[Command]], priority: tuple = (),
                retry: bool = True,
                on_done: Callable[[list[Any]], None] | None = None) -> asyncio.Future:
        """Queue the commands `build` gives for `agent`; the future gets their results. Jobs of
        one agent run in the order they were submitted."""
        fut = asyncio.get_running_loop().create_future()
        kind = build(False)[0][0]
        self._queues[agent].append(_Job(build, tuple(priority), fut, retry, on_done, kind))
        runner = self._runners.get(agent)
        if runner is None or runner.done():
            self._runners[agent] = asyncio.ensure_future(self._serve(agent))
        else:  # it may be waiting for a slot until it has enough queued to be worth a swap
            self.allocator.poke()
        return fut

    async def _call(self, agent: str, command: str, payload: Any, retry: bool = True,
                    priority: tuple = ()) -> Any:
        """Run `command` on the slot bound to `agent` (binding, and swapping, on demand); a
        slot lost meanwhile is restarted and the command runs again."""
        (result,) = await self._submit(agent, lambda _: [(command, payload)], priority, retry)
        return result

    def _may_swap(self, agent: str) -> bool:
        """Whether `agent` has enough queued to be worth evicting another agent's state: its
        step (then all of its iteration's remaining work is queued, and it runs to the step
        in one go), any other call (state, weight reads: needed now), or half of the
        micro-batches its last iteration had. So a trained agent is swapped in at most twice
        per iteration (a session from the half-way mark on, and a last one up to its step),
        instead of once per micro-batch whenever training keeps up with rollout."""
        queued = 0
        for job in self._queues[agent]:
            if job.future.done():
                continue
            if job.kind != "accumulate" and not job.kind.startswith("accumulate_"):
                return True
            queued += 1
        per_iteration = self._per_iteration.get(agent)
        return per_iteration is not None and queued >= max(1, (per_iteration + 1) // 2)

    async def _serve(self, agent: str) -> None:
        """The agent's runner: drain its queue, holding a slot across consecutive jobs."""
        queue = self._queues[agent]

        def fail_head(exc: BaseException) -> None:
            job = queue.popleft()
            if not job.future.done():
                job.future.set_exception(exc)

        while queue:
            if queue[0].future.done():  # cancelled by its caller
                queue.popleft()
                continue
            asked = time.monotonic()
            lease = await self.allocator.acquire(agent, queue[0].priority,
                                                 lambda: self._may_swap(agent))
            self.slot_stats[agent]["slot_wait_s"] += time.monotonic() - asked
            lost: WorkerLost | None = None
            try:
                if lease.swap_in:
                    await self._swap_in(agent, lease)
                while queue:
                    job = queue[0]
                    if job.future.done() and job.sent is None:  # cancelled by its caller
                        queue.popleft()
                    else:  # (one sent ahead runs on the slot even if its caller is gone)
                        began = time.monotonic()
                        try:
                            results = await self._run_head(agent, lease, job)
                        except WorkerLost:
                            raise
                        except Exception as exc:  # noqa: BLE001 - the job's caller gets it
                            fail_head(exc)
                            if queue and queue[0].sent is not None:
                                continue  # sent behind it to this slot: its answer is here
                            break
                        self._job_done(agent, job, results, began)
                    if queue and queue[0].sent is None and self._yields(agent, lease,
                                                                        queue[0]):
                        break
            except WorkerLost as exc:
                self._forget_sent(queue)  # they run again after the slot is back
                if self._recovers() and queue and queue[0].retry:
                    lost = exc  # restart the slot, then run the head job again
                    queue[0].retried = True
                elif queue:
                    fail_head(exc)
            except Exception as exc:  # noqa: BLE001 - the job's caller gets it
                if queue:
                    fail_head(exc)
            finally:
                self.allocator.release(lease)
            if lost is not None:
                try:
                    await self._recover(lease.slot, lost)
                except BaseException as exc:  # unrecoverable: fail everything queued
                    while queue:
                        fail_head(exc)
                    raise

    async def _run_head(self, agent: str, lease: Lease, job: _Job) -> list[Any]:
        """The results of the agent's head job on the leased slot: sent now unless it was
        sent ahead, and the next job sent ahead behind it (`_send_ahead`)."""
        commands = None if job.sent is not None else job.build(job.retried)
        if commands is not None and len(commands) == 1:
            job.sent = asyncio.ensure_future(self._run(lease.slot, *commands[0]))
        if job.sent is None:
            return [await self._run(lease.slot, c, p) for c, p in commands or ()]
        self._send_ahead(agent, lease)
        sent, job.sent = job.sent, None
        return [await sent]

    def _job_done(self, agent: str, job: _Job, results: list[Any], began: float) -> None:
        """The head job ran: its counters, its journal entry, its caller's answer."""
        if job.kind == "step" or job.kind.startswith("accumulate"):
            stats = self.slot_stats[agent]  # training work: the planner's demand
            stats["train_s"] += time.monotonic() - began
            stats["calls"] += 1
        self._queues[agent].popleft()
        if job.on_done is not None:  # it ran: the journal knows it
            job.on_done(results)
        if not job.future.done():  # (its caller may be gone)
            job.future.set_result(results)

    def _yields(self, agent: str, lease: Lease, job: _Job) -> bool:
        """Whether the holder gives its slot up before `job` (an older iteration's work, or
        a more critical agent's, waits for it)."""
        return (self.allocator.should_yield(lease, job.priority)
                or self._outranked(agent, lease, job.priority))

    def _send_ahead(self, agent: str, lease: Lease) -> None:
        """Send the agent's next job to the slot while the head job runs there, when it is
        one command and the holder would keep the slot for it: the slot's process finds it
        in its pipe when the head is done and starts at once, instead of idling through the
        answer's trip to the driver and the next command's trip back (about 0.5 ms a
        micro-batch on a loaded CPU host: 11% of a small model's iteration). The slot runs
        its commands in the order sent, so nothing else changes: the same commands, the same
        order, answers taken in order."""
        queue = self._queues[agent]
        if len(queue) < 2:
            return
        nxt = queue[1]
        if nxt.sent is not None or nxt.future.done() or self._yields(agent, lease, nxt):
            return
        commands = nxt.build(nxt.retried)
        if len(commands) == 1:
            nxt.sent = asyncio.ensure_future(self._run(lease.slot, *commands[0]))

    @staticmethod
    def _forget_sent(queue: deque[_Job]) -> None:
        """The slot was lost: what was sent ahead fails with it and is sent again."""
        for job in queue:
            if job.sent is not None:
                job.sent.add_done_callback(lambda f: f.cancelled() or f.exception())
                job.sent = None

    async def _swap_in(self, agent: str, lease: Lease) -> None:
        await self.allocator.wait_state(agent)  # evicted elsewhere a moment ago?
        incoming = self.swapped.pop(agent, None)
        # ("restart", None): it left its state in its kept trainer; wherever the kept trainer
        # is not, the state is its restart point with the journal replayed (below)
        state = None if incoming is not None and incoming[0] == "restart" else incoming
        parked = self.parked_on.pop(agent, None)
        generation = self._slot_generation(lease.slot)
        sent = state
        if (incoming is not None and parked is not None and generation is not None
                and parked[:2] == (lease.slot, generation)):
            sent = ("kept", parked[2])  # back where it left: the slot still holds it
        # one slot (the evicted agent can only come back here) and a restart point: the
        # evicted state need not travel (`TrainHost.bind`'s send_out). Lost with the slot, it
        # is its restart point plus the micro-batches accumulated since (the journal), as a
        # resident agent's is (`restore_slot`); mid-iteration swaps of agents time-sharing
        # the slot would otherwise pipe a state through the driver at every swap.
        evicted = lease.evict
        skip_out = (evicted is not None and generation is not None and self.slots == 1
                    and self._recovers() and evicted in self.saved_state)
        payload = (agent, sent, False) if skip_out else (agent, sent)
        try:
            try:
                bound: Bound = await self._run(lease.slot, "bind", payload)
            except (SlotError, WorkerError) as refused:  # (over a pipe: a WorkerError)
                if sent is state or isinstance(refused, WorkerLost) or (
                        NOT_KEPT not in str(refused)):
                    raise
                # the slot no longer keeps it (refused before anything moved): the state
                sent = state
                bound = await self._run(lease.slot, "bind", (agent, state, *payload[2:]))
        except BaseException as exc:
            if incoming is not None:  # not delivered: it is still the state
                self.swapped[agent] = incoming
            if lease.evict is not None:
                self.allocator.state_arrived(lease.evict, exc)
            raise
        if bound.evicted is not None:
            self.swapped[bound.evicted] = bound.state
            if bound.parked is not None and generation is not None:
                self.parked_on[bound.evicted] = (lease.slot, generation, bound.parked)
        if lease.evict is not None:
            self.allocator.state_arrived(lease.evict)
        self.swaps_in[agent] += 1
        if sent is None and agent in self.saved_state:
            # its state went down with a slot (lost mid-swap): the restart point after its
            # last step, plus the micro-batches accumulated since
            await self._run(lease.slot, *self._restore_command(agent, self.saved_state[agent]))
            for batch in self.journal[agent]:
                await self._run(lease.slot, *self._accumulate_command(agent, batch, True))
        timings = bound.timings
        swap_s = timings.get("swap_out_s", 0.0) + timings.get("swap_in_s", 0.0)
        if "resident_bytes" in timings:
            self.resident_bytes[lease.slot] = timings["resident_bytes"]
            self.agent_bytes[agent] = timings["agent_bytes"]
        self.swap_seconds += swap_s
        self.slot_stats[agent]["swaps"] += 1
        self.slot_stats[agent]["swap_s"] += swap_s

    async def restore_slot(self, slot: int,
                           run: Callable[[str, Any], Awaitable[Any]]) -> dict[str, int]:
        """Bring a restarted slot (reached through `run(command, payload)`, before it is in
        place) back to where its lost predecessor was: each agent resident on it gets its
        restart point and replays the micro-batches accumulated since. Another agent may be
        bound to the slot meanwhile (its call to the lost slot failed): it is restored too,
        and the state it evicts goes back to `swapped`. Returns the restored versions."""
        versions: dict[str, int] = {}
        while True:
            todo = [a for a, i in self.binding.items() if i == slot and a not in versions]
            if not todo:  # no await between this check and the caller putting the slot in place
                return {a: v for a, v in versions.items() if self.binding.get(a) == slot}
            for agent in todo:
                self.swapped.pop(agent, None)  # a swap-in the loss interrupted: superseded
                self.parked_on.pop(agent, None)
                bound = await run("bind", (agent, None))
                if bound.evicted is not None:  # restored here a moment ago: exact
                    self.swapped[bound.evicted] = bound.state
                versions[agent] = await run(*self._restore_command(agent,
                                                                   self.saved_state[agent]))
                for batch in self.journal[agent]:
                    await run(*self._accumulate_command(agent, batch, True))
