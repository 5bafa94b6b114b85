"""VDN / QMIX on the local MARL runtime: epsilon-greedy rollout workers, a replay learner in a
training slot, weights published by version (the MAPPO path's machinery, `run.py`).

Iteration k, with the orchestrator's `SyncSchedule` (`AsyncSchedule`: each worker's
transitions go to the learner as that worker ends, in worker order; the same step):
1. every rollout worker (`QRollout`) steps its `env.num_envs` environments `rollout_steps`
   times with version k of the Q-network, epsilon-greedy (epsilon from the run's global env
   step count), and returns the iteration's joint transitions ([T, E, ...] arrays);
2. they go to the learner's training slot (`accumulate`, one micro-batch per worker, checked
   to be iteration k's rows of version k); `step` replays the iteration in order: per
   vectorised step t it updates the observation statistics, adds every worker's transitions
   of step t to the replay table (`flexmarl/store/replay.py`) and, once the table holds
   `min_size` rows, runs `updates_per_step` VDN / QMIX updates on batches drawn partly by
   priority and weighted by age;
3. version k+1 (Q-network and observation statistics) goes to every rollout worker.

What differs from a one-process replay loop: the actors act with the weights of the start of
their iteration (up to `rollout_steps` vectorised steps old) instead of the latest update;
the number of updates per env step is the same. The replay table is off-policy by design: the
on-policy consistency contract of the MAPPO path does not apply to it; each iteration's
transitions still enter it exactly once, at step k (the step's audit names them).

The replay table is part of the learner's state: a checkpoint (and the supervisor's restart
point after each step) holds its filled rows, priorities and insertion steps, so a resumed
run is bit-identical to an uninterrupted one. Its size: per row the joint observations and
next observations (2 x agents x obs floats), masks, actions, reward, done, plus QMIX's state
and next state; simple_spread (3 agents, 18 floats, state 54): about 0.5 kB per row for VDN,
0.95 kB for QMIX, so a full 100k-row table is about 50 / 95 MB in every checkpoint.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flexmarl.config.schema import ConfigError, RunConfig
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.marl.policies import MarlSample, PolicyLayout, group_spec
from flexmarl.marl.rollout import (
    WORKER_SEED_STRIDE,
    RolloutResult,
    capture_worker_state,
    restore_worker_state,
)
from flexmarl.policy.nets import RunningMeanStd
from flexmarl.store.replay import ReplayTable
from flexmarl.training import state as st
from flexmarl.training.algorithms import qmix, vdn
from flexmarl.training.algorithms.vdn import VdnConfig
from flexmarl.training.learner import Audit, NetworkLearner


class QLearnerError(RuntimeError):
    """The replay learner was handed transitions of another iteration or version."""


def q_layouts(cfg: RunConfig, venv: VecParallelEnv) -> dict[str, PolicyLayout]:
    """The one shared Q-network's layout (`critic_dim`: the global state's size, QMIX's mixer
    input), after the checks VDN / QMIX need, each naming its field."""
    if not isinstance(cfg.env_algorithm, VdnConfig):
        raise TypeError(f"the replay driver runs vdn/qmix, not {cfg.env_algorithm.name}")
    name = cfg.env_algorithm.name
    agents = list(venv.agents)
    groups = cfg.policy_groups(agents)
    if len(groups) != 1:
        raise ConfigError(f"agents: {name} here is one joint learner with one Q-network shared "
                          "by all agents (agent id in its input); give every agent "
                          "network: {base: NAME} of one entry of networks")
    (policy,) = groups
    if cfg.network_of(policy).kind != "mlp":
        where = f"networks.{policy}" if policy in cfg.networks else f"agents.{policy}.network"
        raise ConfigError(f"{where}.kind: {name} supports the mlp network only")
    if cfg.store.compress_obs:
        raise ConfigError(f"store.compress_obs: {name}'s transitions go to its replay table "
                          "uncompressed (the option compresses MAPPO/IPPO's store rows); "
                          "unset it")
    env_id = cfg.environment.id
    spec = group_spec(agents, venv.action_specs, env_id)
    if spec.kind != "discrete":
        where = f"networks.{policy}" if policy in cfg.networks else f"agents.{policy}.network"
        raise ConfigError(f"{where}.algorithm.name: {name} needs discrete actions; {env_id} "
                          f"has {spec.kind} actions (use mappo or ippo)")
    obs_dim = max(venv.obs_specs[a].dim for a in agents)
    return {policy: PolicyLayout(policy, 0, tuple(agents), obs_dim, int(venv.state.shape[1]),
                                 spec)}


def build_q(cfg: RunConfig, layout: PolicyLayout) -> tuple[vdn.QNet, qmix.QMixer | None]:
    """The Q-network (and QMIX's mixer) with their initial weights, the same in every process
    (seeded by the run's seed)."""
    algo = cfg.env_algorithm
    assert isinstance(algo, VdnConfig)
    n = len(layout.agents)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        hidden = list(cfg.network_of(layout.name).hidden)
        q = vdn.QNet(layout.obs_dim + n, layout.spec.nvec[0], hidden)
        mixer = (qmix.QMixer(n, layout.critic_dim, algo.mixing_embed, algo.hypernet_layers,
                             algo.hypernet_embed) if algo.name == "qmix" else None)
    return q, mixer


def joint(layout: PolicyLayout, obs: dict[str, np.ndarray], masks: dict[str, np.ndarray]
          ) -> tuple[np.ndarray, np.ndarray]:
    """[E, N, D] observations (zero-padded) and [E, N, A] action masks."""
    D, A = layout.obs_dim, layout.spec.nvec[0]
    o = np.stack([np.pad(obs[a], ((0, 0), (0, D - obs[a].shape[1]))) for a in layout.agents], 1)
    m = np.stack([np.pad(masks[a], ((0, 0), (0, A - masks[a].shape[1])))
                  for a in layout.agents], 1)
    return o.astype(np.float32), m.astype(bool)


def q_input(o: torch.Tensor, norm: RunningMeanStd | None, n_agents: int) -> torch.Tensor:
    """Normalised observations with the agent's one-hot id appended: [..., N, D + N]."""
    if norm is not None:
        o = norm.normalize(o)
    ids = torch.eye(n_agents).expand(*o.shape[:-1], n_agents)
    return torch.cat([o, ids], -1)


@dataclass
class QRolloutResult(RolloutResult):
    # the iteration's joint transitions: field -> [T, E, ...] (obs, mask, actions, reward,
    # next_obs, next_mask, done, alive, next_alive; QMIX: state, next_state)
    transitions: dict[str, np.ndarray] = field(default_factory=dict)
    epsilon: float = 0.0  # at the iteration's last step


class QRollout:
    """A VDN / QMIX rollout worker: its environments, an acting copy of the Q-network and the
    observation statistics of the published version, and its exploration generator. Worker
    `index` owns environments seeded at seed + index * stride, as the MAPPO workers'."""

    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout], index: int = 0
                 ) -> None:
        assert isinstance(cfg.env_algorithm, VdnConfig)
        self.cfg, self.algo, self.index = cfg, cfg.env_algorithm, index
        (self.layout,) = layouts.values()  # the one joint policy
        seed = cfg.seed + WORKER_SEED_STRIDE * index
        env = cfg.environment
        self.venv = VecParallelEnv(env.id, env.options, env.num_envs, seed, env.opponents)
        self.venv.reset()
        self.agents = list(self.layout.agents)
        self.rng = np.random.default_rng(seed)
        self.q, _ = build_q(cfg, self.layout)
        self.norm = (RunningMeanStd(self.layout.obs_dim)
                     if cfg.network_of(self.layout.name).obs_norm else None)
        self.version = -1
        self.qmix = self.algo.name == "qmix"

    def load(self, name: str, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.q.load_state_dict({k[2:]: v for k, v in weights.items() if k.startswith("q.")})
        if self.norm is not None:
            self.norm.load_state_dict({k[9:]: v for k, v in weights.items()
                                       if k.startswith("obs_norm.")})
        self.version = version

    def get_state(self) -> bytes:
        """The environments (by attribute: positions, velocities, step counters, their RNGs)
        and the exploration generator: restored into a worker of the same config, the next
        `run` is bit-identical."""
        return capture_worker_state(self.cfg.environment.id, self.index, self.venv,
                                    rng=self.rng)

    def set_state(self, blob: bytes) -> None:
        state = restore_worker_state(blob, self.index, self.venv)
        self.venv, self.rng = state["venv"], state["rng"]

    @torch.no_grad()
    def act(self, o: np.ndarray, m: np.ndarray, eps: float) -> np.ndarray:
        """Epsilon-greedy joint actions [E, N]: greedy in Q, or uniform over legal actions."""
        q = self.q(q_input(torch.from_numpy(o), self.norm, len(self.agents)),
                   torch.from_numpy(m)).numpy()
        greedy = q.argmax(-1)
        keys = self.rng.random(m.shape)  # a uniform legal action: the largest key among them
        rand = np.where(m, keys, -1.0).argmax(-1)
        explore = self.rng.random(greedy.shape) < eps
        return np.where(explore, rand, greedy)

    def run(self, k: int) -> QRolloutResult:
        """Iteration k's `rollout_steps` vectorised steps with version k."""
        if self.version != k:
            raise RuntimeError(f"rollout worker {self.index}: the Q-network is version "
                               f"{self.version}, iteration {k} needs version {k}")
        t0 = time.perf_counter()
        venv, cfg = self.venv, self.cfg
        E, T = venv.num_envs, cfg.train.rollout_steps
        E_all = E * cfg.runtime.rollout_workers  # the run's env steps per vectorised step
        buf: dict[str, list[np.ndarray]] = {}
        eps = 1.0
        for t in range(T):
            o, m = joint(self.layout, venv.obs, venv.masks)
            s_now = venv.state.copy()
            alive = np.stack([venv.alive[a] for a in self.agents], 1)  # [E, N] acting now
            eps = vdn.epsilon((k * T + t) * E_all, self.algo.eps_end, self.algo.eps_decay_steps)
            actions = self.act(o, m, eps)
            res = venv.step({a: actions[:, i:i + 1] for i, a in enumerate(self.agents)})
            done = np.stack([res["done"][a] for a in self.agents], 1)
            trunc = np.stack([res["truncated"][a] for a in self.agents], 1)
            # an agent whose chain ended here: its last observation (the environment may
            # have reset); the others: the next step's
            next_src = {a: np.where(done[:, i:i + 1], res["final_obs"][a], venv.obs[a])
                        for i, a in enumerate(self.agents)}
            no, nm = joint(self.layout, next_src, venv.masks)
            # a future: still present, or cut by a time limit (bootstrapped); an agent that
            # terminated (left) adds nothing to the next Q_tot
            next_alive = alive & (~done | trunc)
            ended = (done | ~alive).all(1)  # no agent left: the environment was reset
            terminal = ended & ~(trunc & alive).any(1)
            reward = np.stack([res["reward"][a] for a in self.agents], 0).mean(axis=0)
            row = {"obs": o, "mask": m, "actions": actions.astype(np.int64),
                   "reward": reward.astype(np.float32), "next_obs": no, "next_mask": nm,
                   "done": np.asarray(terminal, dtype=np.float32),
                   "alive": alive.astype(np.float32),
                   "next_alive": next_alive.astype(np.float32)}
            if self.qmix:
                row["state"] = s_now.astype(np.float32)
                row["next_state"] = np.where(ended[:, None], res["final_state"],
                                             venv.state).astype(np.float32)
            for name, value in row.items():
                buf.setdefault(name, []).append(value)
        transitions = {name: np.stack(v) for name, v in buf.items()}
        episodes = [{"returns": e.returns, "length": e.length, **e.metrics}
                    for e in venv.pop_episodes()]
        nbytes = transitions["obs"].nbytes + transitions["next_obs"].nbytes
        return QRolloutResult([], episodes, (nbytes, nbytes), E * T, time.perf_counter() - t0,
                              transitions=transitions, epsilon=eps)


class QLearner(NetworkLearner):
    """The VDN / QMIX learner of the shared Q-network, one joint learner for its group of
    agents: the Q-network, its target copy, QMIX's mixer and its target, one Adam over both,
    the observation statistics, the replay table and its sampling generator. The `Learner`
    role as `PolicyLearner` plays it (the same `TrainHost` hosts either); only where the
    rows come from differs (the replay table's sampler, not iteration k's rows)."""

    error = QLearnerError
    rows_name = "transitions"

    def __init__(self, cfg: RunConfig, layout: PolicyLayout) -> None:
        assert isinstance(cfg.env_algorithm, VdnConfig)
        self.cfg, self.algo, self.layout = cfg, cfg.env_algorithm, layout
        self.agent = layout.name
        self.n = len(layout.agents)
        self.q, self.mixer = build_q(cfg, layout)
        self.q_target = copy.deepcopy(self.q)
        self.mixer_target = copy.deepcopy(self.mixer)
        self.params = list(self.q.parameters()) + (
            list(self.mixer.parameters()) if self.mixer is not None else [])
        self.opt = torch.optim.Adam(self.params, lr=self.algo.lr)
        self.norm = (RunningMeanStd(layout.obs_dim)
                     if cfg.network_of(layout.name).obs_norm else None)
        a = self.algo
        self.replay = ReplayTable(a.capacity, a.min_size,
                                  a.priority_fraction if a.prioritized else 0.0,
                                  a.priority_alpha)
        self.rng = np.random.default_rng(cfg.seed * 1009 + 7)
        self.updates = 0
        self.version = 0
        self.pending: list[MarlSample] = []
        self.trained_on: Audit | None = None  # the last step's transitions

    # --- the pool's commands -----------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Step k: iteration k's transitions into the replay table, vectorised step by step
        in rollout order (every worker's environments of step t, in worker order), each
        followed by `updates_per_step` updates once the table is ready; then version k+1."""
        k = self._held()
        T = self.cfg.train.rollout_steps
        parts = sorted(self.pending, key=lambda s: s.agent_index)  # the rollout worker's
        E_all = sum(int(s.arrays["obs"].shape[1]) for s in parts)
        sums: dict[str, float] = {}
        n_learn = 0
        for t in range(T):
            rows = {name: np.concatenate([s.arrays[name][t] for s in parts])
                    for name in parts[0].arrays}
            env_steps = (k * T + t + 1) * E_all
            if self.norm is not None:
                self.norm.update(torch.from_numpy(rows["obs"]))
            self.replay.add(rows, env_steps)
            if self.replay.ready:
                for _ in range(self.algo.updates_per_step):
                    for key, v in self.learn(env_steps).items():
                        sums[key] = sums.get(key, 0.0) + v
                    n_learn += 1
        metrics = {key: v / n_learn for key, v in sums.items()}
        metrics["replay_size"] = float(len(self.replay))
        metrics["updates"] = float(n_learn)
        self._stepped([(s.sample_id, k, k, 0) for s in parts])
        return metrics

    def state_objects(self) -> list[Any]:
        return [*self._modules().values(), self.opt]

    def learn(self, env_steps: int) -> dict[str, float]:
        """One VDN / QMIX update on a replay batch; the TD errors become its priorities."""
        b = self.replay.sample(self.algo.batch_size, env_steps, self.rng)
        d = {k: torch.from_numpy(v) for k, v in b.data.items()}
        with torch.no_grad():
            x_next = q_input(d["next_obs"], self.norm, self.n)
            q_next, q_next_target = (self.q(x_next, d["next_mask"]),
                                     self.q_target(x_next, d["next_mask"]))
            if self.mixer_target is not None:
                targets = qmix.td_targets(q_next, q_next_target, d["reward"], d["done"],
                                          self.algo.gamma, self.mixer_target, d["next_state"],
                                          d["next_alive"])
            else:
                targets = vdn.td_targets(q_next, q_next_target, d["reward"], d["done"],
                                         self.algo.gamma, d["next_alive"])
        q = self.q(q_input(d["obs"], self.norm, self.n), d["mask"])
        w = torch.from_numpy(b.age_weight if self.algo.age_weight
                             else np.ones_like(b.age_weight)).float()
        if self.mixer is not None:
            loss, td = qmix.loss(q, d["actions"], targets, w, self.mixer, d["state"],
                                 d["alive"])
        else:
            loss, td = vdn.loss(q, d["actions"], targets, w, d["alive"])
        self.opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, self.algo.max_grad_norm or float("inf"))
        self.opt.step()
        self.replay.update_priorities(b.index, td.numpy())
        self.updates += 1
        if self.updates % self.algo.target_every == 0:
            self.q_target.load_state_dict(self.q.state_dict())
            if self.mixer is not None and self.mixer_target is not None:
                self.mixer_target.load_state_dict(self.mixer.state_dict())
        return {"loss/value": float(loss.detach()),
                "q_mean": float(q.detach().max(-1).values.mean()),
                "td_abs_mean": float(td.abs().mean()), "grad_norm": float(norm),
                "lr": self.algo.lr, "age_weight_mean": float(b.age_weight.mean())}

    def weights(self) -> dict[str, torch.Tensor]:
        """What a rollout worker acts with: the Q-network and the observation statistics."""
        out = {f"q.{k}": v.detach().clone() for k, v in self.q.state_dict().items()}
        if self.norm is not None:
            out.update({f"obs_norm.{k}": v.clone() for k, v in self.norm.state_dict().items()})
        return out

    def save_tensors(self) -> dict[str, torch.Tensor]:
        state = self.weights()
        if self.mixer is not None:
            state.update({f"mixer.{k}": v.detach().clone()
                          for k, v in self.mixer.state_dict().items()})
        return state

    # --- exact states ------------------------------------------------------------------------
    def _modules(self) -> dict[str, torch.nn.Module]:
        mods: dict[str, torch.nn.Module] = {"q": self.q, "q_target": self.q_target}
        if self.mixer is not None and self.mixer_target is not None:
            mods.update({"mixer": self.mixer, "mixer_target": self.mixer_target})
        if self.norm is not None:
            mods["norm"] = self.norm
        return mods

    def capture(self) -> st.TrainingState:
        """Everything the next step depends on: networks and targets, Adam, the observation
        statistics, the replay table's filled rows with their priorities and insertion
        steps, the sampling generator, the update counter and the held transitions."""
        tensors: dict[str, torch.Tensor] = {}
        for mname, mod in self._modules().items():
            for k, v in mod.state_dict().items():
                tensors[f"w/{mname}/{k}"] = v.detach().clone()
        opt_tensors, param_groups = st.optimizer_tensors(self.opt)
        tensors.update(opt_tensors)
        r, n = self.replay, self.replay.size
        for name, arr in r.fields.items():
            tensors[f"r/f/{name}"] = torch.from_numpy(np.array(arr[:n], copy=True))
        tensors["r/priority"] = torch.from_numpy(r.priority[:n].copy())
        tensors["r/inserted"] = torch.from_numpy(r.inserted[:n].copy())
        tensors.update(st.pending_tensors(self.pending))
        pending = [{"sample_id": s.sample_id, "iteration": s.iteration, "version": s.version,
                    "worker": s.agent_index, "names": list(s.arrays)} for s in self.pending]
        meta = {"agent": self.agent, "version": self.version, "updates": self.updates,
                "param_groups": param_groups,
                "replay": {"size": n, "cursor": r.cursor, "fields": list(r.fields)},
                "rng": self.rng.bit_generator.state,  # plain ints: JSON keeps them exact
                "pending": pending}
        return st.TrainingState(tensors, meta)

    def restore(self, state: st.TrainingState) -> None:
        self._check_state(state)
        t, meta = state.tensors, state.meta
        for mname, mod in self._modules().items():
            prefix = f"w/{mname}/"
            mod.load_state_dict({k[len(prefix):]: v.clone() for k, v in t.items()
                                 if k.startswith(prefix)})
        st.load_optimizer(self.opt, t, meta["param_groups"])
        r, info = self.replay, meta["replay"]
        n = int(info["size"])
        if n > r.capacity:
            raise ValueError(f"the replay state holds {n} rows; algorithm.capacity is "
                             f"{r.capacity} (resume with the run's own config)")
        r.fields = {}
        for name in info["fields"]:
            arr = t[f"r/f/{name}"].numpy()
            r.fields[name] = np.zeros((r.capacity, *arr.shape[1:]), arr.dtype)
            r.fields[name][:n] = arr
        r.priority[:] = 0.0
        r.inserted[:] = 0
        r.priority[:n] = t["r/priority"].numpy()
        r.inserted[:n] = t["r/inserted"].numpy()
        r.size, r.cursor = n, int(info["cursor"])
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = meta["rng"]
        self.updates = int(meta["updates"])
        self.version = int(meta["version"])
        self.pending = [
            MarlSample(p["sample_id"], p["iteration"], p["version"], p["worker"],
                       {name: t[f"p/{i}/{name}"].numpy() for name in p["names"]})
            for i, p in enumerate(meta["pending"])]


__all__ = ["QLearner", "QLearnerError", "QRollout", "QRolloutResult", "build_q",
           "q_layouts"]
