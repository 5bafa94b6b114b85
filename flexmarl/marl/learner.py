"""Classic MARL's learners as training slots host them: MAPPO / IPPO's `PolicyLearner` (the
one of training/policy_learner.py, built from a policy's layout) or VDN / QMIX's replay
learner, behind the one `TrainHost`."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from flexmarl.config.schema import RunConfig
from flexmarl.marl.policies import PolicyLayout, build_net
from flexmarl.runtime.local.workers import _setup_torch, serve_slot, start_heartbeat
from flexmarl.training.algorithms.mappo import MappoConfig
from flexmarl.training.host import TrainHost
from flexmarl.training.policy_learner import LearnerError
from flexmarl.training.policy_learner import PolicyLearner as NetPolicyLearner

__all__ = ["LearnerError", "PolicyLearner", "learner_host", "make_learner", "slot_host"]

if TYPE_CHECKING:
    from flexmarl.marl.offpolicy import QLearner


class PolicyLearner(NetPolicyLearner):
    """MAPPO / IPPO's learner of one classic-MARL policy (one network, shared or not)."""

    def __init__(self, cfg: RunConfig, layout: PolicyLayout) -> None:
        assert isinstance(cfg.env_algorithm, MappoConfig)
        self.cfg, self.layout = cfg, layout
        super().__init__(layout.name, cfg.env_algorithm, build_net(cfg, layout),
                         cfg.seed * 1009 + layout.index + 7)

    def step(self) -> dict[str, float]:
        """The step's rows in one order, agent by agent (the policy's columns), each agent's
        by sample id: the sync pipeline's micro-batches arrive so; the async pipeline's arrive
        per rollout worker, and the same order makes its step bit-identical."""
        self.pending.sort(key=lambda row: (row.agent_index, row.sample_id))
        return super().step()


if TYPE_CHECKING:
    AnyLearner = PolicyLearner | QLearner


def make_learner(cfg: RunConfig, layout: PolicyLayout) -> AnyLearner:
    """MAPPO / IPPO's `PolicyLearner`, or VDN / QMIX's replay learner (marl/offpolicy.py)."""
    if isinstance(cfg.env_algorithm, MappoConfig):
        return PolicyLearner(cfg, layout)
    # optional: pettingzoo (the marl extra); a hybrid graph's MAPPO learners run without it
    from flexmarl.marl.offpolicy import QLearner

    return QLearner(cfg, layout)


def learner_host(cfg: RunConfig, layouts: dict[str, PolicyLayout],
                 swap_dir: str | None = None) -> TrainHost:
    """A training slot for network policies: the one `TrainHost`, building each policy's
    learner (`make_learner`) the first time it is bound here; a swap moves only its state."""

    def build(agent: str) -> AnyLearner:
        if agent not in layouts:
            raise LearnerError(f"no policy {agent!r} in this run "
                               f"(policies: {', '.join(layouts)})")
        return make_learner(cfg, layouts[agent])

    return TrainHost(None, swap_dir=swap_dir, build=build)


def slot_host(spec: Any) -> TrainHost:
    """A training slot's host from its `MarlWorkerSpec` (a process's or a Ray actor's)."""
    return learner_host(RunConfig.model_validate(spec.config), spec.layouts, spec.swap_dir)


def marl_train_worker_main(conn: Connection, spec: Any) -> None:
    """A training slot process for network policies (`MarlWorkerSpec`): the shared slot loop
    (`serve_slot`) over a `TrainHost` of network learners."""

    conn = start_heartbeat(conn, spec)  # type: ignore[assignment]
    _setup_torch(spec)
    serve_slot(conn, slot_host(spec).handle)
