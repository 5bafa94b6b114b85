"""The simulated runtime: rollout replicas and trainers that `await` what the cost model
predicts, on the virtual clock. The orchestrator driving them is the production one.

Resource plans (which accelerators serve which agent) are computed here from the workload:
- rollout/training split: in proportion to estimated rollout vs training work (disaggregated),
  or every accelerator doing both in turn (colocated, the MARTI-like baseline);
- inter-agent rollout balance: `hierarchical` gives each agent replicas in proportion to its
  demand (tokens x per-token cost), re-planned each iteration from measured tokens; `static`
  splits replicas equally;
- intra-agent: a request goes to the replica with the least outstanding tokens;
- training allocation: `agent_centric` binds accelerators in proportion to training load,
  `static` splits them equally.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.policy.model import stable_seed
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.balancer import allot_replicas
from flexmarl.sim.cost import CostModel
from flexmarl.sim.task import SyntheticTokens
from flexmarl.sim.workload import Workload
from flexmarl.training.trainer import Sample


@dataclass
class SimFeatures:
    """What the simulated system does; the baselines are particular settings of these."""

    colocated: bool = False  # rollout and training take turns on the same accelerators
    balance: str = "hierarchical"  # or "static"
    allocation: str = "agent_centric"  # or "static"
    sequential_training: bool = False  # agents trained one after another


@dataclass
class BusySpan:
    lane: str
    pool: str
    agent: str
    kind: str  # gen | prefill | train | step | publish | swap
    start: float
    end: float
    accelerators: int


def largest_remainder(weights: dict[str, float], total: int, minimum: dict[str, int]) -> dict[str, int]:
    """Split `total` units in proportion to `weights`, each at least `minimum[name]`."""
    out = dict(minimum)
    left = total - sum(out.values())
    if left <= 0:
        return out
    wsum = sum(weights.values()) or 1.0
    shares = {k: left * w / wsum for k, w in weights.items()}
    for k, s in shares.items():
        out[k] += int(math.floor(s))
    rest = total - sum(out.values())
    for k in sorted(shares, key=lambda k: shares[k] - math.floor(shares[k]), reverse=True)[:rest]:
        out[k] += 1
    return out


@dataclass
class _Seq:
    remaining: int
    kv: int
    out_len: int
    future: asyncio.Future
    enqueued: float
    request: GenerationRequest
    admitted: float = 0.0


class SimReplica:
    """One inference engine (tp accelerators) with continuous batching in virtual time.

    Sequences are admitted as others finish (up to max_num_seqs); each admission costs a
    prefill; a decode segment runs until the first running sequence finishes or a new request
    arrives, whichever comes first.
    """

    def __init__(self, runtime: SimRuntime, agent: str, index: int, tp: int) -> None:
        self.rt = runtime
        self.agent = agent
        self.index = index
        self.tp = tp
        self.model = runtime.wl.agent(agent).model
        self.lane = f"rollout/{agent}/{index}"
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.outstanding_tokens = 0
        self.arrived = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.cap = runtime.cost.max_num_seqs

    def submit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.outstanding_tokens += seq.out_len + seq.kv
        self.arrived.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        cost = self.rt.cost
        while True:
            if not self.running and not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            await self.rt.rollout_gate(self)
            if self.waiting and len(self.running) < self.cap:
                admit = self.waiting[: self.cap - len(self.running)]
                del self.waiting[: len(admit)]
                t0 = loop.time()
                await asyncio.sleep(cost.prefill_time(self.model, self.tp,
                                                      sum(s.kv for s in admit)))
                self.rt.busy(self, "prefill", t0, loop.time())
                for seq in admit:
                    seq.admitted = t0
                    self.rt.queue_waits[self.agent].append(t0 - seq.enqueued)
                self.running.extend(admit)
            if not self.running:
                continue
            steps = min(s.remaining for s in self.running)
            kv = sum(s.kv for s in self.running)
            step_s = cost.decode_step_time(self.model, self.tp, len(self.running), kv)
            self.arrived.clear()
            t0 = loop.time()
            if len(self.running) >= self.cap // 4 or self.waiting:
                # a well-filled batch admits newcomers when its next sequence finishes
                await asyncio.sleep(steps * step_s)
                done_steps = steps
            else:  # an under-filled batch admits newcomers at the next decode step
                try:
                    await asyncio.wait_for(self.arrived.wait(), timeout=steps * step_s)
                    done_steps = min(steps, max(1, int((loop.time() - t0) / step_s)))
                    await asyncio.sleep(max(0.0, t0 + done_steps * step_s - loop.time()))
                except TimeoutError:
                    done_steps = steps
            self.rt.busy(self, "gen", t0, loop.time())
            still = []
            for s in self.running:
                s.remaining -= done_steps
                s.kv += done_steps
                self.outstanding_tokens -= done_steps
                if s.remaining <= 0:
                    self.outstanding_tokens -= s.kv - s.out_len
                    self.rt.finish(self, s, loop.time())
                else:
                    still.append(s)
            self.running = still


class SimRolloutPool:
    def __init__(self, runtime: SimRuntime) -> None:
        self.rt = runtime
        self.replicas: dict[str, list[SimReplica]] = {}
        self.n_workers = 0

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        rt = self.rt
        spec = rt.wl.agent(request.agent)
        rng = np.random.default_rng(stable_seed(rt.wl.seed, "out", request.sample_id))
        out_len = max(1, int(spec.output_length.sample(rng)))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        seq = _Seq(out_len, len(request.prompt), out_len, fut, loop.time(), request)
        replica = min(self.replicas[request.agent][: rt.active[request.agent]],
                      key=lambda r: (r.outstanding_tokens, r.index))
        # the request's latency alone on an idle engine: a term of the critical path
        p = len(request.prompt)
        rt.solo_latency[request.sample_id] = (
            rt.cost.prefill_time(spec.model, spec.tp, p)
            + out_len * rt.cost.decode_step_time(spec.model, spec.tp, 1, p + out_len / 2))
        replica.submit(seq)
        await fut
        rt.tokens[request.agent] += out_len
        return GenerationResult(request.sample_id, SyntheticTokens(out_len), [],  # type: ignore[arg-type]
                                request.version, admitted_at=seq.admitted,
                                queue_s=seq.admitted - seq.enqueued)

    async def publish(self, agent: str, version: int, weights: dict) -> None:
        await self.rt.publish(agent, version)

    def end_iteration(self, k: int, stats: dict | None = None) -> dict | None:
        """Between iterations the hierarchical balancer re-plans from measured demand."""
        self.rt.replan()
        return dict(self.rt.plans[-1]) if self.rt.plans else None


class SimTrainPool:
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


class SimRuntime:
    """Plans resources for a workload and serves the orchestrator's pool calls in virtual time."""

    def __init__(self, wl: Workload, features: SimFeatures, cost: CostModel | None = None):
        self.wl = wl
        self.features = features
        self.cost = cost or wl.cost_model()
        self.total = wl.cluster.total_accelerators
        self.spans: list[BusySpan] = []
        self.tokens: dict[str, int] = defaultdict(int)
        self.queue_waits: dict[str, list[float]] = defaultdict(list)
        self.solo_latency: dict[str, float] = {}
        self.active: dict[str, int] = {}
        self.plans: list[dict[str, Any]] = []
        self.rollout = SimRolloutPool(self)
        self.train = SimTrainPool(self)
        self.trainable = [a.name for a in wl.agents if a.trainable]
        self._train_locks: dict[str, asyncio.Lock] = {}
        self._phase = "rollout"  # colocated baseline only
        self._rollout_phase: asyncio.Event | None = None
        self._training_agents = 0
        self._tasks: list[asyncio.Task] = []
        self.plan_resources()

    # --- planning ------------------------------------------------------------------------
    def _rollout_demand(self, measured: bool) -> dict[str, float]:
        """Accelerator-seconds per iteration each agent's rollout needs (cost x tokens)."""
        wl, cost = self.wl, self.cost
        out = {}
        for a in wl.agents:
            calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
            tokens = (self.tokens[a.name] / max(1, len(self.plans)) if measured and self.tokens
                      else calls * a.output_length.mean)
            # per-token cost at a typical batch of 64 sequences
            step = cost.decode_step_time(a.model, a.tp, 64, 64 * (a.prompt_length.mean + 256))
            out[a.name] = tokens * step * a.tp / 64
        return out

    def critical_path_estimate(self) -> float:
        """Longest chain of one episode with tail-length (p99) outputs, each node alone on an
        idle engine: no rollout, however many replicas it gets, finishes sooner."""
        wl, cost = self.wl, self.cost
        rng = np.random.default_rng(stable_seed(wl.seed, "p99"))
        finish: dict[str, float] = {}
        for node in wl.episode_nodes():
            a = wl.agent(node.agent)
            out = float(np.quantile(a.output_length.sample(rng, 2000), 0.99))
            prompt = a.prompt_length.mean
            lat = cost.prefill_time(a.model, a.tp, prompt) + out * cost.decode_step_time(
                a.model, a.tp, 1, prompt + out / 2)
            finish[node.id] = max((finish[i] for i in node.inputs), default=0.0) + lat
        return max(finish.values(), default=0.0)

    def _train_demand(self) -> dict[str, float]:
        wl, cost = self.wl, self.cost
        out = {}
        for a in wl.agents:
            if not a.trainable:
                continue
            calls = wl.calls_per_episode(a.name) * wl.episodes_per_iteration
            tokens = calls * (a.prompt_length.mean + a.output_length.mean)
            out[a.name] = cost.train_compute_time(a.model, 1, tokens)
        return out

    def plan_resources(self, measured: bool = False) -> None:
        wl, f = self.wl, self.features
        roll_d, train_d = self._rollout_demand(measured), self._train_demand()
        if f.colocated:
            roll_acc, train_acc = self.total, self.total
        else:
            need_train = sum(self.cost.min_train_accelerators(wl.agent(a).model)
                             for a in self.trainable)
            need_roll = sum(a.tp for a in wl.agents)
            # in proportion to estimated rollout vs training work
            share = sum(roll_d.values()) / (sum(roll_d.values()) + sum(train_d.values()))
            roll_acc = min(self.total - need_train, max(need_roll, round(self.total * share)))
            train_acc = self.total - roll_acc
        # replicas per agent
        units = {a.name: a.tp for a in wl.agents}
        # the production balancer's inter-agent allotment, in whole replicas of tp accelerators
        replicas = allot_replicas(roll_d, roll_acc,
                                  "hierarchical" if f.balance == "hierarchical" else "static",
                                  units)
        # training accelerators
        mins = {a: self.cost.min_train_accelerators(wl.agent(a).model) for a in self.trainable}
        if f.colocated or f.sequential_training:
            train_alloc = dict.fromkeys(self.trainable, train_acc)
        elif f.allocation == "agent_centric":
            train_alloc = largest_remainder(train_d, train_acc, mins)
        else:
            equal = train_acc // max(1, len(self.trainable))
            train_alloc = {a: max(mins[a], equal) for a in self.trainable}
        self.roll_acc, self.train_acc = roll_acc, train_acc
        self.train_alloc = train_alloc
        self._resize_replicas(replicas)
        self.plans.append({"rollout_accelerators": roll_acc, "train_accelerators": train_acc,
                           "replicas": dict(replicas), "train": dict(train_alloc)})

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
        self._rollout_phase = asyncio.Event()
        self._rollout_phase.set()
        self._spawn()

    def _spawn(self) -> None:
        for reps in self.rollout.replicas.values():
            for r in reps:
                if r.task is None:
                    r.task = asyncio.ensure_future(r.run())
                    self._tasks.append(r.task)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def placement(self) -> dict[str, Any]:
        return {"plan": self.plans[-1]}

    # --- accounting ------------------------------------------------------------------------
    def busy(self, replica: SimReplica, kind: str, start: float, end: float) -> None:
        if end > start:
            self.spans.append(BusySpan(replica.lane, "rollout", replica.agent, kind, start, end,
                                       replica.tp))

    def finish(self, replica: SimReplica, seq: _Seq, now: float) -> None:
        if not seq.future.done():
            seq.future.set_result(now)

    # --- colocated phases ------------------------------------------------------------------
    async def rollout_gate(self, replica: SimReplica) -> None:
        """Colocated: engines are asleep while training runs."""
        if self.features.colocated and self._rollout_phase is not None:
            await self._rollout_phase.wait()

    async def train_work(self, agent: str, kind: str, tokens: int) -> None:
        loop = asyncio.get_running_loop()
        spec = self.wl.agent(agent)
        n = self.train_alloc[agent]
        f = self.features
        lock = (self._train_locks.setdefault("all", asyncio.Lock())
                if (f.colocated or f.sequential_training)
                else self._train_locks.setdefault(agent, asyncio.Lock()))
        if f.colocated and self._phase == "rollout":
            # rollout engines go to sleep (offload weights) before the first training work
            self._phase = "train"
            assert self._rollout_phase is not None
            self._rollout_phase.clear()
            t0 = loop.time()
            await asyncio.sleep(max(self.cost.engine_sleep_time(a.model, a.tp)
                                    for a in self.wl.agents))
            self.spans.append(BusySpan("colocated", "overhead", agent, "sleep", t0, loop.time(),
                                       0))
        async with lock:
            t0 = loop.time()
            if kind == "train":
                await asyncio.sleep(self.cost.train_compute_time(spec.model, n, tokens))
            else:
                await asyncio.sleep(self.cost.optimizer_step_time(spec.model, n))
            self.spans.append(BusySpan(f"train/{agent}", "train", agent, kind, t0, loop.time(),
                                       n))

    async def publish(self, agent: str, version: int) -> None:
        loop = asyncio.get_running_loop()
        spec = self.wl.agent(agent)
        t0 = loop.time()
        if self.features.colocated:
            # weights are already on the devices; wake the engines once all agents stepped
            if version > 0:
                self._training_agents += 1
                if self._training_agents >= len(self.trainable):
                    self._training_agents = 0
                    await asyncio.sleep(max(self.cost.engine_wake_time(a.model, a.tp)
                                            for a in self.wl.agents))
                    self._phase = "rollout"
                    assert self._rollout_phase is not None
                    self._rollout_phase.set()
        else:
            await asyncio.sleep(self.cost.weight_transfer_time(
                spec.model, inter_node=True, links=spec.tp))
        self.spans.append(BusySpan(f"publish/{agent}", "publish", agent, "publish", t0,
                                   loop.time(), 0))

    def replan(self) -> None:
        """Between iterations: hierarchical balancing re-plans from measured demand."""
        if self.features.balance == "hierarchical" and not self.features.colocated:
            self.plan_resources(measured=True)
            self._spawn()

    # --- summaries -------------------------------------------------------------------------
    def busy_accel_seconds(self, t0: float = 0.0, t1: float = math.inf) -> float:
        total = 0.0
        for s in self.spans:
            if s.accelerators and s.end > t0 and s.start < t1:
                total += (min(s.end, t1) - max(s.start, t0)) * s.accelerators
        return total


@dataclass
class SimReport:
    name: str
    makespan_s: float
    per_iteration_s: float
    utilisation: float
    busy_accel_s: float
    lower_bound_s: float = 0.0
    efficiency: float = 0.0
    plans: list[dict[str, Any]] = field(default_factory=list)
