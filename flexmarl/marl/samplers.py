"""Where an iteration's experience waits for its step, and what the step is handed: the one
thing on- and off-policy learning differ in (as in BenchMARL), the driver (`run.py`) being
the same for both.

- `OnPolicyRows` (MAPPO / IPPO): iteration k's rows in the experience store's per-agent
  tables; step k of a policy takes exactly its agents' ready rows of iteration k (the store
  checks the iteration, the version and the vector and hands each row out once), one
  micro-batch per agent, and every epoch's audit must name exactly them;
- `ReplayTransitions` (VDN / QMIX): iteration k's joint transitions, one micro-batch per
  rollout worker (sample id `{k}-w{worker}_0_0`), which the learner's step adds to its replay
  table exactly once (its audit names each once); the replay table's sampler (prioritized,
  age-weighted, `store/replay.py`) draws the updates' batches inside the learner.
"""

from __future__ import annotations

from typing import Any, Protocol

from flexmarl.marl.offpolicy import QRolloutResult
from flexmarl.marl.policies import MarlSample, PolicyLayout
from flexmarl.marl.rollout import RolloutResult
from flexmarl.store.experience import ConsistencyError, ExperienceStore, Row, make_sample_id

# one audit entry of a step: (sample id, its policy version, the step, the epoch)
Audit = list[tuple[Any, ...]]


class IterationSampler(Protocol):
    def put(self, k: int, results: list[RolloutResult]) -> None:
        """Iteration k's results of every rollout worker (in worker order)."""

    def batches(self, policy: str, k: int) -> list[list[MarlSample]]:
        """The micro-batches of `policy`'s step k among the results put so far, each taken
        once (the async pipeline calls it after each rollout worker's results)."""

    def check(self, policy: str, k: int, audit: Audit) -> None:
        """Raise `ConsistencyError` unless step k trained on exactly what `batches` gave."""

    def release(self, policy: str, k: int) -> None:
        """Step k is done: what it took can go."""

    def step_metrics(self, policy: str, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics under their record names."""

    def record(self) -> dict[str, float]:
        """Iteration figures of the sampler itself (the behaviour's epsilon), then reset."""


class OnPolicyRows:
    """MAPPO / IPPO's rows in the experience store (module docstring)."""

    def __init__(self, store: ExperienceStore, agents: list[str],
                 layouts: dict[str, PolicyLayout], num_envs: int) -> None:
        """`num_envs`: the environments of one rollout worker."""
        self.store, self.agents, self.layouts, self.num_envs = store, agents, layouts, num_envs
        self._taken: dict[str, list[Row]] = {}
        self._put: dict[tuple[int, str], list[str]] = {}  # (k, agent): ids put, not taken
        # iteration k: the rollout workers whose results were put (a lost one's are missing)
        self._workers: dict[int, int] = {}

    def put(self, k: int, results: list[RolloutResult]) -> None:
        """Iteration k's rows into the store, ready for step k: sample_id
        `{k}-{env}_{agent index}_0`, policy_version k, the version vector, the arrays by
        reference."""
        vector = dict.fromkeys(self.agents, k)
        if k not in self._workers:  # every step of k-1 is checked: rollout k waited for them
            self._workers = {k: 0}
        self._workers[k] += len(results)
        for res in results:
            for r in res.rows:
                ai = self.agents.index(r.agent)
                sid = make_sample_id(f"{k}-{r.env}", ai, 0)
                self._put.setdefault((k, r.agent), []).append(sid)
                self.store.add(Row(sample_id=sid, agent=r.agent, node=r.agent,
                                   input_id=f"{k}-{r.env}", turn=ai, trajectory_id=0,
                                   iteration=k, policy_version=k, version_vector=vector))
                total = float(r.payload["rewards"].sum())
                self.store.set_generated(r.agent, sid, r.data, r.payload)
                self.store.set_rewarded(r.agent, sid, total)
                # per-step advantages come from GAE in the learner (they need the critic's
                # value normaliser of this version); the row's scalar is its summed reward
                self.store.set_ready(r.agent, sid, total)

    def take(self, policy: str, k: int) -> dict[str, tuple[list[Row], list[MarlSample]]]:
        """Policy's rows of iteration k put so far, per agent (in sample id order), taken
        from the store once."""
        vector = dict.fromkeys(self.agents, k)
        out = {}
        for a in self.layouts[policy].agents:
            ids = sorted(self._put.pop((k, a), []))
            if not ids:
                continue
            rows = self.store.take_ready(a, k, len(ids), k, expected_vector=vector,
                                         sample_ids=ids)
            out[a] = (rows, [
                MarlSample(r.sample_id, r.iteration, r.policy_version,
                           int(r.data["agent_index"]),
                           {name: self.store.fetch(r, name) for name in r.refs},
                           dict(r.data.get("codec", {})))
                for r in rows])
        return out

    def batches(self, policy: str, k: int) -> list[list[MarlSample]]:
        taken = self.take(policy, k)
        self._taken.setdefault(policy, []).extend(r for rows, _ in taken.values() for r in rows)
        return [samples for _, samples in taken.values()]

    def check(self, policy: str, k: int, audit: Audit) -> None:
        expected = {r.sample_id for r in self._taken[policy]}
        complete = len(expected) == (self.num_envs * self._workers.get(k, 0)
                                     * len(self.layouts[policy].agents))
        if not complete or {sid for sid, *_ in audit} != expected or any(
                v != k or s != k for _, v, s, _ in audit):
            raise ConsistencyError(f"policy {policy!r}: step {k} trained on rows other than "
                                   f"iteration {k}'s ({len(expected)} taken)")

    def release(self, policy: str, k: int) -> None:
        self.store.release(self._taken.pop(policy))
        for a in self.layouts[policy].agents:
            self.store.evict(a, k)

    def step_metrics(self, policy: str, metrics: dict[str, float]) -> dict[str, float]:
        return {f"agent/{policy}/{key}": value for key, value in metrics.items()}

    def record(self) -> dict[str, float]:
        return {}


class ReplayTransitions:
    """VDN / QMIX's transitions, for the replay learner's table (module docstring)."""

    def __init__(self) -> None:
        self.transitions: list[QRolloutResult] = []  # iteration k's, in worker order
        self._sent: list[str] = []

    def put(self, k: int, results: list[RolloutResult]) -> None:
        for res in results:
            assert isinstance(res, QRolloutResult)
            self.transitions.append(res)

    def batches(self, policy: str, k: int) -> list[list[MarlSample]]:
        first = len(self._sent)
        samples = [MarlSample(make_sample_id(f"{k}-w{i}", 0, 0), k, k, i, res.transitions)
                   for i, res in enumerate(self.transitions[first:], start=first)]
        self._sent += [s.sample_id for s in samples]
        return [[s] for s in samples]

    def check(self, policy: str, k: int, audit: Audit) -> None:
        if sorted(sid for sid, *_ in audit) != sorted(self._sent) or any(
                v != k or s != k for _, v, s, _ in audit):
            raise ConsistencyError(f"policy {policy!r}: step {k} added transitions other than "
                                   f"iteration {k}'s ({len(self._sent)} micro-batches sent)")

    def release(self, policy: str, k: int) -> None:
        self._sent = []

    def step_metrics(self, policy: str, metrics: dict[str, float]) -> dict[str, float]:
        out = {"replay/size": metrics.pop("replay_size"),
               "replay/updates": metrics.pop("updates")}
        return out | {f"agent/{policy}/{key}": value for key, value in metrics.items()}

    def record(self) -> dict[str, float]:
        out = {"epsilon": self.transitions[-1].epsilon} if self.transitions else {}
        self.transitions = []
        return out
