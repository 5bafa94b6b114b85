"""The MAPPO / IPPO learner of one network policy, as a training slot hosts it.

It speaks the training pool's commands (`runtime/local/workers.py`: bind, accumulate, step,
weights, save, get_state, set_state) through `TrainHost`, so the local runtime's
`LocalTrainPool` drives it unchanged: its allocator binds policies to slots, and with fewer
slots than policies their states are swapped out and in through `training/state.py`.
Classic MARL's policies (`marl/learner.py`) and a hybrid run's network agents (an agent with
`network:`, `agent_network` below) are both this learner.

- `accumulate(rows)`: PPO's epochs need every row of the iteration before the first
  gradient, so a micro-batch is *held* (its iteration and version checked against the
  learner's), not differentiated; `step` then runs `epochs` x `minibatches` updates on exactly
  the held rows and returns the audit of which row each epoch used.
- A captured state is exact: weights, both Adam states, the value and observation
  normalisers, the mini-batch generator and the held rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flexmarl.config.schema import AgentConfig, MappoConfig
from flexmarl.envs.spaces import ActionSpec
from flexmarl.policy.nets import NetConfigView, NetPolicy
from flexmarl.store.compression import Codec
from flexmarl.training import state as st
from flexmarl.training.algorithms import mappo
from flexmarl.training.learner import Audit, NetworkLearner


class LearnerError(RuntimeError):
    """A learner was handed rows it must not train on (another iteration or version)."""


@dataclass
class MarlSample:
    """One store row on its way to a training slot: its arrays as the store holds them
    (observations FP16 + zstd when `store.compress_obs`, decoded by the learner)."""

    sample_id: str
    iteration: int
    version: int
    agent_index: int  # within its policy
    arrays: dict[str, np.ndarray]
    codec: dict[str, Any] = field(default_factory=dict)


def agent_network(agent: str, acfg: AgentConfig, seed: int) -> NetPolicy:
    """A hybrid run's network agent's policy with its initial weights: the same in every
    process (seeded by the run's seed and the agent's name), sized by its task's spaces."""
    n, spaces = acfg.network, acfg.network.spaces if acfg.network is not None else None
    if n is None or spaces is None:
        raise LearnerError(f"agent {agent!r}: not a network agent with its task's spaces "
                           "(agents.<name>.network, filled from Task.network_spaces)")
    view = NetConfigView(n.kind, list(n.hidden), n.activation, n.gru_hidden, n.layer_norm,
                         n.orthogonal)
    with torch.random.fork_rng():
        torch.manual_seed(network_seed(seed, agent))
        # IPPO's critic sees the agent's own observation; MAPPO's the session's critic input
        critic_dim = spaces.obs_dim if n.algorithm.name == "ippo" else spaces.critic_dim
        return NetPolicy([agent], spaces.obs_dim, critic_dim,
                         ActionSpec("discrete", nvec=(spaces.actions,)), view, n.obs_norm)


def network_seed(seed: int, agent: str) -> int:
    """The initial-weights seed of a network agent (stable across processes: no `hash`)."""
    return seed * 1009 + sum((i + 1) * ord(c) for i, c in enumerate(agent)) % 100_003


def agent_learner(agent: str, acfg: AgentConfig, seed: int) -> PolicyLearner:
    """A hybrid run's network agent's learner (`TrainHost` builds it in a training slot)."""
    assert acfg.network is not None
    algo = acfg.network.algorithm
    assert isinstance(algo, MappoConfig), "a graph's network agents learn with mappo / ippo"
    return PolicyLearner(agent, algo, agent_network(agent, acfg, seed),
                         network_seed(seed, agent) + 7)


class PolicyLearner(NetworkLearner):
    """MAPPO / IPPO's learner of one policy (the `Learner` role, training/learner.py):
    classic MARL's policies (`marl/learner.py`) and a hybrid run's network agents."""

    error = LearnerError

    def __init__(self, agent: str, algo: MappoConfig, net: NetPolicy, gen_seed: int) -> None:
        self.algo = algo
        self.agent = agent  # the training pool's key
        self.net = net
        self.actor_opt = torch.optim.Adam(self.net.actor.parameters(), lr=self.algo.lr,
                                          eps=self.algo.adam_eps)
        self.critic_opt = torch.optim.Adam(self.net.critic.parameters(),
                                           lr=self.algo.critic_lr, eps=self.algo.adam_eps)
        self.vnorm = mappo.ValueNorm()
        self.gen = torch.Generator().manual_seed(gen_seed)
        self.version = 0
        self.pending: list[MarlSample] = []
        self.trained_on: Audit | None = None  # the last step's rows, by epoch

    # --- the pool's commands -----------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Step k = `version`: PPO on exactly the held rows of iteration k; then version k+1
        (its observation statistics too). `trained_on`: which row each epoch used."""
        k = self._held()
        batch = self._batch(self.pending, k)
        mappo.compute_advantages(batch, self.vnorm, self.algo)
        audit: Audit = []

        def on_epoch(epoch: int, ids: list[str]) -> None:
            audit.extend((sid, k, k, epoch) for sid in ids)

        metrics = mappo.update(self.net, self.actor_opt, self.critic_opt, batch, self.vnorm,
                               self.algo, self.gen, on_epoch)
        live = batch.alive.bool()
        self.net.update_stats(batch.obs[live], batch.critic_x[live])
        self._stepped(audit)
        return metrics

    def state_objects(self) -> list[Any]:
        return [self.net, self.actor_opt, self.critic_opt]

    def weights(self) -> dict[str, torch.Tensor]:
        """What a rollout worker needs: the network (with its normalisers) and `vnorm.*`."""
        out = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        out.update({f"vnorm.{k}": v.clone() for k, v in self.vnorm.state_dict().items()})
        return out

    # --- batches -----------------------------------------------------------------------------
    def _batch(self, rows: list[MarlSample], k: int) -> mappo.PolicyBatch:
        def f(row: MarlSample, name: str) -> np.ndarray:
            header = row.codec.get(name)
            array = row.arrays[name]
            return Codec.decode(array, header) if header is not None else array

        def stack(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.from_numpy(np.stack([f(r, name) for r in rows], 1)).to(dtype)

        gru = "h0" in rows[0].arrays
        return mappo.PolicyBatch(
            sample_ids=[r.sample_id for r in rows], iteration=k,
            obs=stack("obs"), critic_x=stack("critic_x"),
            agent_ids=torch.tensor([r.agent_index for r in rows]),
            actions=stack("actions"), action_mask=stack("mask", torch.bool),
            logp=stack("logp"), values=stack("values"), rewards=stack("rewards"),
            dones=stack("dones"), alive=stack("alive"), starts=stack("starts", torch.bool),
            h0=torch.from_numpy(np.stack([f(r, "h0") for r in rows])) if gru else None,
            last_values=torch.from_numpy(
                np.concatenate([f(r, "last_value").reshape(-1) for r in rows])),
        )

    # --- exact states ------------------------------------------------------------------------
    def capture(self) -> st.TrainingState:
        tensors: dict[str, torch.Tensor] = {}
        for k, v in self.net.state_dict().items():
            tensors[f"w/net/{k}"] = v.detach().clone()
        for k, v in self.vnorm.state_dict().items():
            tensors[f"w/vnorm/{k}"] = v.clone()
        groups: dict[str, Any] = {}
        for oname, opt in (("actor", self.actor_opt), ("critic", self.critic_opt)):
            opt_tensors, groups[oname] = st.optimizer_tensors(opt, f"o/{oname}/")
            tensors.update(opt_tensors)
        tensors["rng/gen"] = self.gen.get_state()
        tensors.update(st.pending_tensors(self.pending))
        pending = [{"sample_id": s.sample_id, "iteration": s.iteration, "version": s.version,
                    "agent_index": s.agent_index, "codec": s.codec, "names": list(s.arrays)}
                   for s in self.pending]
        meta = {"agent": self.agent, "version": self.version, "param_groups": groups,
                "pending": pending}
        return st.TrainingState(tensors, meta)

    def restore(self, state: st.TrainingState) -> None:
        self._check_state(state)
        t = state.tensors
        self.net.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("w/net/")})
        self.vnorm.load_state_dict({k[8:]: v for k, v in t.items() if k.startswith("w/vnorm/")})
        for oname, opt in (("actor", self.actor_opt), ("critic", self.critic_opt)):
            st.load_optimizer(opt, t, state.meta["param_groups"][oname], f"o/{oname}/")
        self.gen.set_state(t["rng/gen"].clone())
        self.version = int(state.meta["version"])
        self.pending = [
            MarlSample(p["sample_id"], p["iteration"], p["version"], p["agent_index"],
                       {n: t[f"p/{i}/{n}"].numpy() for n in p["names"]}, p["codec"])
            for i, p in enumerate(state.meta["pending"])]


