"""The VDN / QMIX run: `MarlRun` (runtime, sync schedule, checkpoints, resume, supervisor,
telemetry) with an epsilon-greedy rollout (`offpolicy.QRollout`) and a replay learner
(`offpolicy.QLearner`) in place of MAPPO's.

Iteration k's transitions do not enter the experience store's on-policy tables: they go from
the rollout workers straight to the learner's replay table (`accumulate`, one micro-batch per
worker, sample id `{k}-w{worker}_0_0`), which its step adds exactly once; the step's audit
names them and the driver checks it before publishing version k+1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from flexmarl.config.schema import RunConfig
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.marl.offpolicy import QRolloutResult, q_layouts
from flexmarl.marl.policies import MarlSample, PolicyLayout
from flexmarl.marl.rollout import RolloutResult
from flexmarl.marl.run import MarlRun
from flexmarl.store.experience import ConsistencyError, make_sample_id


class VdnRun(MarlRun):
    def _layouts(self, cfg: RunConfig, probe: VecParallelEnv) -> dict[str, PolicyLayout]:
        return q_layouts(cfg, probe)

    def _reset_iteration(self) -> None:
        super()._reset_iteration()
        self.transitions_k: list[QRolloutResult] = []

    def put_rows(self, k: int, results: list[RolloutResult]) -> None:
        """Iteration k's transitions, held for step k (in rollout worker order)."""
        for res in results:
            assert isinstance(res, QRolloutResult)
            self.transitions_k.append(res)
            self.episodes_k += res.episodes
            self.payload_bytes[0] += res.payload_bytes[0]
            self.payload_bytes[1] += res.payload_bytes[1]

    async def train_iteration(self, policy: str, k: int) -> None:
        """Step k of the replay learner, then version k+1 to the rollout workers."""
        train = self.runtime.train
        if self._states_taken is not None:  # a checkpoint reads the learner's state first
            await asyncio.shield(self._states_taken)
        samples = [MarlSample(make_sample_id(f"{k}-w{i}", 0, 0), k, k, i, res.transitions)
                   for i, res in enumerate(self.transitions_k)]
        acc = [asyncio.ensure_future(train.accumulate(policy, [s])) for s in samples]
        stepped = asyncio.ensure_future(train.step(policy))
        await asyncio.gather(*acc)
        metrics, wire = await stepped
        audit = [tuple(e) for e in json.loads(wire[0])["meta"].get("trained_on", [])]
        expected = sorted(s.sample_id for s in samples)
        if sorted(sid for sid, *_ in audit) != expected or any(
                v != k or s != k for _, v, s, _ in audit):
            raise ConsistencyError(f"policy {policy!r}: step {k} added transitions other than "
                                   f"iteration {k}'s ({len(expected)} micro-batches sent)")
        self.audit[policy] += audit
        await self.runtime.rollout.publish(policy, k + 1, wire)
        self.metrics_k["replay/size"] = metrics.pop("replay_size")
        self.metrics_k["replay/updates"] = metrics.pop("updates")
        for key, value in metrics.items():
            self.metrics_k[f"agent/{policy}/{key}"] = value

    def _record(self, k: int, t0: float, t2: float, start: float) -> dict[str, Any]:
        rec = super()._record(k, t0, t2, start)
        if self.transitions_k:
            rec["epsilon"] = self.transitions_k[-1].epsilon
        return rec


__all__ = ["VdnRun"]
