"""The Ray runtime: rollout replicas and trainers as actors in two placement groups.

The rollout pool and the training pool each reserve their own placement group (one bundle per
worker, sized by `runtime.ray.rollout_bundle` / `train_bundle`), so the two never contend for
the same CPUs or GPUs. The orchestrator is the spine's, unchanged: it sees the same
`RolloutPool` / `TrainPool` protocols as on the local runtime. Weights go trainer -> object
store -> replicas; the driver holds and forwards only the ObjectRef (`RayWeights`).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.api.runtime import (
    NullSink,
    RolloutPool,
    Runtime,
    RuntimeSink,
    SpanSink,
    WorkerError,
    WorkerLost,
    load_latest,
)
from flexmarl.config.schema import VLLM_ON_RAY, RayBundle, RunConfig
from flexmarl.planning.planner import Plan
from flexmarl.policy.model import approx_params
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.backends.openai import OpenAIBackend
from flexmarl.rollout.balancer import Balancer
from flexmarl.runtime.local.workers import WorkerSpec
from flexmarl.runtime.ray.session import RayRuntimeError, RaySession
from flexmarl.runtime.ray.store import RayExperienceStore, RayMicroBatch
from flexmarl.training.host import SlotPool

# The actors' concurrency group for heartbeat pings: its own thread, so a busy actor answers.
HEALTH_GROUP = "health"


@dataclass(frozen=True)
class RayWeights:
    """A policy's weights in the Ray object store: what the orchestrator passes around as
    `Weights` on this runtime (opaque to it), so publication never copies through the driver."""

    ref: Any  # ray.ObjectRef to dict[str, np.ndarray]


def bundle_of(b: RayBundle) -> dict[str, float]:
    out = {"CPU": b.cpus, "GPU": b.gpus, **b.resources}
    return {k: v for k, v in out.items() if v > 0}


def _object_lost(exc: BaseException) -> bool:
    """Whether a call failed because an argument's object is gone (its owner died)."""
    import ray

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.ObjectLostError):
            return True
        cause = getattr(seen, "cause", None)  # RayTaskError wraps the remote exception
        if isinstance(cause, ray.exceptions.ObjectLostError):
            return True
        seen = seen.__cause__
    return False


class ActorLost(WorkerLost):
    """A call failed because its actor died (`ray.exceptions.RayActorError`): which actor, and
    which incarnation of it, so concurrent callers trigger one restart, not one each."""

    def __init__(self, actor: _Actor, generation: int, message: str) -> None:
        super().__init__(message)
        self.actor, self.generation = actor, generation


class _Actor:
    """Driver side of one actor: awaits calls, turns Ray failures into WorkerError (a dead
    actor: ActorLost), forwards the spans each reply carries. A restart swaps `handle`."""

    def __init__(self, pool: str, index: int, handle: Any, sink: SpanSink) -> None:
        self.pool, self.index, self.handle, self.sink = pool, index, handle, sink
        self.where: dict[str, Any] = {}
        self.generation = 0  # incarnation: bumped by each restart
        self.outstanding_tokens = 0
        self.outbox: list[tuple[GenerationRequest, tuple, asyncio.Future]] = []
        self.in_flight = 0  # calls awaiting an answer
        self.last_progress = time.monotonic()  # the last answer, or the first call since idle

    def spans(self, spans: list) -> None:
        for span in spans:
            self.sink.span(self.pool, self.index, *span)

    async def call(self, method: str, *args: Any) -> Any:
        import ray

        handle, generation = self.handle, self.generation
        if not self.in_flight:
            self.last_progress = time.monotonic()
        self.in_flight += 1
        try:
            return await getattr(handle, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise ActorLost(self, generation, f"{self.pool} worker {self.index} lost "
                            f"({method}): {exc}") from exc
        except ray.exceptions.RayError as exc:
            raise WorkerError(f"{self.pool} worker {self.index} ({method}): {exc}") from exc
        finally:
            if generation == self.generation:
                self.in_flight -= 1
                self.last_progress = time.monotonic()


class RayRolloutPool(RolloutPool):
    """Replicas each hosting every local agent's model, behind the same hierarchical balancer
    as the local pool; requests queued in one loop tick for one replica travel as one actor
    call. Agents served by an OpenAI-compatible endpoint (`backend.kind: openai`) bypass the
    replicas: the driver calls the endpoint, as the local runtime does."""

    def __init__(self, actors: list[_Actor], balancer: Balancer,
                 remote: dict[str, OpenAIBackend] | None = None) -> None:
        self.actors = actors  # filled by RayRuntime.start
        self.balancer = balancer
        self.remote = remote or {}
        # The last weights published per agent: what a restarted replica must load.
        self.latest: dict[str, tuple[int, Any]] = {}
        self.supervisor: RaySupervisor | None = None
        self.refetch: Callable[[str], Awaitable[RayWeights]] | None = None

    @property
    def n_workers(self) -> int:
        return len(self.actors)

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        """Dispatch; a request whose replica died goes again once it is restarted (sampling
        is keyed by (seed, sample_id, version): the re-run produces the same tokens)."""
        remote = self.remote.get(request.agent)
        if remote is not None:
            return await remote.generate(request)
        while True:
            try:
                return await self._dispatch(request, priority)
            except ActorLost as lost:
                if self.supervisor is None:
                    raise
                await self.supervisor.recover(lost)

    async def _dispatch(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        cost = self.balancer.expected_cost(request.agent, len(request.prompt),
                                           request.max_new_tokens)
        index = self.balancer.pick(request.agent, [a.outstanding_tokens for a in self.actors])
        actor = self.actors[index]
        actor.outstanding_tokens += cost
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not actor.outbox:
            loop.call_soon(self._flush, actor)
        actor.outbox.append((request, priority, fut))
        submitted = time.time()
        try:
            result = await fut
        finally:
            actor.outstanding_tokens -= cost
        result.queue_s = max(0.0, result.admitted_at - submitted)
        self.balancer.observe(request.agent, len(result.tokens))
        return result

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any]:
        """Re-plan agents onto replicas from iteration k's measured demand."""
        return self.balancer.replan(k + 1, self.balancer.demand_from(stats)).to_dict()

    def follow_plan(self, plan: Plan) -> None:
        """The planner's replicas per agent (critical path), over the demand plan: every
        replica hosts every local agent's model, so any may serve any agent."""
        self.balancer.follow(plan.iteration, plan.replica_indices())

    def _flush(self, actor: _Actor) -> None:
        batch, actor.outbox = actor.outbox, []
        if batch:
            asyncio.ensure_future(self._send(actor, batch))

    async def _send(self, actor: _Actor, batch: list) -> None:
        try:
            replies, spans = await actor.call("generate", [(r, p) for r, p, _ in batch])
        except WorkerError as exc:
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        actor.spans(spans)
        for (_, _, fut), (ok, result) in zip(batch, replies, strict=True):
            if fut.done():
                continue
            if ok:
                fut.set_result(result)
            else:
                fut.set_exception(WorkerError(f"rollout worker {actor.index}: {result}"))

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        """Every replica loads `version`. Weights are objects of the trainer that made them: if
        it died before the replicas fetched them, they are taken again from its restored
        successor (`refetch`, the train pool's `weights`: the same version) and loaded."""
        import ray

        if agent in self.remote:
            raise WorkerError(f"agent {agent!r} is served by an external endpoint: its weights "
                              "cannot be published")
        ref = weights.ref if isinstance(weights, RayWeights) else ray.put(weights)
        while True:
            self.latest[agent] = (version, ref)
            # A top-level ObjectRef argument: each replica fetches it from the object store.
            replies = await asyncio.gather(
                *(a.call("load_weights", agent, version, ref) for a in self.actors),
                return_exceptions=True,
            )
            lost_object = False
            for actor, reply in zip(self.actors, replies, strict=True):
                if isinstance(reply, ActorLost) and self.supervisor is not None:
                    continue  # its restart loads `latest`
                if isinstance(reply, BaseException):
                    if self.refetch is not None and _object_lost(reply):
                        lost_object = True
                        continue
                    raise reply
                actor.spans(reply[1])
            if not lost_object:
                return
            assert self.refetch is not None
            if self.supervisor is not None:
                self.supervisor._event("weights_refetched", agent=agent, version=version)
            ref = (await self.refetch(agent)).ref
            if self.latest[agent][0] == version:  # a restart may have refreshed it already
                self.latest[agent] = (version, ref)


class RayTrainPool(SlotPool):
    """Training slots as actors (`TrainWorker`, each a `TrainHost`), bound to agents on demand
    by the shared `SlotPool` as on the local runtime: fewer slots than agents time-share them,
    sticky leases, swapped states through the object store (owned by the agent's table actor).

    With a supervisor, the recovery journal as on the local runtime: each agent's restart point
    (its full state after its last step, put into the object store by the trainer and owned by
    the agent's table actor, so it never travels through the driver) and the micro-batches
    accumulated since, so a restarted actor resumes exactly there: no row lost, none counted
    twice in a gradient."""

    def __init__(self, actors: list[_Actor], n_slots: int) -> None:
        super().__init__(n_slots)
        self.actors = actors  # filled by RayRuntime.start
        self.supervisor: RaySupervisor | None = None

    async def _run(self, slot: int, command: str, payload: Any) -> Any:
        return await self.run_on(self.actors[slot], command, payload)

    @staticmethod
    async def run_on(actor: _Actor, command: str, payload: Any) -> Any:
        """One command of the slot protocol as an actor call (a tuple payload: its arguments,
        so an ObjectRef among them is resolved by Ray); the reply's spans go to telemetry."""
        args = payload if isinstance(payload, tuple) else (payload,)
        result, spans = await actor.call(command, *args)
        actor.spans(spans)
        return result

    def _recovers(self) -> bool:
        return self.supervisor is not None

    async def _recover(self, slot: int, lost: WorkerLost) -> None:
        if self.supervisor is None or not isinstance(lost, ActorLost):
            raise lost
        await self.supervisor.recover(lost)

    def _accumulate_command(self, agent: str, batch: Any, replay: bool) -> tuple[str, Any]:
        """A `RayMicroBatch` is pulled by the trainer actor from the agent's table actor (the
        driver sends ids, not rows; `replay`: its lost predecessor may have taken them); a
        list of samples travels by value."""
        if isinstance(batch, RayMicroBatch):
            return ("accumulate_from_table", (
                agent, batch.table, batch.version, len(batch), batch.step, batch.expected_vector,
                list(batch.sample_ids), replay, None if replay else batch.after))
        return ("accumulate", (agent, batch))

    def _keep_command(self, agent: str) -> tuple[str, Any]:
        return ("restart_point", agent)

    def _restore_command(self, agent: str, saved: Any) -> tuple[str, Any]:
        (ref,) = saved  # top level: the actor gets the state, never the driver
        return ("restore_point", (agent, ref))

    async def step(self, agent: str) -> tuple[dict[str, float], RayWeights]:
        metrics, (ref,) = await super().step(agent)
        return metrics, RayWeights(ref)

    async def weights(self, agent: str) -> RayWeights:
        (ref,) = await self._call(agent, "weights", agent)
        return RayWeights(ref)

    async def save(self, agent: str, directory: str) -> str:
        files = await self._call(agent, "save", agent)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / name).write_bytes(data)
        return str(out)


class RaySupervisor:
    """Liveness and recovery of the Ray runtime's actors: restarts a dead or hung actor in its
    own placement-group bundle and restores it, up to `runtime.max_worker_restarts` restarts
    per run (then the run fails, naming the actor).

    Liveness: every `runtime.heartbeat_interval_s` the driver pings each actor (its `where`,
    in a concurrency group of its own, so a long step or generation still answers); one that
    leaves a ping unanswered for `runtime.heartbeat_misses` intervals (a frozen or stuck
    process) is killed and recovered like a dead one, as the local runtime's heartbeats do.

    Ray reports a death (`RayActorError`) to every call in flight and to the ping; the first
    to see it starts the restart, the others wait for it. A rollout replica reloads every
    agent's latest weights (its requests are then re-sent); a trainer gets each of its agents'
    restart point and replays the micro-batches accumulated since. Each failure and recovery
    is a `worker_failed` / `worker_recovered` event in metrics.jsonl and the trace. An actor
    Ray reports unavailable (`ActorUnavailableError`, a `RayActorError`) is replaced the same
    way: its state can be restored exactly, so killing it is safe.
    """

    def __init__(self, runtime: RayRuntime) -> None:
        self.rt = runtime
        rt = runtime.cfg.runtime
        self.max_restarts = rt.max_worker_restarts
        self.interval, self.misses = rt.heartbeat_interval_s, rt.heartbeat_misses
        self.restarts = 0
        self.failures: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self._tasks: dict[tuple[str, int], tuple[int, asyncio.Future]] = {}
        self._monitor: asyncio.Task | None = None
        # per actor: (generation pinged, monotonic time of its last answer, ping in flight)
        self._beats: dict[tuple[str, int], tuple[int, float, asyncio.Future | None]] = {}

    def _event(self, name: str, **fields: Any) -> None:
        self.rt.sink.fault(name, **fields)

    def start(self) -> None:
        """Start the heartbeat monitor (the actors are up and answered `where`)."""
        self._monitor = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        """Stop watching before the actors are killed on purpose."""
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        for _, _, ping in self._beats.values():
            if ping is not None:
                ping.cancel()
        self._beats.clear()

    async def _watch(self) -> None:
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            # a tick this late means the driver's loop was blocked: answers may wait unread
            stalled, last_tick = now - last_tick > 2 * self.interval, now
            for actor in self.rt.rollout_actors + self.rt.train_actors:
                self._check(actor, now, stalled)

    def _check(self, actor: _Actor, now: float, stalled: bool = False) -> None:
        """Ping `actor` unless a ping is in flight; declare it hung if that ping is older
        than `heartbeat_misses` intervals (after a stall of the driver: another chance)."""
        key = (actor.pool, actor.index)
        entry = self._tasks.get(key)
        if entry is not None and entry[0] == actor.generation:
            return  # being restarted, or its restarts are used up (callers get the error)
        beat = self._beats.get(key)
        if beat is None or beat[0] != actor.generation:  # a new incarnation: a fresh start
            beat = (actor.generation, now, None)
        generation, last, ping = beat
        if stalled:
            last = now
        stuck = self.rt.cfg.runtime.progress_timeout_s
        if ping is not None and not ping.done() and now - last > self.interval * self.misses:
            self._kill_hung(actor)
            self._begin(actor, generation, f"missed {self.misses} heartbeats "
                        f"({now - last:.1f} s without an answer to a ping)")
        elif (stuck is not None and actor.in_flight and not stalled
              and now - actor.last_progress > stuck):
            # it answers pings (its health thread) but none of its calls: a stuck compute
            self._kill_hung(actor)
            self._begin(actor, generation, f"no progress: {actor.in_flight} calls unanswered "
                        f"for {now - actor.last_progress:.1f} s while it answers pings "
                        f"(runtime.progress_timeout_s={stuck:g})")
        elif ping is None or ping.done():
            ping = asyncio.ensure_future(self._ping(actor, generation))
        self._beats[key] = (generation, last, ping)

    async def _ping(self, actor: _Actor, generation: int) -> None:
        import ray

        try:
            await actor.handle.where.options(concurrency_group=HEALTH_GROUP).remote()
        except ray.exceptions.RayActorError as exc:  # dead: recover now, as locally
            self._begin(actor, generation, f"{actor.pool} worker {actor.index} lost "
                        f"(heartbeat): {exc}")
            return
        except ray.exceptions.RayError:
            return
        key = (actor.pool, actor.index)
        beat = self._beats.get(key)
        if beat is not None and beat[0] == generation == actor.generation:
            self._beats[key] = (generation, time.monotonic(), beat[2])

    @staticmethod
    def _kill_hung(actor: _Actor) -> None:
        """SIGKILL a hung actor's process when it runs on the driver's node, so its calls in
        flight fail now; elsewhere Ray's own kill in `_restart` ends it (a frozen process
        takes Ray a few seconds)."""
        import ray

        pid, node = actor.where.get("pid"), actor.where.get("node_id")
        if not pid or node != ray.get_runtime_context().get_node_id():
            return
        try:  # the pid is still a Ray worker (not reused since `where` reported it)
            if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
                return
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass

    def _begin(self, actor: _Actor, generation: int, reason: str) -> asyncio.Future | None:
        """Start restarting `actor` once per incarnation; the restart's future (None: that
        incarnation was already replaced)."""
        if actor.generation != generation:
            return None
        key = (actor.pool, actor.index)
        entry = self._tasks.get(key)
        if entry is None or entry[0] != generation:
            info = {"pool": actor.pool, "worker": actor.index, "pid": actor.where.get("pid"),
                    "reason": reason[:300]}
            self.failures.append(info)
            self._event("worker_failed", **info)
            task = asyncio.ensure_future(self._restart(actor))
            # a failed restart is raised to the callers that wait for it, not logged here
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            entry = (generation, task)
            self._tasks[key] = entry
        return entry[1]

    async def recover(self, lost: ActorLost) -> None:
        """Return once `lost.actor` runs again (restarted by this call or a concurrent one)."""
        restart = self._begin(lost.actor, lost.generation, str(lost.__cause__ or lost))
        if restart is not None:
            await asyncio.shield(restart)

    async def _restart(self, actor: _Actor) -> None:
        import ray

        died_at = time.monotonic()
        try:
            ray.kill(actor.handle, no_restart=True)  # already dead: frees nothing twice
        except Exception:  # noqa: BLE001
            pass
        while True:
            if self.restarts >= self.max_restarts:
                reason = (f"{actor.pool} worker {actor.index} lost and "
                          f"runtime.max_worker_restarts={self.max_restarts} restarts are used up")
                self._event("worker_unrecoverable", pool=actor.pool, worker=actor.index,
                            reason=reason)
                raise WorkerError(reason)
            self.restarts += 1
            handle = self.rt.new_actor(actor.pool, actor.index)
            fresh = _Actor(actor.pool, actor.index, handle, actor.sink)
            try:
                fresh.where = await fresh.call("where")
                if actor.pool == "rollout":
                    await self._load_latest(fresh)
                else:
                    await self._restore_trainers(fresh)
            except ActorLost:
                continue
            # Swap the incarnation in place: the pools hold the same _Actor objects.
            actor.handle, actor.where = fresh.handle, fresh.where
            actor.generation += 1
            # calls of the old incarnation no longer count (they fail with ActorLost)
            actor.in_flight, actor.last_progress = 0, time.monotonic()
            info = {"pool": actor.pool, "worker": actor.index, "pid": actor.where.get("pid"),
                    "recovery_s": time.monotonic() - died_at, "restarts": self.restarts}
            self.recoveries.append(info)
            self._event("worker_recovered", **info)
            return

    async def _load_latest(self, fresh: _Actor) -> None:
        async def load(agent: str, version: int, ref: Any) -> None:
            _, spans = await fresh.call("load_weights", agent, version, ref)
            fresh.spans(spans)

        await load_latest(self.rt.rollout.latest, load)

    async def _restore_trainers(self, fresh: _Actor) -> None:
        pool = self.rt.train

        async def run(command: str, payload: Any) -> Any:
            return await pool.run_on(fresh, command, payload)

        versions = await pool.restore_slot(fresh.index, run)
        for agent, version in versions.items():
            # The published weights were the lost actor's objects: the restored trainer holds
            # the same weights (its state after the step that made them), so they are put again.
            latest = self.rt.rollout.latest.get(agent)
            if latest is not None and latest[0] == version:
                (ref,) = await run("weights", agent)
                self.rt.rollout.latest[agent] = (latest[0], ref)


class RayRuntime(Runtime):
    def __init__(
        self, cfg: RunConfig, vocab_size: int, max_seq_len: int, sink: RuntimeSink | None = None
    ) -> None:
        self.cfg = cfg
        self.sink: RuntimeSink = sink or NullSink()
        rt = cfg.runtime
        self.config = cfg.model_dump(mode="json")
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.agents = list(cfg.agents)
        for agent in self.agents:
            if cfg.agents[agent].backend.kind == "vllm":  # also refused by the config schema
                raise RayRuntimeError(VLLM_ON_RAY.format(agent=agent))
        # agents served by an external endpoint need no model in the replicas
        self.local_agents = [a for a in self.agents if cfg.agents[a].backend.kind != "openai"]
        trainable = [a for a in self.agents if cfg.agents[a].trainable]
        self.trainable = trainable
        self.n_train = max(1, min(rt.train_workers, len(trainable)))
        self.bundles = {
            "rollout": bundle_of(rt.ray.rollout_bundle),
            "train": bundle_of(rt.ray.train_bundle),
        }
        self.sizes = {"rollout": rt.rollout_workers, "train": self.n_train}
        custom: dict[str, float] = {}
        for pool, bundle in self.bundles.items():
            for name, amount in bundle.items():
                if name not in ("CPU", "GPU"):
                    custom[name] = custom.get(name, 0.0) + amount * self.sizes[pool]
        needed_cpus = sum(self.bundles[p].get("CPU", 0.0) * n for p, n in self.sizes.items())
        self.session = RaySession(
            rt.address, rt.ray.num_cpus or None, rt.ray.temp_dir, custom,
        )
        if rt.address is None and rt.ray.num_cpus is None:
            import os

            self.session.num_cpus = max(os.cpu_count() or 1, math.ceil(needed_cpus))
        self.groups: dict[str, Any] = {}
        self.rollout_actors: list[_Actor] = []
        self.train_actors: list[_Actor] = []
        self.tables: dict[str, Any] = {}  # agent -> its AgentTableActor handle
        self.table_where: dict[str, dict[str, Any]] = {}
        self.store: RayExperienceStore | None = None  # made by make_store, for the run
        costs = {a: float(approx_params(cfg.agents[a].model, vocab_size))
                 for a in self.local_agents}
        remote = {a: OpenAIBackend(a, cfg.agents[a].backend)
                  for a in self.agents if cfg.agents[a].backend.kind == "openai"}
        self.rollout = RayRolloutPool(
            self.rollout_actors,
            Balancer(self.local_agents or self.agents, rt.rollout_workers, cfg.rollout.balance,
                     costs),
            remote)
        self.train = RayTrainPool(self.train_actors, self.n_train)
        self.supervisor = RaySupervisor(self) if rt.max_worker_restarts > 0 else None
        self.rollout.supervisor = self.train.supervisor = self.supervisor
        if self.supervisor is not None:
            self.rollout.refetch = self.train.weights

    def _spec(self, names: list[str], pool: str) -> WorkerSpec:
        """A worker whose bundle asks for GPUs computes on them (Ray sets the actor's
        CUDA_VISIBLE_DEVICES), unless runtime.devices is cpu."""
        from flexmarl.policy.device import Placement

        rt = self.cfg.runtime
        gpus = self.bundles[pool].get("GPU", 0.0)
        placement = Placement("cuda") if gpus > 0 and rt.devices != "cpu" else Placement()
        return WorkerSpec(self.config, self.vocab_size, self.max_seq_len, names,
                          rt.torch_threads, rt.deterministic, self.cfg.rollout.max_batch_seqs,
                          placement=placement)

    async def _group(self, pool: str) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        bundles = [dict(self.bundles[pool]) for _ in range(self.sizes[pool])]
        pg = placement_group(bundles, strategy=self.cfg.runtime.ray.strategy,
                             name=f"flexmarl-{self.cfg.name}-{pool}")
        self.groups[pool] = pg
        timeout = self.cfg.runtime.ray.placement_timeout_s
        ready = await asyncio.to_thread(pg.wait, timeout)
        if not ready:
            raise RayRuntimeError(
                f"runtime.ray.{pool}_bundle: the {pool} pool's placement group "
                f"({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f} s; "
                f"cluster has {ray.available_resources()} available"
            )
        return pg

    def _actor_options(self, pool: str, pg: Any, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[pool]
        return {
            "num_cpus": bundle.get("CPU", 0.0),
            "num_gpus": bundle.get("GPU", 0.0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index),
            "max_restarts": 0,
        }

    def new_actor(self, pool: str, index: int) -> Any:
        """Create worker `index` of `pool` in its placement-group bundle (also on a restart)."""
        import ray

        from flexmarl.runtime.ray.actors import RolloutReplica, TrainWorker

        options = self._actor_options(pool, self.groups[pool], index)
        # heartbeat pings run in a concurrency group (thread) of their own: a busy actor answers
        make_remote: Any = ray.remote  # its typed overloads omit `concurrency_groups`
        remote = make_remote(concurrency_groups={HEALTH_GROUP: 1})
        if pool == "rollout":
            return remote(RolloutReplica).options(**options).remote(
                self._spec(self.local_agents, pool), self.tables)
        # a training slot may host any trainable agent (the pool binds them on demand); when
        # they time-share slots, an agent's weights may outlive the slot that stepped it
        return remote(TrainWorker).options(**options).remote(
            self._spec(self.trainable, pool), {a: self.tables[a] for a in self.trainable},
            self.n_train < len(self.trainable))

    def make_store(self) -> RayExperienceStore:
        """The run's experience store: the driver's facade over the per-agent table actors."""
        if not self.tables:
            raise RayRuntimeError("the Ray runtime's store exists once the runtime is started")
        self.store = RayExperienceStore(self.tables)
        return self.store

    async def start(self) -> None:
        import ray

        from flexmarl.runtime.ray.store import AgentTableActor

        self.session.start()
        try:
            # One table actor per agent: light (numpy only, no CPU reserved), so Ray may
            # place it on any node; it owns the agent's payloads and published weights.
            table_cls = ray.remote(AgentTableActor)
            for agent in self.agents:
                self.tables[agent] = table_cls.options(num_cpus=0, max_restarts=0).remote(agent)
            await self._group("rollout")
            await self._group("train")
            for i in range(self.sizes["rollout"]):
                self.rollout_actors.append(
                    _Actor("rollout", i, self.new_actor("rollout", i), self.sink))
            for i in range(self.n_train):
                self.train_actors.append(_Actor("train", i, self.new_actor("train", i), self.sink))
            actors = self.rollout_actors + self.train_actors
            places = await asyncio.gather(*(a.call("where") for a in actors))
            for actor, place in zip(actors, places, strict=True):
                actor.where = place
            tables = await asyncio.gather(*(t.where.remote() for t in self.tables.values()))
            self.table_where = dict(zip(self.tables, tables, strict=True))
            if self.supervisor is not None:  # restart points: the trainers' states now
                for agent in self.trainable:
                    await self.train.keep_restart_point(agent)
                self.supervisor.start()
        except BaseException:
            await self.stop()
            raise
        self._report()

    def _report(self) -> None:
        """Which actor runs where: stderr (the run log), metrics.jsonl and the run's run.log."""
        placement = self.placement()
        lines = [f"ray: cluster {placement['ray']['address']} "
                 f"({'started for this run' if placement['ray']['started_cluster'] else 'existing'})"]
        for pool in ("rollout", "train"):
            for w in placement[pool]:
                agents = f" agents={','.join(w['agents'])}" if "agents" in w else ""
                lines.append(f"ray: {pool}[{w['worker']}] actor {w['actor_id'][:12]} on node "
                             f"{w['node_id'][:12]} ({w['ip']}) pid {w['pid']} "
                             f"bundle {w['bundle']}{agents}")
        for agent, w in placement["tables"].items():
            lines.append(f"ray: table[{agent}] actor {w['actor_id'][:12]} on node "
                         f"{w['node_id'][:12]} ({w['ip']}) pid {w['pid']}")
        for agent, url in placement["endpoints"].items():
            lines.append(f"ray: agent {agent} served by the endpoint {url} (called by the driver)")
        print("\n".join(lines), file=sys.stderr, flush=True)
        self.sink.log({"event": "placement", "runtime": "ray", **placement})
        if self.sink.out_dir is not None:
            with (Path(self.sink.out_dir) / "run.log").open("a") as fh:
                fh.write("\n".join(lines) + "\n")

    async def stop(self) -> None:
        import ray

        if self.supervisor is not None:  # before the actors are killed on purpose
            await self.supervisor.stop()
        for backend in self.rollout.remote.values():
            backend.close()
        if ray.is_initialized():
            handles = [a.handle for a in self.rollout_actors + self.train_actors]
            for handle in [*handles, *self.tables.values()]:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            from ray.util.placement_group import remove_placement_group

            for pg in self.groups.values():
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
        self.groups.clear()
        self.rollout_actors.clear()
        self.train_actors.clear()
        self.tables.clear()
        self.session.stop()

    def fault_counts(self) -> dict[str, Any] | None:
        if self.supervisor is None:
            return None
        return {"failures": self.supervisor.failures, "recoveries": self.supervisor.recoveries}

    def placement(self) -> dict[str, Any]:
        def pool(name: str, actors: list[_Actor]) -> list[dict[str, Any]]:
            out = []
            for a in actors:
                entry = {"worker": a.index, "bundle": a.index, "resources": self.bundles[name],
                         "placement_group": self.groups[name].id.hex()
                         if name in self.groups else None, **a.where}
                if name == "train":  # resident now (the pool binds agents on demand)
                    entry["agents"] = [g for g, i in self.train.binding.items()
                                       if i == a.index]
                out.append(entry)
            return out

        return {
            "ray": self.session.info(),
            "rollout": pool("rollout", self.rollout_actors),
            "train": pool("train", self.train_actors),
            "tables": {a: dict(w) for a, w in self.table_where.items()},
            # agents with backend.kind openai: no replica hosts them
            "endpoints": {a: b.url for a, b in self.rollout.remote.items()},
            "train_swaps": self.train.allocator.swaps,
            "train_swaps_in": dict(self.train.swaps_in),
            "train_swap_s": self.train.swap_seconds,
        }
