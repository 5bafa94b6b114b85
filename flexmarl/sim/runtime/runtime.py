"""The simulated runtime: rollout replicas and trainers that `await` what the cost model
predicts, on the virtual clock. The orchestrator driving them is the production one.

Resource plans (which accelerators serve which agent) come from `planning.planner`'s
`Planner`, the one every runtime uses, priced by a `planning.demand.CostModelDemand`: from the
workload, then re-planned between iterations from what this runtime measured (lengths,
prompts, busy time per token):
- hierarchical balancing: the production balancer's `latency_allotments` gives replicas one
  at a time to the agent that shortens one iteration's critical path through the episode graph
  the most (phase times from the cost model on the last iteration's lengths); the
  rollout/training split is the step of that sequence whose predicted iteration is shortest
  (rollout path plus the training that delays the next iteration's nodes when pipelined, plus
  the slowest agent's training when synchronous);
- `static` balancing splits the rollout accelerators in proportion to estimated (then
  measured busy) rollout vs training work and deals replicas equally to agents;
- colocated (the MARTI-like baseline): every agent owns an equal share of the cluster, on
  which its engines and its trainer take turns (engines sleep while it trains);
- intra-agent: `hierarchical` sends a request to the replica with the least outstanding
  tokens, `static` deals requests round robin (fixed equal chunks);
- training allocation: `agent_centric` binds accelerators so that every agent's training
  takes about as long (min-max over its measured cost per token x its tokens), `static` splits
  them equally; `sequential_training` trains one agent at a time. With `agent_centric`, the
  light trainers that split leaves at the same memory minimum may time-share fewer slots than
  agents (the number of slots is part of the planned split, priced with its state swaps); the
  production `SlotAllocator` binds them, and each eviction and swap-in costs
  `train_state_swap_time`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flexmarl.api.runtime import RolloutPool, Runtime, TrainPool
from flexmarl.planning.planner import Planner, Resources
from flexmarl.rollout.scheduler import ReplicaScheduler, Reply
from flexmarl.sim.cost import CostModel
from flexmarl.sim.demand import CostModelDemand
from flexmarl.sim.lengths import keyed_uniform
from flexmarl.sim.runtime.engine import CostModelEngine
from flexmarl.sim.task import SyntheticTokens
from flexmarl.sim.workload import Workload
from flexmarl.training.allocator import SlotAllocator
from flexmarl.types import GenerationRequest, GenerationResult, Sample


@dataclass
class SimFeatures:
    """What the simulated system does; the baselines are particular settings of these."""

    colocated: bool = False  # rollout and training take turns on the same accelerators
    balance: str = "hierarchical"  # or "static"
    allocation: str = "agent_centric"  # or "static"
    sequential_training: bool = False  # agents trained one after another
    # colocated only: the whole cluster is every agent's share and one agent holds it at a
    # time, its engines (one agent's turn of rollout) or its trainer; switching offloads the
    # holder and loads the next (MAS-RL-like)
    time_shared: bool = False
    # weights published one agent at a time (MARTI broadcasts agent by agent)
    serial_publish: bool = False
    # hierarchical only: pin these agents' rollout replicas (the rest as planned; training
    # gets every other accelerator, agent-centric): an oracle sweep over fixed splits
    # measures how far the planner's choice is from the best fixed one
    fixed_replicas: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.time_shared and not self.colocated:
            raise ValueError("time_shared: needs colocated (the cluster is the agents' share)")
        if self.fixed_replicas and (self.balance != "hierarchical" or self.colocated):
            raise ValueError("fixed_replicas: needs balance 'hierarchical' and separate "
                             f"pools (got balance {self.balance!r}, colocated {self.colocated})")


@dataclass
class BusySpan:
    lane: str
    pool: str
    agent: str
    kind: str  # gen | prefill | train | step | publish | swap
    start: float
    end: float
    accelerators: int


@dataclass(eq=False)
class _Seq:
    prompt: int
    out_len: int
    future: asyncio.Future
    enqueued: float
    request: GenerationRequest
    priority: tuple = ()
    admitted: float = 0.0


class SimReplica:
    """One inference engine (tp accelerators) with continuous batching in virtual time: the
    shared `ReplicaScheduler` (the production replica's queues, priorities, version gating,
    deferred loads) over a `CostModelEngine` whose work costs cost-model time.

    An event-driven host on the loop's timers (no coroutine per engine): each scheduler turn
    admits what fits (one prefill) and plans a decode segment up to the first finish; the
    host waits the prefill (newcomers that arrived meanwhile are admitted before decoding),
    then the segment, then settles it and answers the finished sequences. In an under-filled
    batch a newcomer cuts the segment at the next decode step. Admission is in
    the orchestrator's priority order (iteration, input, trajectory): earlier inputs' groups
    complete first.
    """

    def __init__(self, runtime: SimRuntime, agent: str, index: int, tp: int) -> None:
        self.rt = runtime
        self.agent = agent
        self.index = index
        self.tp = tp
        self.model = runtime.wl.agent(agent).model
        self.lane = f"rollout/{agent}/{index}"
        self.seqs: dict[str, _Seq] = {}  # by sample_id, until answered
        self.engine = CostModelEngine(runtime.cost, self.model, tp, self._out_len)
        self.sched = ReplicaScheduler({agent: [agent]}, {agent: self.engine},
                                      max_batch_seqs=runtime.cost.max_num_seqs)
        self.outstanding_tokens = 0  # prompt + output tokens not yet through the engine
        self.state = "idle"  # idle | prefill | decode | paused
        self.cap = runtime.cost.max_num_seqs
        self._handle: asyncio.TimerHandle | None = None
        self._turn = (0.0, 0.0)  # start of the turn, start of its decode segment
        self._interruptible = False

    def _out_len(self, request: GenerationRequest) -> int:
        return self.seqs[request.sample_id].out_len

    def submit(self, seq: _Seq) -> None:
        self.seqs[seq.request.sample_id] = seq
        self.sched.submit(seq, seq.request, seq.priority)
        self.outstanding_tokens += seq.out_len + seq.prompt
        if self.state == "idle":
            self._next()
        elif self.state == "decode" and self._interruptible:
            # an under-filled batch takes the newcomer at the end of the current decode step
            self._interruptible = False
            t0, t_dec = self._turn
            steps, step_s = self.engine.segment or (0, 0.0)
            now = self.rt.loop.time()
            done = min(steps, max(1, math.ceil((now - t_dec) / step_s - 1e-9)))
            if done < steps and self._handle is not None:
                self._handle.cancel()
                self.engine.cut(done)
                self._handle = self.rt.loop.call_at(t_dec + done * step_s, self._settled)

    def load(self, version: int) -> None:
        """Published weights: held once the agent's running sequences are done."""
        self._deliver(self.sched.load(None, self.agent, version, None), self.rt.loop.time())
        if self.state == "idle" and self.sched.has_work():  # (an idle engine claims nothing)
            self._next()

    def resume(self) -> None:
        if self.state == "paused":
            self.state = "idle"
            self._next()

    def _next(self) -> None:
        rt = self.rt
        if rt.paused(self.agent):
            self._pause()
            return
        self._run_turn()

    def _pause(self) -> None:
        self.state = "paused"
        self.rt.paused_replicas[self.agent].append(self)

    def _run_turn(self) -> None:
        """A scheduler turn: its prefill first, then (`_prefilled`) its decode segment."""
        loop = self.rt.loop
        while self.sched.has_work():
            now = loop.time()
            events = self.sched.step()
            waits = self.rt.queue_waits[self.agent]
            for r in self.engine.admitted:
                seq = self.seqs[r.sample_id]
                seq.admitted = now
                waits.append(now - seq.enqueued)
            self.engine.admitted.clear()
            self._deliver(events, now)
            prefill, self.engine.prefill_s = self.engine.prefill_s, 0.0
            if prefill:
                self.state = "prefill"
                self._turn = (now, now + prefill)
                self._handle = loop.call_at(now + prefill, self._prefilled)
                return
            if self.engine.segment is not None:
                self._decode(now)
                return
        self.state = "idle"

    def _prefilled(self) -> None:
        """As an engine's own loop does: requests that arrived during a prefill are admitted
        (another prefill) before the batch decodes, if there is room."""
        rt = self.rt
        t0, t_dec = self._turn
        rt.busy(self, "prefill", t0, t_dec)
        paused = rt.paused(self.agent)
        if paused or (self.sched.queued(self.agent) and self.engine.active < self.cap):
            self.engine.cut(0)  # the planned segment does not run (yet)
            self.engine.settle()
            if paused:
                self._pause()
            else:
                self._run_turn()
            return
        self._decode(t_dec)

    def _decode(self, t_dec: float) -> None:
        seconds = self.engine.pending_s()
        self.state = "decode"
        self._turn = (t_dec, t_dec)
        self._interruptible = (self.engine.active < self.cap // 4
                               and not self.sched.queued(self.agent))
        self._handle = self.rt.loop.call_at(t_dec + seconds, self._settled)

    def _settled(self) -> None:
        rt = self.rt
        now = rt.loop.time()
        results, decoded = self.engine.settle()
        rt.busy(self, "gen", self._turn[1], now)
        self.outstanding_tokens -= decoded
        self._deliver(self.sched.complete(self.agent, results), now)
        self._next()

    def _deliver(self, events: list[Any], now: float) -> None:
        for ev in events:
            if not isinstance(ev, Reply):
                continue  # a load: nothing waits for it (requests of its version do)
            seq = ev.key
            del self.seqs[seq.request.sample_id]
            if ev.ok:
                self.outstanding_tokens -= seq.prompt
                self.rt.finish(self, seq, now)
            elif not seq.future.done():
                seq.future.set_exception(RuntimeError(f"{self.lane}: {ev.result}"))


class SimRolloutPool(RolloutPool):
    n_workers: int

    def __init__(self, runtime: SimRuntime) -> None:
        self.rt = runtime
        self.replicas: dict[str, list[SimReplica]] = {}
        self.n_workers = 0
        self._round_robin: dict[str, int] = defaultdict(int)

    def _pick(self, agent: str) -> SimReplica:
        """Hierarchical: the replica with the least outstanding tokens; static: round robin
        (the peers' fixed equal split of the prompts)."""
        active = self.replicas[agent][: self.rt.active[agent]]
        if self.rt.features.balance == "static":
            i = self._round_robin[agent]
            self._round_robin[agent] = i + 1
            return active[i % len(active)]
        return min(active, key=_OUTSTANDING)  # first of the least loaded: lowest index

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        rt = self.rt
        spec = rt.wl.agent(request.agent)
        out_len = max(1, spec.output_length.draw(keyed_uniform(rt.wl.seed, "out",
                                                               request.sample_id)))
        loop = rt.loop
        fut = loop.create_future()
        p = len(request.prompt)
        rt._lengths[request.agent].append(out_len)
        rt._prompts[request.agent].append(p)
        seq = _Seq(p, out_len, fut, loop.time(), request, priority)
        if rt.features.time_shared:
            rt._pending[request.agent] += 1
        # the request's latency alone on an idle engine: a term of the critical path
        rt.solo_latency[request.sample_id] = (
            rt.cost.prefill_time(spec.model, spec.tp, p)
            + out_len * rt.cost.decode_step_time(spec.model, spec.tp, 1, p + out_len / 2))
        self._pick(request.agent).submit(seq)
        await fut
        rt.requests[request.sample_id] = (seq.enqueued, loop.time())
        return GenerationResult(request.sample_id, SyntheticTokens(out_len), [],  # type: ignore[arg-type]
                                request.version, admitted_at=seq.admitted,
                                queue_s=seq.admitted - seq.enqueued)

    async def publish(self, agent: str, version: int, weights: dict) -> None:
        await self.rt.publish(agent, version)

    def end_iteration(self, k: int, stats: dict | None = None) -> dict | None:
        """Between iterations the hierarchical balancer re-plans from measured demand."""
        self.rt.replan()
        return dict(self.rt.plans[-1]) if self.rt.plans else None


_OUTSTANDING = operator.attrgetter("outstanding_tokens")


@dataclass
class SharedSlots:
    """Training slots that light agents time-share: `accelerators` each, bound by the
    production allocator; `idle` is set while no call is in flight."""

    members: tuple[str, ...]
    accelerators: int
    allocator: SlotAllocator
    in_flight: int = 0
    lane: str = ""  # the slots' lanes are f"{lane}{slot}" (default: train/shared{g}/)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def done(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()


class SimTrainPool(TrainPool):
    n_workers: int

    def __init__(self, runtime: SimRuntime) -> None:
        self.rt = runtime
        self.n_workers = 1
        self.versions: dict[str, int] = defaultdict(int)

    async def accumulate(self, agent: str, samples: list[Sample]) -> dict[str, float]:
        tokens = sum(len(s.prompt) + len(s.response) for s in samples)
        await self.rt.train_work(agent, "train", tokens)
        return {"rows": float(len(samples))}

    async def step(self, agent: str) -> tuple[dict[str, float], dict]:
        await self.rt.train_work(agent, "step", 0)
        self.versions[agent] += 1
        return {"rows": 0.0}, {}

    async def weights(self, agent: str) -> dict:
        return {}

    async def save(self, agent: str, directory: str) -> str:
        return directory


class SimRuntime(Runtime):
    """Plans resources for a workload and serves the orchestrator's pool calls in virtual time."""

    def __init__(self, wl: Workload, features: SimFeatures, cost: CostModel | None = None,
                 mode: str = "async"):
        """`mode` is the orchestrator's pipeline mode: the planner predicts an iteration as
        rollout and training overlapped (`async`) or one after the other (`sync`)."""
        self.wl = wl
        self.features = features
        self.mode = mode
        self.cost = cost or wl.cost_model()
        self.total = wl.cluster.total_accelerators
        self.spans: list[BusySpan] = []
        self.queue_waits: dict[str, list[float]] = defaultdict(list)
        self.solo_latency: dict[str, float] = {}
        self.requests: dict[str, tuple[float, float]] = {}  # sample_id -> (submitted, done)
        self.active: dict[str, int] = {}
        self.plans: list[dict[str, Any]] = []
        self.rollout = SimRolloutPool(self)
        self.train = SimTrainPool(self)
        self.trainable = [a.name for a in wl.agents if a.trainable]
        self.groups: dict[str, int] = {}  # colocated: each agent's own accelerators
        self.paused_replicas: dict[str, list[SimReplica]] = defaultdict(list)
        self._asleep: set[str] = set()  # colocated: agents whose engines sleep while they train
        # time_shared: who holds the cluster (("roll" | "train", agent)), who waits for it,
        # requests of each agent not yet finished, whether a switch or a training call runs
        self._holder: tuple[str, str] | None = None
        self._queue: list[tuple[str, str]] = []
        self._wake: dict[tuple[str, str], asyncio.Future] = {}
        self._pending: dict[str, int] = defaultdict(int)
        self._switching = False
        self._incoming: tuple[str, str] | None = None
        self._training = 0
        self._train_locks: dict[str, asyncio.Lock] = {}
        # time-shared training slots: (members, accelerators per slot, slots) of the plan, and
        # the production allocator that binds the members to the slots
        self._pool_plan: tuple[tuple[str, ...], int, int] | None = None
        self.slot_pool: SharedSlots | None = None
        self._handover: asyncio.Event | None = None  # set once the previous pool is idle
        self._on_host: set[str] = set()  # shared agents whose training state was swapped out
        self._loop: asyncio.AbstractEventLoop | None = None
        # busy accelerator-seconds so far, per pool and agent (measured load)
        self.work: dict[str, dict[str, float]] = {"rollout": defaultdict(float),
                                                  "train": defaultdict(float)}
        self._last_work: dict[str, float] = {}
        # per agent: busy training accelerator-seconds and the tokens they trained
        self._train_cost: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        # output and prompt lengths of each agent's requests since the last plan
        self._lengths: dict[str, list[int]] = defaultdict(list)
        self._prompts: dict[str, list[int]] = defaultdict(list)
        self.planner = Planner(mode, features)
        self.resources = Resources(self.total)  # one budget: the planner splits it
        # `training.slot_sizes` (the run's runtime.slot_sizes): the training slots are given,
        # the rollout pool is the rest; each slot is a pool of its own, one production
        # allocator per slot over the agents the first plan bound to it (as the real
        # runtime, whose binding is fixed at start)
        self.slot_sizes = sorted(wl.training.slot_sizes or [], reverse=True)
        self.slot_pools: dict[str, SharedSlots] = {}
        if self.slot_sizes:
            if sum(self.slot_sizes) >= self.total:
                raise ValueError(f"{wl.name}: training.slot_sizes {self.slot_sizes} leave no "
                                 f"rollout device of the cluster's {self.total}")
            self.resources = Resources(self.total, self.total - sum(self.slot_sizes),
                                       len(self.slot_sizes), tuple(self.slot_sizes))
        self.plan_resources()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # --- planning ------------------------------------------------------------------------
    def _measured_rollout(self) -> dict[str, float]:
        """Busy accelerator-seconds each agent's rollout took since the last plan."""
        now = dict(self.work["rollout"])
        last, self._last_work = self._last_work, now
        return {a.name: now.get(a.name, 0.0) - last.get(a.name, 0.0) for a in self.wl.agents}

    def plan_resources(self, measured: bool = False) -> None:
        """Follow the planner's next plan: replicas, pools, training slots."""
        demand = CostModelDemand(self.wl, self.cost, measured, self._lengths, self._prompts,
                                 self._train_cost, self._measured_rollout)
        plan = self.planner.plan(demand, self.resources, len(self.plans))
        assert plan.replicas is not None  # the simulator's replicas are always planned
        if plan.groups is not None:
            self.groups = plan.groups
        self._pool_plan = plan.shared_slots
        self.roll_acc, self.train_acc = plan.rollout_accelerators, plan.train_accelerators
        self.train_alloc = plan.train
        if plan.slot_of is not None and plan.slot_sizes is not None:
            self._pool_plan = None  # the slots are the pools
            if not self.slot_pools:
                for i, k in enumerate(plan.slot_sizes):
                    members = tuple(a for a, s in plan.slot_of.items() if s == i)
                    pool = SharedSlots(members, k, SlotAllocator(1), lane=f"train/slot{i}/")
                    self.slot_pools.update({a: pool for a in members})
            # the agents stay on the slots they were bound to first
            self.train_alloc = {a: pool.accelerators for a, pool in self.slot_pools.items()}
        self._bind_slot_pool()
        self._resize_replicas(plan.replicas)
        self._lengths.clear()
        self._prompts.clear()
        self.plans.append(plan.to_dict())

    def _bind_slot_pool(self) -> None:
        """The plan's shared slots get a production `SlotAllocator`, kept across plans while
        the members and the number of slots stay the same (residents stay bound). A new
        pool starts once the previous one has finished its calls in flight, so a slot never
        holds two agents; residents of the old pool count as resident (not swapped) there."""
        old = self.slot_pool
        if self._pool_plan is None:
            self.slot_pool = None
        else:
            members, g, slots = self._pool_plan
            if old is not None and (old.members, old.accelerators, old.allocator.n_slots) \
                    == (members, g, slots):
                return
            self.slot_pool = SharedSlots(members, g, SlotAllocator(slots))
        self._handover = old.idle if old is not None and old.in_flight else None

    def _resize_replicas(self, replicas: dict[str, int]) -> None:
        for agent, n in replicas.items():
            have = self.rollout.replicas.setdefault(agent, [])
            while len(have) < n:
                have.append(SimReplica(self, agent, len(have), self.wl.agent(agent).tp))
            # shrinking: surplus replicas keep running what they hold but get nothing new
            self.active[agent] = n
        self.rollout.n_workers = sum(self.active.values())

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        for reps in self.rollout.replicas.values():
            for r in reps:
                if r._handle is not None:
                    r._handle.cancel()

    def placement(self) -> dict[str, Any]:
        return {"plan": self.plans[-1]}

    # --- accounting ------------------------------------------------------------------------
    def busy(self, replica: SimReplica, kind: str, start: float, end: float) -> None:
        if end > start:
            self.spans.append(BusySpan(replica.lane, "rollout", replica.agent, kind, start, end,
                                       replica.tp))
            self.work["rollout"][replica.agent] += (end - start) * replica.tp

    def finish(self, replica: SimReplica, seq: _Seq, now: float) -> None:
        if not seq.future.done():
            seq.future.set_result(now)
        if self.features.time_shared:
            self._pending[replica.agent] -= 1
            if not self._pending[replica.agent]:
                self._next_holder()

    # --- time-shared cluster (MAS-RL-like) ------------------------------------------------
    def _claim(self, who: tuple[str, str]) -> None:
        settled = who == self._holder and not self._switching
        if not settled and who != self._incoming and who not in self._queue:
            self._queue.append(who)
        self._next_holder()

    def _busy_holder(self) -> bool:
        h = self._holder
        if h is None:
            return False
        return self._training > 0 if h[0] == "train" else self._pending[h[1]] > 0

    def _next_holder(self) -> None:
        """Hand the cluster to the first waiter once its holder is idle: offload the holder
        (engines to host, or training state), load the waiter's, then let it run."""
        if self._switching or not self._queue or self._busy_holder():
            return
        nxt = self._queue.pop(0)
        cost, old = self.cost, self._holder
        seconds = 0.0
        for who, loading in ((old, False), (nxt, True)):
            if who is None:
                continue
            spec = self.wl.agent(who[1])
            if who[0] == "roll":
                seconds += (cost.engine_wake_time if loading else cost.engine_sleep_time)(
                    spec.model, spec.tp)
            else:
                seconds += cost.train_state_swap_time(spec.model, self.total)
        self._switching = True
        self._incoming = nxt
        t0 = self.loop.time()

        def switched() -> None:
            self._switching = False
            self._holder, self._incoming = nxt, None
            self.spans.append(BusySpan("cluster/switch", "overhead", nxt[1], "switch", t0,
                                       self.loop.time(), 0))
            if nxt[0] == "roll":
                for replica in self.paused_replicas.pop(nxt[1], []):
                    replica.resume()
            else:
                # the trainer holds the cluster from now on, until its call is done
                self._training += 1
                self._wake.pop(nxt).set_result(None)
                return
            self._next_holder()

        self.loop.call_at(t0 + seconds, switched)

    async def _hold_for_training(self, agent: str) -> None:
        who = ("train", agent)
        if self._holder == who and not self._switching:
            self._training += 1
            return
        fut = self._wake.get(who)
        if fut is None:
            fut = self._wake[who] = self.loop.create_future()
        self._claim(who)
        await fut

    # --- colocated phases ------------------------------------------------------------------
    def paused(self, agent: str) -> bool:
        """Colocated: an agent's engines are asleep while its trainer holds the devices;
        time-shared: while anyone else holds the cluster."""
        if self.features.time_shared:
            if self._holder == ("roll", agent) and not self._switching:
                return False
            self._claim(("roll", agent))
            return True
        return agent in self._asleep

    async def train_work(self, agent: str, kind: str, tokens: int) -> None:
        loop = self.loop
        spec = self.wl.agent(agent)
        n = self.train_alloc[agent]
        f = self.features
        lock = (self._train_locks.setdefault("all", asyncio.Lock()) if f.sequential_training
                else self._train_locks.setdefault(agent, asyncio.Lock()))
        async with lock:
            if f.time_shared:
                await self._hold_for_training(agent)  # counts this call in self._training
                try:
                    await self._compute(agent, kind, tokens, n, "train/cluster")
                finally:
                    self._training -= 1
                    self._next_holder()
                return
            if f.colocated and agent not in self._asleep:
                # the agent's engines go to sleep (offload weights and KV) before it trains
                self._asleep.add(agent)
                t0 = loop.time()
                await asyncio.sleep(self.cost.engine_sleep_time(spec.model, spec.tp))
                self.spans.append(BusySpan(f"train/{agent}", "overhead", agent, "sleep", t0,
                                           loop.time(), 0))
            pool = self.slot_pools.get(agent) or self.slot_pool
            if pool is None or agent not in pool.members:
                await self._compute(agent, kind, tokens, n, f"train/{agent}")
                return
            if self._handover is not None and agent not in self.slot_pools:
                await self._handover.wait()
            g, alloc = pool.accelerators, pool.allocator
            pool.in_flight += 1
            pool.idle.clear()
            try:
                # the production allocator binds the agent to a slot, older iterations first
                version = self.train.versions[agent]
                lease = await alloc.acquire(agent, (version, 0 if kind == "step" else 1))
            except BaseException:
                pool.done()
                raise
            try:
                lane = f"{pool.lane or f'train/shared{g}/'}{lease.slot}"
                if lease.evict is not None:
                    try:
                        await self._swap(lease.evict, g, lane, "swap_out")
                        self._on_host.add(lease.evict)
                    finally:
                        alloc.state_arrived(lease.evict)
                if lease.swap_in and agent in self._on_host:
                    await alloc.wait_state(agent)  # evicted elsewhere a moment ago?
                    await self._swap(agent, g, lane, "swap_in")
                    self._on_host.discard(agent)
                await self._compute(agent, kind, tokens, g, lane)
            finally:
                alloc.release(lease)
                pool.done()

    async def _swap(self, agent: str, n: int, lane: str, kind: str) -> None:
        """Move `agent`'s sharded training state between its slot's devices and host."""
        t0 = self.loop.time()
        await asyncio.sleep(self.cost.train_state_swap_time(self.wl.agent(agent).model, n))
        self.spans.append(BusySpan(lane, "overhead", agent, kind, t0, self.loop.time(), 0))

    async def _compute(self, agent: str, kind: str, tokens: int, n: int, lane: str) -> None:
        loop = self.loop
        model = self.wl.agent(agent).model
        t0 = loop.time()
        if kind == "train":
            # old-policy and reference log-probs of the micro-batch's rows, then its update
            await asyncio.sleep(self.cost.train_compute_time(model, n, tokens)
                                + self.cost.policy_forwards_time(
                                    model, n, tokens, self.wl.training.forward_passes))
        else:
            await asyncio.sleep(self.cost.optimizer_step_time(model, n))
        self.spans.append(BusySpan(lane, "train", agent, kind, t0, loop.time(), n))
        self.work["train"][agent] += (loop.time() - t0) * n
        self._train_cost[agent][0] += (loop.time() - t0) * n
        self._train_cost[agent][1] += tokens

    async def publish(self, agent: str, version: int) -> None:
        spec = self.wl.agent(agent)
        lock = (self._train_locks.setdefault("publish", asyncio.Lock())
                if self.features.serial_publish else contextlib.nullcontext())
        async with lock:
            await self._publish(agent, spec, version)

    async def _publish(self, agent: str, spec: Any, version: int) -> None:
        loop = self.loop
        t0 = loop.time()
        if self.features.time_shared:
            pass  # the weights stay on the cluster; the switch to its engines loads them
        elif self.features.colocated:
            # the new weights are already on the agent's devices: wake its engines
            if agent in self._asleep:
                await asyncio.sleep(self.cost.engine_wake_time(spec.model, spec.tp))
                self._asleep.discard(agent)
                for replica in self.paused_replicas.pop(agent, []):
                    replica.resume()
        else:
            await asyncio.sleep(self.cost.weight_transfer_time(
                spec.model, inter_node=True, links=spec.tp))
        # each replica holds the new version once its running sequences are done (the
        # production scheduler's deferred load); its requests wait for it until then
        for replica in self.rollout.replicas.get(agent, []):
            replica.load(version)
        self.spans.append(BusySpan(f"publish/{agent}", "publish", agent, "publish", t0,
                                   loop.time(), 0))

    def replan(self) -> None:
        """Between iterations: hierarchical balancing and agent-centric allocation re-plan
        the pools from the measured load."""
        f = self.features
        if not f.colocated and (f.balance == "hierarchical" or f.allocation == "agent_centric"):
            self.plan_resources(measured=True)

    # --- summaries -------------------------------------------------------------------------
    def busy_accel_seconds(self, t0: float = 0.0, t1: float = math.inf) -> float:
        total = 0.0
        for s in self.spans:
            if s.accelerators and s.end > t0 and s.start < t1:
                total += (min(s.end, t1) - max(s.start, t0)) * s.accelerators
        return total
