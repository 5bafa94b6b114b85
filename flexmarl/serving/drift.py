"""Drift: a rolling reward monitor per agent and per team (`flexmarl serve --capture`, on by
default; `--drift-window 0` turns it off).

Every feedback reward is observed under its agent (`agent/<name>`) and, for an episode's
reward, under the team (`team`). Each key keeps the last `window` rewards; once the window is
full its mean is compared with the best full-window mean seen since the key was last reset
(the peak) and the versions that earned it (the majority served version of each agent in the
window). A drop beyond `drop` (relative: `(peak - now) / |peak|`, the enterprise document's
"47% worse" is 0.47) is drift:

- an alert: a `drift` event in the deployment's events log (or the server's log), the counter
  in `/health` and `GET /v1/admin/drift`;
- when an agent serves another version than at the peak (for the team: any agent of the
  version vector), it is rolled back to the peak's version (kept in memory: the last
  `keep_versions` shadows of each agent), under a fresh version number with source
  `drift-rollback-v<N>`; with online learning, its canary is rolled back and its training
  restarts from the restored weights;
- when the versions are those of the peak (the environment or the traffic changed, not the
  policy), nothing can be rolled back: the alert says so.

Then the key starts afresh (a new peak is learnt from the next full window).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from flexmarl.serving.agents import Version

TEAM = "team"


@dataclass
class DriftConfig:
    window: int = 200  # rewards per rolling window [--drift-window; 0: off]
    drop: float = 0.25  # relative drop from the peak that counts as drift [--drift-drop]
    keep_versions: int = 4  # shadows of each agent kept in memory to roll back to


@dataclass
class _Key:
    rewards: deque[float]
    versions: deque[dict[str, int]]
    peak: float | None = None
    peak_versions: dict[str, int] = field(default_factory=dict)


class DriftMonitor:
    """Rolling reward per agent and team; drift alerts and rollbacks to the peak's versions."""

    def __init__(self, service: Any, cfg: DriftConfig) -> None:
        self.service = service
        self.cfg = cfg
        self.keys: dict[str, _Key] = {}
        self.history: dict[str, dict[int, tuple[Any, Version]]] = {}  # agent -> shadows
        self.alerts: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _key(self, name: str) -> _Key:
        if name not in self.keys:
            self.keys[name] = _Key(deque(maxlen=self.cfg.window), deque(maxlen=self.cfg.window))
        return self.keys[name]

    def _remember_shadows(self, agents: list[str]) -> None:
        for name in agents:
            spec = self.service.run.agents[name]
            kept = self.history.setdefault(name, {})
            if spec.version.number not in kept:
                kept[spec.version.number] = (spec.model, spec.version)
                for old in sorted(kept)[:-self.cfg.keep_versions]:
                    del kept[old]

    def observe(self, rows: list[tuple[str, int]], reward: float, episode: bool
                ) -> list[dict[str, Any]]:
        """One feedback reward for the responses `rows` ((agent, served version) each; all
        nodes of an episode when `episode`); returns the drift alerts it raised."""
        out: list[dict[str, Any]] = []
        with self._lock:
            self._remember_shadows(sorted({a for a, _ in rows}))
            vector = {a: v for a, v in rows}
            for agent, version in vector.items():
                out += self._push(f"agent/{agent}", reward, {agent: version})
            if episode:
                out += self._push(TEAM, reward, vector)
        return out

    def _push(self, name: str, reward: float, versions: dict[str, int]) -> list[dict[str, Any]]:
        k = self._key(name)
        k.rewards.append(reward)
        k.versions.append(versions)
        if len(k.rewards) < self.cfg.window:
            return []
        mean = sum(k.rewards) / len(k.rewards)
        if k.peak is None or mean > k.peak:
            k.peak = mean
            k.peak_versions = self._majority(k.versions)
            return []
        drop = (k.peak - mean) / max(abs(k.peak), 1e-9)
        if drop <= self.cfg.drop:
            return []
        return [self._drift(name, k, mean, drop)]

    @staticmethod
    def _majority(versions: deque[dict[str, int]]) -> dict[str, int]:
        counts: dict[str, Counter[int]] = {}
        for vec in versions:
            for agent, v in vec.items():
                counts.setdefault(agent, Counter())[v] += 1
        return {a: c.most_common(1)[0][0] for a, c in counts.items()}

    def _drift(self, name: str, k: _Key, mean: float, drop: float) -> dict[str, Any]:
        assert k.peak is not None
        rolled: dict[str, dict[str, int]] = {}
        missing: list[str] = []
        for agent, good in sorted(k.peak_versions.items()):
            spec = self.service.run.agents[agent]
            if spec.version.number == good:
                continue
            kept = self.history.get(agent, {}).get(good)
            if kept is None:
                missing.append(agent)
                continue
            rolled[agent] = {"from": spec.version.number, "to": self._roll_back(agent, *kept)}
        detail: dict[str, Any] = {
            "key": name, "window": self.cfg.window, "mean": round(mean, 4),
            "peak": round(k.peak, 4), "drop": round(drop, 4), "threshold": self.cfg.drop,
            "peak_versions": dict(k.peak_versions), "rolled_back": rolled}
        if missing:
            detail["not_kept"] = missing
        if not rolled:
            detail["action"] = ("none: the versions are those of the peak (the environment "
                                "or the traffic changed)" if not missing else
                                "none: the peak's version is no longer kept")
        else:
            detail["action"] = "rolled back to the peak's versions"
        # start afresh: this key, and every key of a rolled-back agent (and the team)
        for key in [name, *(f"agent/{a}" for a in rolled), *([TEAM] if rolled else [])]:
            if key in self.keys:
                self.keys[key] = _Key(deque(maxlen=self.cfg.window),
                                      deque(maxlen=self.cfg.window))
        alert = self._log(detail)
        self.alerts.append(alert)
        return alert

    def _roll_back(self, agent: str, model: Any, good: Version) -> int:
        svc = self.service
        spec = svc.run.agents[agent]
        version = Version(spec.next_number(), f"drift-rollback-v{good.number}",
                          good.policy_version, time.time())
        dep = svc.deployment.agents.get(agent) if svc.deployment is not None else None
        spec.carry_tenant_adapters(model)  # the tenants' own adapters are not rolled back
        with dep.lock if dep is not None else contextlib.nullcontext():
            if dep is not None and dep.canary is not None:
                dep._rollback(dep.canary, "drift", None, None)
            with spec.lock:
                spec.model, spec.version = model, version
            svc.workers[agent].swap(model, version)
            if dep is not None and dep.learner is not None:
                dep.learner.reset(model, version.number)
                dep.since_candidate = 0
        self.history.setdefault(agent, {})[version.number] = (model, version)
        return version.number

    def _log(self, detail: dict[str, Any]) -> dict[str, Any]:
        dep = self.service.deployment
        if dep is not None:
            return dep.events.log("drift", detail["key"], **detail)
        print(f"drift alert: {detail}", flush=True)
        return {"time": time.time(), "event": "drift", **detail}

    def describe(self) -> dict[str, Any]:
        with self._lock:
            keys = {n: {"n": len(k.rewards),
                        "mean": round(sum(k.rewards) / len(k.rewards), 4) if k.rewards else None,
                        "peak": k.peak, "peak_versions": k.peak_versions}
                    for n, k in self.keys.items()}
        return {"window": self.cfg.window, "drop": self.cfg.drop, "alerts": len(self.alerts),
                "keys": keys, "recent_alerts": self.alerts[-10:]}
