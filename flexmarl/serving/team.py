"""Team canary: a whole version vector (new weights for one or more agents of the graph)
promoted or rolled back together, scored on whole episodes of the team (`POST /v1/episodes`).

A team canary gets `share` of new episodes (5% by default; error diffusion: after n episodes
the canary arm has had floor(n * share) of them). Every node of a canary episode is decoded by
its agent's canary version (the agents without new weights by their shadow), every node of
another episode by the shadows; per-agent traffic (`/v1/chat/completions`, `/v1/completions`)
never reaches a team canary's engines. Each episode's team reward is its score: the task's
(`score: "task"`: the episode's `success`, else its `reward`) or the client's
(`score: "feedback"`: the reward `POST /v1/feedback` sends for the episode id).

The promotion rule, with d = mean(canary) - mean(shadow) over the episodes since the canary
started and its Welch standard error se = sqrt(var_c / n_c + var_s / n_s) (sample variances),
z the two-sided normal quantile of `confidence`:

- nothing is decided before each arm has `min_episodes` scored episodes;
- promote when the lower bound d - z * se >= -margin (the canary is no worse than the shadow
  by more than `margin`, at that confidence);
- roll back when the upper bound d + z * se < -margin (it is worse, at that confidence), or when
  the canary arm reaches `max_episodes` undecided (the shadow stays: no evidence is no
  promotion).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flexmarl.serving.agents import Version

ARMS = ("shadow", "canary")


@dataclass
class TeamCanaryConfig:
    share: float = 0.05
    min_episodes: int = 200  # scored episodes per arm before any decision
    max_episodes: int = 2000  # canary episodes after which an undecided canary is rolled back
    confidence: float = 0.95
    margin: float = 0.0
    score: str = "task"  # "task" or "feedback"

    def check(self) -> TeamCanaryConfig:
        problems = [
            ("share", 0 < self.share < 1, "must be in (0, 1)"),
            ("min_episodes", self.min_episodes >= 2, "must be >= 2"),
            ("max_episodes", self.max_episodes >= self.min_episodes, "must be >= min_episodes"),
            ("confidence", 0.5 <= self.confidence < 1, "must be in [0.5, 1)"),
            ("margin", self.margin >= 0, "must be >= 0"),
            ("score", self.score in ("task", "feedback"), "must be \"task\" or \"feedback\""),
        ]
        for name, ok, what in problems:
            if not ok:
                raise ValueError(f"{name}: {what}")
        return self


@dataclass
class TeamCanary:
    """One team canary in flight: its versions, the routing and each arm's episode scores."""

    versions: dict[str, Version]  # agent -> canary version (agents with new weights)
    models: dict[str, Any]
    cfg: TeamCanaryConfig
    started: float = field(default_factory=time.time)
    scores: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    arm_of: dict[str, str] = field(default_factory=dict)  # episode id -> arm (feedback scoring)
    _owed: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def route(self) -> str:
        with self._lock:
            self._owed += self.cfg.share
            if self._owed >= 1.0 - 1e-9:
                self._owed -= 1.0
                return "canary"
            return "shadow"

    def observe(self, arm: str, score: float) -> None:
        with self._lock:
            self.scores[arm].append(float(score))

    def statistics(self) -> dict[str, Any]:
        with self._lock:
            c, s = list(self.scores["canary"]), list(self.scores["shadow"])
        out: dict[str, Any] = {"n_canary": len(c), "n_shadow": len(s),
                               "mean_canary": statistics.fmean(c) if c else None,
                               "mean_shadow": statistics.fmean(s) if s else None}
        if len(c) >= 2 and len(s) >= 2:
            d = statistics.fmean(c) - statistics.fmean(s)
            se = math.sqrt(statistics.variance(c) / len(c) + statistics.variance(s) / len(s))
            z = statistics.NormalDist().inv_cdf(0.5 + self.cfg.confidence / 2)
            out.update(diff=d, se=se, z=z, ci=[d - z * se, d + z * se])
        return out

    def verdict(self, force: bool = False) -> tuple[str | None, dict[str, Any]]:
        """("promote" | "rollback" | None (wait), the statistics and the reason)."""
        st = self.statistics()
        cfg = self.cfg
        enough = min(st["n_canary"], st["n_shadow"]) >= cfg.min_episodes
        if "ci" not in st:
            if force:
                return "rollback", {**st, "reason": "too few scored episodes to compare"}
            return None, st
        low, high = st["ci"]
        if enough or force:
            if low >= -cfg.margin:
                return "promote", {**st, "reason": f"lower bound {low:.4f} >= -margin"}
            if high < -cfg.margin:
                return "rollback", {**st, "reason": f"upper bound {high:.4f} < -margin"}
        if st["n_canary"] >= cfg.max_episodes or force:
            return "rollback", {**st, "reason": "undecided: no evidence is no promotion"}
        return None, st
