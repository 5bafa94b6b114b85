"""Per-iteration records (the fixed metric names of docs/training.md) and the failure budget.

The joint orchestrator calls `IterationMetrics.record` once per finished iteration; what it
reads (iteration state, trace spans, versions, rows consumed) is passed in, so the record
is a function of the run's state, not of which runtime or schedule produced it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from flexmarl.api.runtime import RolloutPool, TrainPool
from flexmarl.config.schema import RunConfig
from flexmarl.orchestrator.episodes import IterationState
from flexmarl.telemetry.recorder import Telemetry
from flexmarl.training.algorithms.grpo import reward_stats


class FailureBudgetExceeded(RuntimeError):
    """Episodes failed beyond `train.max_failed_fraction` in more consecutive iterations than
    `train.max_consecutive_failed_iterations` allows: the run stops (exit code 1), with
    the first error."""

    def __init__(self, message: str, first_error: str | None) -> None:
        super().__init__(message)
        self.first_error = first_error


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else 0.0


class IterationMetrics:
    """Builds iteration records from the trace (`common`: every run's) and, for a task run's
    iterations (`record`), the iteration state, the versions and the training audit."""

    def __init__(self, telemetry: Telemetry, rollout: RolloutPool, train: TrainPool,
                 agents: list[str], trainable: list[str],
                 versions: dict[str, int] | None = None,
                 consumed: dict[str, dict[int, list[str]]] | None = None) -> None:
        self.telemetry = telemetry
        self.rollout = rollout
        self.train = train
        self.agents = agents
        self.trainable = trainable
        self.versions = versions if versions is not None else {}
        self.consumed = consumed if consumed is not None else {}
        # more per-iteration metrics (GPU utilisation and memory): each called once per record
        self.sources: list[Callable[[], dict[str, Any]]] = []
        # the spans before this index ended before the last record's window: `common`'s
        # windows only move forward, so its scans start here (a long run's records stay O(1))
        self._first = 0
        # the same for the rollout windows (`rollout_metrics`), which start at each
        # iteration's rollout start: before the last record's window in a pipelined run
        self._rollout_first, self._rollout_t0 = 0, float("-inf")

    def _train_busy_frac(self, t0: float, t1: float) -> float:
        """Busy device-seconds of the training pool over its devices: a slot of K ranks
        (`slot_sizes`) counts K devices busy while it runs a command."""
        sizes = getattr(self.train, "slot_sizes", None) or [1] * self.train.n_workers
        if t1 <= t0 or not sizes:
            return 0.0
        busy = self.telemetry.busy_by_worker("train", len(sizes), t0, t1, self._first)
        return sum(b * k for b, k in zip(busy, sizes, strict=True)) / ((t1 - t0) * sum(sizes))

    def rollout_metrics(self, it: IterationState) -> dict[str, Any]:
        """Balance and latency of one iteration's rollout (docs/design.md section 9 names)."""
        t0, t1 = it.started_at, it.rollout_finished_at
        span = max(t1 - t0, 1e-9)
        busy = self.telemetry.busy_by_worker("rollout", self.rollout.n_workers, t0, t1,
                                             self._skip_ended(t0))
        out: dict[str, Any] = {}
        for i, b in enumerate(busy):
            out[f"rollout/replica/{i}/busy_frac"] = b / span
        mean = float(np.mean(busy)) if busy else 0.0
        # max/mean busy time across the pool's replicas: 1.0 is perfect balance
        out["rollout/imbalance"] = max(busy) / mean if mean > 0 else 1.0
        lat = it.episode_latency
        out["rollout/episode_latency_p50_s"] = quantile(lat, 0.5)
        out["rollout/episode_latency_p95_s"] = quantile(lat, 0.95)
        for agent in self.agents:
            waits = it.queue_waits.get(agent, [])
            out[f"agent/{agent}/queue_wait_p50_s"] = quantile(waits, 0.5)
            out[f"agent/{agent}/queue_wait_p95_s"] = quantile(waits, 0.95)
            out[f"agent/{agent}/tokens_per_s"] = it.tokens.get(agent, 0) / span
            out[f"agent/{agent}/tokens_generated"] = it.tokens.get(agent, 0)
            counts = it.responses.get(agent) or {}
            n = sum(counts.values())
            out[f"agent/{agent}/distinct_responses"] = len(counts)
            out[f"agent/{agent}/top_response_frac"] = max(counts.values()) / n if n else 0.0
        for node, values in it.node_latency.items():
            out[f"node/{node}/latency_p50_s"] = quantile(values, 0.5)
        for node, rewards in sorted(it.node_rewards.items()):
            out[f"node/{node}/reward_mean"], out[f"node/{node}/reward_std"] = reward_stats(
                rewards)
        if it.plan is not None:
            out["rollout/plan"] = it.plan
        return out

    def _skip_ended(self, t0: float) -> int:
        """The index of the first span that may end after `t0`, for windows starting at a
        non-decreasing `t0`: a run's records scan only the spans since, not the whole trace
        each iteration."""
        spans = self.telemetry.spans
        if t0 < self._rollout_t0:  # (an earlier window: from the start)
            self._rollout_first = 0
        self._rollout_t0 = t0
        while self._rollout_first < len(spans) and spans[self._rollout_first].end <= t0:
            self._rollout_first += 1
        return self._rollout_first

    def common(self, k: int, t0: float, now: float, start: float) -> dict[str, Any]:
        """What every run's record of iteration k holds, whatever its rollout (a task's
        episodes, an environment run's workers): its window (t0, now], the pools' busy
        fractions, the training-state swaps (the pool's and each trainable agent's or
        policy's), and the extra `sources`."""
        spans = self.telemetry.spans  # those that ended before t0 matter to no later window
        while self._first < len(spans) and spans[self._first].end <= t0:
            self._first += 1
        record: dict[str, Any] = {
            "iteration": k,
            "wall_s": now - t0,
            "time_s": now - start,
            "pool/rollout/busy_frac": self.telemetry.busy_frac(
                "rollout", self.rollout.n_workers, t0, now, self._first),
            "pool/train/busy_frac": self._train_busy_frac(t0, now),
        }
        swaps = self.swaps(t0, now)
        record["pool/train/swaps"] = sum(n for n, _ in swaps.values())
        record["pool/train/swap_s"] = sum(secs for _, secs in swaps.values())
        for agent in self.trainable:  # an environment run's trainable are its policies
            record[f"agent/{agent}/swaps"] = swaps.get(agent, (0, 0.0))[0]
        for source in self.sources:
            record.update(source())
        return record

    def swaps(self, t0: float, now: float) -> dict[str, tuple[int, float]]:
        """Per agent (or policy): training-state swaps (a trainer bound to a slot it was not
        resident on) that ended in the window: agents time-sharing training slots."""
        return self.telemetry.labelled("train", "swap:", t0, now, self._first)

    def record(self, it: IterationState, t0: float, now: float, start: float) -> dict[str, Any]:
        """Iteration `it.index`'s record: its window is (t0, now], `start` the run's start."""
        k = it.index
        n_ok = it.episodes_total - it.episodes_failed
        record = self.common(k, t0, now, start)
        record.update({
            "task/success_rate": it.successes / max(n_ok, 1),
            "episodes/total": it.episodes_total,
            "episodes/failed": it.episodes_failed,
            "episodes/groups_resampled": sum(it.rounds.values()),
            "rollout/makespan_s": it.rollout_finished_at - it.started_at,
        })
        record.update(self.rollout_metrics(it))
        record.update(it.pool_stats)
        diffs = [it.trained[a] for a in self.trainable
                 if "logprob_diff_mean" in it.trained.get(a, {})]
        if diffs:  # rollout vs trainer log-probs of the same weights, over every agent
            record["rollout/logprob_diff_mean"] = float(np.mean(
                [d["logprob_diff_mean"] for d in diffs]))
            record["rollout/logprob_diff_max"] = max(d["logprob_diff_max"] for d in diffs)
        for agent in self.agents:
            # fsum is exactly rounded, so the mean does not depend on the order in which
            # episodes finished (placement changes that order, never the rewards).
            rewards = it.rewards.get(agent, [])
            mean, std = reward_stats(rewards) if rewards else (0.0, 0.0)
            record[f"agent/{agent}/reward_mean"] = mean
            if rewards:  # `normalize: agent_previous` resumes from these two
                record[f"agent/{agent}/reward_std"] = std
            by_label = it.label_rewards.get(agent)
            if by_label:  # a judge's reward per true class, and their mean (balanced)
                means = {c: reward_stats(r)[0] for c, r in sorted(by_label.items())}
                record.update({f"agent/{agent}/reward_mean/{c}": m for c, m in means.items()})
                record[f"agent/{agent}/balanced_reward_mean"] = float(np.mean(
                    list(means.values())))
            record[f"agent/{agent}/policy_version"] = self.versions[agent]
            record[f"agent/{agent}/rows_trained"] = len(self.consumed[agent].get(k, []))
            if agent in it.rows_filtered:  # dynamic sampling dropped these
                record[f"agent/{agent}/rows_filtered"] = it.rows_filtered[agent]
            for key, value in it.trained.get(agent, {}).items():
                record[f"agent/{agent}/{key}"] = value
        if it.errors:
            record["errors"] = it.errors
        return record


class FailureBudget:
    """`train.max_failed_fraction` / `train.max_consecutive_failed_iterations`: stop a run whose
    episodes keep failing, before it writes "final" checkpoints of an untrained model."""

    def __init__(self, cfg: RunConfig, telemetry: Telemetry) -> None:
        self.cfg = cfg
        self.telemetry = telemetry
        self.failed_iterations = 0  # consecutive iterations over the fraction

    def check(self, it: IterationState, first_error: str | None) -> None:
        """An LLM run's iteration: its failed episodes."""
        self.count(it.index, it.episodes_failed, it.episodes_total, first_error, "episodes")

    def count(self, k: int, failed: int, total: int, first_error: str | None,
              what: str) -> None:
        """Iteration k had `failed` of `total` units of rollout fail (`what`: an LLM run's
        episodes, an environment run's rollout workers)."""
        limit = self.cfg.train.max_failed_fraction
        fraction = failed / max(total, 1)
        if failed == 0 or fraction <= limit:
            self.failed_iterations = 0
            return
        self.failed_iterations += 1
        if self.failed_iterations <= self.cfg.train.max_consecutive_failed_iterations:
            return
        self.telemetry.fault("failure_budget_exceeded", iteration=k, failed=failed,
                             total=total, first_error=first_error)
        raise FailureBudgetExceeded(
            f"iteration {k}: {failed} of {total} {what} failed "
            f"({fraction:.0%} > train.max_failed_fraction={limit:g}) in "
            f"{self.failed_iterations} consecutive iteration(s) "
            f"(train.max_consecutive_failed_iterations="
            f"{self.cfg.train.max_consecutive_failed_iterations}); first error: {first_error}",
            first_error)
