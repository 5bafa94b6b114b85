"""In-memory fakes of the rollout and training pools, for orchestrator tests in one process.

They implement the declared interfaces of `flexmarl.api.runtime` without models or worker
processes, deterministically, and record what the orchestrator asked of them so that tests
can check the pipeline's logic (versions, micro-batches, failures) in milliseconds:
- `FakeRolloutPool` answers each request with tokens keyed by (seed, sample_id, the version
  requested, the digest of the weights it holds for that version), so a request served with
  other weights than the synchronous pipeline's gets other tokens;
- `FakeTrainPool` folds every micro-batch it accumulates into a digest (its "weights"), in
  order; two runs that trained the same rows in the same micro-batches in the same order
  end with the same digest, as real trainers end with the same checkpoint.
Both interleave their calls with a deterministic number of event-loop yields per call, so
episodes and micro-batches complete out of order as on a real runtime.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.api.runtime import RolloutPool, TrainPool, WorkerError, WorkerLost
from flexmarl.planning.planner import Plan
from flexmarl.training.digest_host import DigestSlotHost, digest, digest_of, weights_of
from flexmarl.training.host import SlotPool
from flexmarl.types import GenerationRequest, GenerationResult


async def _yields(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@dataclass
class Generated:
    """One generation the fake rollout pool served."""

    sample_id: str
    agent: str
    version: int  # the version the request asked for
    held: int | None  # the version the pool held for the agent when it served it
    tokens: list[int]


class FakeRolloutPool(RolloutPool):
    """A rollout pool without models; `fail(request)` returning True makes that request's
    replica report a failure (`WorkerError`), which fails its episode."""

    n_workers: int

    def __init__(self, seed: int = 0, fail: Callable[[GenerationRequest], bool] | None = None,
                 max_yields: int = 4, plan: bool = False) -> None:
        self.seed = seed
        self.fail = fail
        self.max_yields = max_yields
        self.plan = plan
        self.n_workers = 1
        self.held: dict[str, tuple[int, str]] = {}  # agent -> (version, weights digest)
        self.published: list[tuple[str, int, str]] = []
        self.generated: list[Generated] = []
        self.ended: list[int] = []
        self.followed: list[Plan] = []  # the planner's plans, in order

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        key = digest(self.seed, request.sample_id, request.version)
        await _yields(int(key[:2], 16) % (self.max_yields + 1))
        held = self.held.get(request.agent)
        if self.fail is not None and self.fail(request):
            raise WorkerError(f"fake replica: {request.sample_id} failed")
        weights = held[1] if held is not None and held[0] == request.version else "stale"
        rng = np.random.default_rng(int(digest(key, weights), 16))
        choices = request.allowed_tokens or list(range(3, 12))
        n = max(1, min(request.max_new_tokens, 1 + int(rng.integers(request.max_new_tokens))))
        tokens = [int(choices[int(rng.integers(len(choices)))]) for _ in range(n)]
        self.generated.append(Generated(request.sample_id, request.agent, request.version,
                                        held[0] if held is not None else None, tokens))
        return GenerationResult(request.sample_id, tokens, [-0.5] * len(tokens),
                                request.version)

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        await asyncio.sleep(0)
        self.held[agent] = (version, digest_of(weights))
        self.published.append((agent, version, digest_of(weights)))

    def follow_plan(self, plan: Plan) -> None:
        self.followed.append(plan)

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any] | None:
        self.ended.append(k)
        if not self.plan:
            return None
        return {"iteration": k + 1, "rows": {a: s.rows for a, s in sorted(stats.items())}}


@dataclass
class Accumulated:
    """One micro-batch the fake training pool accumulated."""

    agent: str
    trainer_version: int  # how many steps the agent's trainer had taken
    sample_ids: list[str]
    policy_versions: list[int]


@dataclass
class _Trainer:
    version: int = 0
    weights: str = ""
    pending: list[str] = field(default_factory=list)  # micro-batch digests since the step


class FakeTrainPool(TrainPool):
    """A training pool without models: each agent's calls run one after another in the order
    they were made (as the real pools serve them), with `slots` the number of training slots
    the agents time-share (None: one trainer each)."""

    n_workers: int

    def __init__(self, agents: list[str], slots: int | None = None, max_yields: int = 3,
                 fail_step: Callable[[str, int], bool] | None = None) -> None:
        self.slots = slots
        self.max_yields = max_yields
        self.fail_step = fail_step
        self.n_workers = slots or max(1, len(agents))
        self.trainers = {a: _Trainer(weights=digest("init", a)) for a in agents}
        self.accumulated: list[Accumulated] = []
        self.steps: list[tuple[str, int, int]] = []  # (agent, version after, micro-batches)
        self._order: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.active: set[str] = set()  # agents with a call in progress
        self.max_active = 0
        self.followed: list[Plan] = []  # the planner's plans, in order

    def follow_plan(self, plan: Plan) -> None:
        self.followed.append(plan)

    def training_slots(self) -> int | None:
        return self.slots

    async def _run(self, agent: str, fn: Callable[[_Trainer], Any], cost: int) -> Any:
        async with self._order[agent]:
            self.active.add(agent)
            self.max_active = max(self.max_active, len(self.active))
            try:
                await _yields(cost)
                return fn(self.trainers[agent])
            finally:
                self.active.discard(agent)

    async def accumulate(self, agent: str, samples: Any) -> dict[str, float]:
        rows = list(samples)

        def run(t: _Trainer) -> dict[str, float]:
            self.accumulated.append(Accumulated(agent, t.version, [s.sample_id for s in rows],
                                                [s.policy_version for s in rows]))
            t.pending.append(digest([(s.sample_id, s.policy_version, s.response,
                                      round(float(s.advantage), 12)) for s in rows]))
            return {"rows": float(len(rows))}

        return await self._run(agent, run, 1 + len(rows) % (self.max_yields + 1))

    async def step(self, agent: str) -> tuple[dict[str, float], Any]:
        def run(t: _Trainer) -> tuple[dict[str, float], Any]:
            if self.fail_step is not None and self.fail_step(agent, t.version):
                raise WorkerError(f"fake trainer of {agent!r}: step {t.version} failed")
            t.weights = digest(t.weights, t.pending)
            self.steps.append((agent, t.version + 1, len(t.pending)))
            t.version += 1
            t.pending = []
            return {"loss": 0.0, "micro_batches": float(self.steps[-1][2])}, weights_of(t.weights)

        return await self._run(agent, run, 1)

    async def weights(self, agent: str) -> Any:
        return weights_of(self.trainers[agent].weights)

    async def save(self, agent: str, directory: str) -> str:
        return f"{directory}/{agent}"

    async def get_state(self, agent: str) -> tuple[dict, dict]:
        t = self.trainers[agent]
        return weights_of(t.weights), {"version": t.version, "pending": list(t.pending)}

    async def set_state(self, agent: str, state: tuple[dict, dict]) -> None:
        weights, meta = state
        self.trainers[agent] = _Trainer(int(meta["version"]), digest_of(weights),
                                        list(meta["pending"]))


# --- the shared training host's driver side, over fake slots --------------------------------
FakeSlotHost = DigestSlotHost  # the orchestrator tests' name for the model-free slot


class FakeSlotPool(SlotPool):
    """`training.host.SlotPool` over `FakeSlotHost`s in this process: each command yields to
    the event loop a few times (so agents' calls interleave as over pipes or actor calls), and
    `lose(slot, after)` makes the slot's `after`-th next command find it dead: its memory is
    gone and every call to it fails (`WorkerLost`) until, with `recover`, the first caller's
    restart (shared by the others) brings up a fresh host restored through
    `SlotPool.restore_slot`, as the runtimes' supervisors do."""

    def __init__(self, n_slots: int, recover: bool = False, yields: int = 2,
                 parks: bool = False) -> None:
        """`parks`: the hosts keep swapped-out states, as `TrainHost`s do on the local
        runtime (`SlotPool._slot_generation`: a restarted host is another generation)."""
        super().__init__(n_slots)
        self.recover = recover
        self.yields = yields
        self.parks = parks
        self.hosts = [FakeSlotHost(parks) for _ in range(n_slots)]
        self.generations = [0] * n_slots  # a restarted host is the next
        self.doomed: dict[int, int] = {}  # slot -> commands left before it is lost
        self.dead: set[int] = set()
        self.restarts = 0
        self._restarting: dict[int, asyncio.Task] = {}

    def lose(self, slot: int, after: int = 0) -> None:
        self.doomed[slot] = after

    async def _run(self, slot: int, command: str, payload: Any) -> Any:
        await _yields(self.yields)
        if slot in self.dead:
            raise WorkerLost(f"fake slot {slot} is down ({command})")
        left = self.doomed.get(slot)
        if left is not None:
            if left == 0:
                del self.doomed[slot]
                self.dead.add(slot)
                raise WorkerLost(f"fake slot {slot} lost ({command})")
            self.doomed[slot] = left - 1
        return self.hosts[slot].handle(command, payload)

    def _recovers(self) -> bool:
        return self.recover

    def _slot_generation(self, slot: int) -> Any:
        return self.generations[slot] if self.parks else None

    async def _recover(self, slot: int, lost: WorkerLost) -> None:
        if not self.recover:
            raise lost
        task = self._restarting.get(slot)
        if task is None or task.done():
            if slot not in self.dead:
                return  # restarted since that call failed
            task = self._restarting[slot] = asyncio.ensure_future(self._restart(slot))
        await asyncio.shield(task)

    async def _restart(self, slot: int) -> None:
        self.restarts += 1
        fresh = FakeSlotHost(self.parks)

        async def run(command: str, payload: Any) -> Any:
            await _yields(self.yields)
            return fresh.handle(command, payload)

        await self.restore_slot(slot, run)
        self.hosts[slot] = fresh  # in place with no await since restore_slot's last check
        self.generations[slot] += 1
        self.dead.discard(slot)
