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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl.config.schema import RayBundle, RunConfig
from flexmarl.policy.model import approx_params
from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.balancer import Balancer
from flexmarl.runtime.base import SpanSink, WorkerError
from flexmarl.runtime.local.workers import WorkerSpec
from flexmarl.runtime.ray.session import RayRuntimeError, RaySession
from flexmarl.training.trainer import Sample


@dataclass(frozen=True)
class RayWeights:
    """A policy's weights in the Ray object store: what the orchestrator passes around as
    `Weights` on this runtime (opaque to it), so publication never copies through the driver."""

    ref: Any  # ray.ObjectRef to dict[str, np.ndarray]


class _NullSink:
    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        pass


def bundle_of(b: RayBundle) -> dict[str, float]:
    out = {"CPU": b.cpus, "GPU": b.gpus, **b.resources}
    return {k: v for k, v in out.items() if v > 0}


class _Actor:
    """Driver side of one actor: awaits calls, turns Ray failures into WorkerError, forwards
    the spans each reply carries."""

    def __init__(self, pool: str, index: int, handle: Any, sink: SpanSink) -> None:
        self.pool, self.index, self.handle, self.sink = pool, index, handle, sink
        self.where: dict[str, Any] = {}
        self.outstanding_tokens = 0
        self.outbox: list[tuple[GenerationRequest, tuple, asyncio.Future]] = []

    def spans(self, spans: list) -> None:
        for span in spans:
            self.sink.span(self.pool, self.index, *span)

    async def call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayError as exc:
            raise WorkerError(f"{self.pool} worker {self.index} ({method}): {exc}") from exc


class RayRolloutPool:
    """Replicas each hosting every agent's model, behind the same hierarchical balancer as the
    local pool; requests queued in one loop tick for one replica travel as one actor call."""

    def __init__(self, actors: list[_Actor], balancer: Balancer) -> None:
        self.actors = actors  # filled by RayRuntime.start
        self.balancer = balancer

    @property
    def n_workers(self) -> int:
        return len(self.actors)

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
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
        import ray

        ref = weights.ref if isinstance(weights, RayWeights) else ray.put(weights)
        # A top-level ObjectRef argument: each replica fetches it from the object store.
        replies = await asyncio.gather(
            *(a.call("load_weights", agent, version, ref) for a in self.actors)
        )
        for actor, (_, spans) in zip(self.actors, replies, strict=True):
            actor.spans(spans)


class RayTrainPool:
    """Training actors; each trainable agent is bound to one of them (round robin)."""

    def __init__(self, actors: list[_Actor], binding: dict[str, int]) -> None:
        self.actors = actors  # filled by RayRuntime.start
        self.binding = binding

    @property
    def n_workers(self) -> int:
        return len(self.actors)

    def _actor(self, agent: str) -> _Actor:
        return self.actors[self.binding[agent]]

    async def accumulate(self, agent: str, samples: list[Sample]) -> dict[str, float]:
        actor = self._actor(agent)
        result, spans = await actor.call("accumulate", agent, samples)
        actor.spans(spans)
        return result

    async def step(self, agent: str) -> tuple[dict[str, float], RayWeights]:
        actor = self._actor(agent)
        metrics, (ref,), spans = await actor.call("step", agent)
        actor.spans(spans)
        return metrics, RayWeights(ref)

    async def weights(self, agent: str) -> RayWeights:
        actor = self._actor(agent)
        (ref,), spans = await actor.call("weights", agent)
        actor.spans(spans)
        return RayWeights(ref)

    async def save(self, agent: str, directory: str) -> str:
        actor = self._actor(agent)
        files, spans = await actor.call("save", agent)
        actor.spans(spans)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / name).write_bytes(data)
        return str(out)


class RayRuntime:
    def __init__(
        self, cfg: RunConfig, vocab_size: int, max_seq_len: int, sink: SpanSink | None = None
    ) -> None:
        self.cfg = cfg
        self.sink = sink or _NullSink()
        rt = cfg.runtime
        self.config = cfg.model_dump(mode="json")
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.agents = list(cfg.agents)
        trainable = [a for a in self.agents if cfg.agents[a].trainable]
        self.n_train = max(1, min(rt.train_workers, len(trainable)))
        self.binding = {a: i % self.n_train for i, a in enumerate(trainable)}
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
        costs = {a: float(approx_params(cfg.agents[a].model, vocab_size)) for a in self.agents}
        self.rollout = RayRolloutPool(
            self.rollout_actors,
            Balancer(self.agents, rt.rollout_workers, cfg.rollout.balance, costs))
        self.train = RayTrainPool(self.train_actors, self.binding)

    def _spec(self, names: list[str]) -> WorkerSpec:
        rt = self.cfg.runtime
        return WorkerSpec(self.config, self.vocab_size, self.max_seq_len, names,
                          rt.torch_threads, rt.deterministic, self.cfg.rollout.max_batch_seqs)

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

    async def start(self) -> None:
        import ray

        from flexmarl.runtime.ray.actors import RolloutReplica, TrainWorker

        self.session.start()
        try:
            rollout_pg = await self._group("rollout")
            train_pg = await self._group("train")
            replica_cls = ray.remote(RolloutReplica)
            train_cls = ray.remote(TrainWorker)
            for i in range(self.sizes["rollout"]):
                handle = replica_cls.options(**self._actor_options("rollout", rollout_pg, i)
                                             ).remote(self._spec(self.agents))
                self.rollout_actors.append(_Actor("rollout", i, handle, self.sink))
            for i in range(self.n_train):
                names = [a for a, j in self.binding.items() if j == i]
                handle = train_cls.options(**self._actor_options("train", train_pg, i)
                                           ).remote(self._spec(names))
                self.train_actors.append(_Actor("train", i, handle, self.sink))
            actors = self.rollout_actors + self.train_actors
            places = await asyncio.gather(*(a.call("where") for a in actors))
            for actor, place in zip(actors, places, strict=True):
                actor.where = place
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
        print("\n".join(lines), file=sys.stderr, flush=True)
        log = getattr(self.sink, "log", None)
        if log is not None:
            log({"event": "placement", "runtime": "ray", **placement})
        out_dir = getattr(self.sink, "out_dir", None)
        if out_dir is not None:
            with (Path(out_dir) / "run.log").open("a") as fh:
                fh.write("\n".join(lines) + "\n")

    async def stop(self) -> None:
        import ray

        if ray.is_initialized():
            for actor in self.rollout_actors + self.train_actors:
                try:
                    ray.kill(actor.handle, no_restart=True)
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
        self.session.stop()

    def placement(self) -> dict[str, Any]:
        def pool(name: str, actors: list[_Actor]) -> list[dict[str, Any]]:
            out = []
            for a in actors:
                entry = {"worker": a.index, "bundle": a.index, "resources": self.bundles[name],
                         "placement_group": self.groups[name].id.hex()
                         if name in self.groups else None, **a.where}
                if name == "train":
                    entry["agents"] = [g for g, i in self.binding.items() if i == a.index]
                out.append(entry)
            return out

        return {
            "ray": self.session.info(),
            "rollout": pool("rollout", self.rollout_actors),
            "train": pool("train", self.train_actors),
        }
