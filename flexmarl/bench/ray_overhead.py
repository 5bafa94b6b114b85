"""Orchestration overhead of the Ray runtime vs the local one, same config, one invocation.

Two figures per runtime, medians over repeated rounds after a warm-up:
- per micro-batch handed from store to trainer: the driver's wall time for taking a
  micro-batch from the experience store and having the trainer accumulate it, minus the
  trainer's own compute span (so what is left is hand-off: store, serialisation, transport:
  a pipe locally, the actor's pipe through Ray on Ray, `runtime.ray.transport`);
- per weight publication of a ~4M-parameter model: trainer -> every rollout replica loaded.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl.api.runtime import NullSink
from flexmarl.config.schema import RunConfig, load_config
from flexmarl.policy.model import build_model
from flexmarl.runtime.local.runtime import LocalRuntime
from flexmarl.runtime.ray.runtime import RayRuntime
from flexmarl.store.experience import ExperienceStore, Row
from flexmarl.tasks.referential import build_referential_game

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "referential_game.yaml"
BIG = ["agents.speaker.model.hidden_size=256", "agents.speaker.model.intermediate_size=1024",
       "agents.speaker.model.num_layers=4", "agents.speaker.model.num_heads=4"]


class SpanLog(NullSink):
    """The runtime's spans, kept; its other reports dropped."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, int, float, float, str]] = []

    def span(self, pool: str, worker: int, start: float, end: float, label: str) -> None:
        self.spans.append((pool, worker, start, end, label))

    def last(self, prefix: str) -> float:
        for _, _, start, end, label in reversed(self.spans):
            if label.startswith(prefix):
                return end - start
        raise KeyError(prefix)


def _fill(store: ExperienceStore, agent: str, tag: str, rows: int) -> list[str]:
    """`rows` ready rows, as a rollout replica's generation batch leaves them."""
    payloads: list[Any] = [np.array([-2.0], dtype=np.float32)] * rows
    ids = []
    for j in range(rows):
        sid = f"{tag}-{j}_0_0"
        store.add(Row(sample_id=sid, agent=agent, node="speak", input_id=f"{tag}-{j}", turn=0,
                      trajectory_id=0, iteration=0, policy_version=0,
                      version_vector={"speaker": 0, "listener": 0}))
        store.set_generated(agent, sid, {"prompt": [3, 4, 5, 6], "response": [7],
                                         "allowed": None, "temperature": 1.0},
                            {"logprobs": payloads[j]})
        store.set_rewarded(agent, sid, 1.0)
        store.set_ready(agent, sid, 0.5)
        ids.append(sid)
    return ids


async def _handoff(runtime: Any, store: ExperienceStore, log: SpanLog, agent: str, tag: str,
                   rounds: int, mb: int) -> float:
    """Median ms: take a micro-batch, the trainer accumulates it, minus its compute span."""
    overhead = []
    for k in range(rounds + 1):  # round 0 is warm-up
        ids = _fill(store, agent, f"{tag}{k}", mb)
        await asyncio.sleep(0)  # a loop tick: the writes go out, as during a run
        t0 = time.perf_counter()
        rows = store.take_ready(agent, 0, mb, step=0, sample_ids=ids)
        await runtime.train.accumulate(agent, store.micro_batch(agent, rows))
        wall = time.perf_counter() - t0
        store.release(rows)
        if k:
            overhead.append((wall - log.last("acc:")) * 1e3)
    return statistics.median(overhead)


def n_params(cfg: RunConfig, agent: str, vocab: int, seq: int) -> int:
    model = build_model(agent, cfg.agents[agent].model, vocab, seq, cfg.seed)
    return sum(p.numel() for p in model.parameters())


async def _measure(cfg: RunConfig, runtime: Any, log: SpanLog, rounds: int,
                   mb: int) -> dict[str, float]:
    await runtime.start()
    try:
        agent = "speaker"
        store = ExperienceStore(list(cfg.agents))  # the driver's, on both runtimes
        out = {"handoff_ms": await _handoff(runtime, store, log, agent, "d",
                                            rounds, mb)}
        publish = []
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            weights = await runtime.train.weights(agent)
            await runtime.rollout.publish(agent, 0, weights)
            if k:
                publish.append((time.perf_counter() - t0) * 1e3)
        out["publish_ms"] = statistics.median(publish)
        return out
    finally:
        await runtime.stop()


def bench_ray_overhead(rounds: int = 20, micro_batch: int = 64,
                       address: str | None = None) -> dict[str, dict[str, float]]:
    overrides = [*BIG, "runtime.kind=ray"]
    if address:
        overrides.append(f"runtime.address={address}")
    cfg = load_config(EXAMPLE, overrides)
    task = build_referential_game(**cfg.task_config.options)
    params = n_params(cfg, "speaker", task.vocab_size, task.max_seq_len)
    results = {}
    for name, cls in (("local", LocalRuntime), ("ray", RayRuntime)):
        log = SpanLog()
        runtime = cls(cfg, task.vocab_size, task.max_seq_len, log)
        results[name] = asyncio.run(_measure(cfg, runtime, log, rounds, micro_batch))
    print(f"ray_overhead: {rounds} rounds after warm-up, micro-batch {micro_batch} rows, "
          f"weights {params / 1e6:.2f}M params ({params * 4 / 2**20:.1f} MiB fp32), 1 replica")
    print(f"{'figure (median ms)':<46}{'local':>9}{'ray':>9}{'ray/local':>11}{'target':>9}")
    lo, ra = results["local"], results["ray"]
    print(f"{'micro-batch store -> trainer':<46}{lo['handoff_ms']:>9.2f}"
          f"{ra['handoff_ms']:>9.2f}{ra['handoff_ms'] / lo['handoff_ms']:>11.2f}{'<= 10':>9}")
    print(f"{'weight publication trainer -> replicas':<46}{lo['publish_ms']:>9.2f}"
          f"{ra['publish_ms']:>9.2f}{ra['publish_ms'] / lo['publish_ms']:>11.2f}{'<= 100':>9}")
    return results
