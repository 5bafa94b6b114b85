"""The off-policy driver: vectorised PettingZoo rollout -> replay table -> VDN updates.

Each vectorised step acts epsilon-greedily with the current Q-network for every environment
and agent at once, adds one joint transition per environment to the replay table
(flexmarl/store/replay.py), and, once the table holds `min_size` rows, runs
`updates_per_step` VDN updates on batches drawn partly by priority (`priority_fraction`) and
weighted by sample age. Records are written every `rollout_steps` vectorised steps, under the
same names as the on-policy driver's (iteration, env_steps, return_mean, task/*, agent/...).
This table is off-policy by design; the on-policy contract of the MAPPO path does not apply.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexmarl.config.schema import ConfigError
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.marl.config import MarlRunConfig, VdnConfig
from flexmarl.marl.policies import group_spec
from flexmarl.marl.run import MarlResult
from flexmarl.policy.nets import RunningMeanStd
from flexmarl.store.replay import ReplayTable
from flexmarl.training.algorithms import qmix, vdn


class VdnTrainer:
    def __init__(self, cfg: MarlRunConfig) -> None:
        if not isinstance(cfg.algorithm, VdnConfig):
            raise ConfigError("algorithm.name: VdnTrainer needs algorithm.name vdn or qmix")
        if not cfg.policy.share_parameters:
            raise ConfigError("policy.share_parameters: VDN here uses one Q-network shared "
                              "by all agents (agent id in its input); set it to true")
        if cfg.policy.network.kind != "mlp":
            raise ConfigError("policy.network.kind: VDN supports the mlp network only")
        self.cfg, self.algo = cfg, cfg.algorithm
        torch.set_num_threads(cfg.runtime.torch_threads)
        torch.manual_seed(cfg.seed)
        self.rng = np.random.default_rng(cfg.seed)
        self.venv = VecParallelEnv(cfg.env.id, cfg.env.options, cfg.env.num_envs, cfg.seed)
        self.venv.reset()
        self.agents = list(self.venv.agents)
        spec = group_spec(self.agents, self.venv.action_specs, cfg.env.id)
        if spec.kind != "discrete":
            raise ConfigError(f"algorithm.name: VDN needs discrete actions; {cfg.env.id} has "
                              f"{spec.kind} actions (use mappo or ippo)")
        self.n_actions = spec.nvec[0]
        self.obs_dim = max(self.venv.obs_specs[a].dim for a in self.agents)
        n = len(self.agents)
        self.q = vdn.QNet(self.obs_dim + n, self.n_actions, list(cfg.policy.network.hidden))
        self.q_target = copy.deepcopy(self.q)
        # QMIX: a mixing network of the global state in place of VDN's sum
        self.mixer: qmix.QMixer | None = None
        self.mixer_target: qmix.QMixer | None = None
        params = list(self.q.parameters())
        if self.algo.name == "qmix":
            state_dim = self.venv.state.shape[1]
            self.mixer = qmix.QMixer(n, state_dim, self.algo.mixing_embed,
                                     self.algo.hypernet_layers, self.algo.hypernet_embed)
            self.mixer_target = copy.deepcopy(self.mixer)
            params += list(self.mixer.parameters())
        self.params = params
        self.opt = torch.optim.Adam(params, lr=self.algo.lr)
        self.norm = RunningMeanStd(self.obs_dim) if cfg.policy.obs_norm else None
        a = self.algo
        self.replay = ReplayTable(a.capacity, a.min_size,
                                  a.priority_fraction if a.prioritized else 0.0,
                                  a.priority_alpha)
        self.updates = 0
        self.ids = torch.eye(n)

    def _joint(self, obs: dict[str, np.ndarray], masks: dict[str, np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray]:
        """[E, N, D] observations (zero-padded) and [E, N, A] action masks."""
        o = np.stack([np.pad(obs[a], ((0, 0), (0, self.obs_dim - obs[a].shape[1])))
                      for a in self.agents], 1)
        m = np.stack([np.pad(masks[a], ((0, 0), (0, self.n_actions - masks[a].shape[1])))
                      for a in self.agents], 1)
        return o.astype(np.float32), m.astype(bool)

    def _input(self, o: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            o = self.norm.normalize(o)
        ids = self.ids.expand(*o.shape[:-1], len(self.agents))
        return torch.cat([o, ids], -1)

    @torch.no_grad()
    def act(self, o: np.ndarray, m: np.ndarray, eps: float) -> np.ndarray:
        q = self.q(self._input(torch.from_numpy(o)), torch.from_numpy(m)).numpy()
        greedy = q.argmax(-1)
        rand = np.array([[self.rng.choice(np.flatnonzero(row)) for row in env] for env in m])
        explore = self.rng.random(greedy.shape) < eps
        return np.where(explore, rand, greedy)

    def learn(self, env_steps: int) -> dict[str, float]:
        b = self.replay.sample(self.algo.batch_size, env_steps, self.rng)
        d = {k: torch.from_numpy(v) for k, v in b.data.items()}
        with torch.no_grad():
            x_next = self._input(d["next_obs"])
            q_next, q_next_target = (self.q(x_next, d["next_mask"]),
                                     self.q_target(x_next, d["next_mask"]))
            if self.mixer_target is not None:
                targets = qmix.td_targets(q_next, q_next_target, d["reward"], d["done"],
                                          self.algo.gamma, self.mixer_target, d["next_state"])
            else:
                targets = vdn.td_targets(q_next, q_next_target, d["reward"], d["done"],
                                         self.algo.gamma)
        q = self.q(self._input(d["obs"]), d["mask"])
        w = torch.from_numpy(b.age_weight if self.algo.age_weight
                             else np.ones_like(b.age_weight)).float()
        if self.mixer is not None:
            loss, td = qmix.loss(q, d["actions"], targets, w, self.mixer, d["state"])
        else:
            loss, td = vdn.loss(q, d["actions"], targets, w)
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
        return {"loss/value": float(loss.detach()), "q_mean": float(q.detach().max(-1).values
                                                                   .mean()),
                "td_abs_mean": float(td.abs().mean()), "grad_norm": float(norm),
                "lr": self.algo.lr, "age_weight_mean": float(b.age_weight.mean())}

    def run(self, out: Path | None = None, on_iteration=None) -> MarlResult:
        cfg, venv = self.cfg, self.venv
        E, T = venv.num_envs, cfg.train.rollout_steps
        records: list[dict[str, Any]] = []
        episodes: list[dict[str, Any]] = []
        log = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            log = (out / "metrics.jsonl").open("w")
        start = time.perf_counter()
        env_steps, k = 0, 0
        sums: dict[str, float] = {}
        n_learn = 0
        t0 = time.perf_counter()
        try:
            while env_steps < cfg.train.env_steps:
                o, m = self._joint(venv.obs, venv.masks)
                s_now = venv.state.copy()
                eps = vdn.epsilon(env_steps, self.algo.eps_end, self.algo.eps_decay_steps)
                actions = self.act(o, m, eps)
                res = venv.step({a: actions[:, i:i + 1] for i, a in enumerate(self.agents)})
                env_steps += E
                ended = np.stack([res["done"][a] for a in self.agents], 1).any(axis=1, keepdims=True)
                next_src = {a: np.where(ended, res["final_obs"][a], venv.obs[a])
                            for a in self.agents}
                no, nm = self._joint(next_src, venv.masks)
                terminal = np.stack([res["done"][a] & ~res["truncated"][a]
                                     for a in self.agents], 1).all(1)
                reward = np.stack([res["reward"][a] for a in self.agents], 0).mean(axis=0)
                if self.norm is not None:
                    self.norm.update(torch.from_numpy(o))
                self.replay.add({"obs": o, "mask": m, "actions": actions.astype(np.int64),
                                 "reward": reward.astype(np.float32), "next_obs": no,
                                 "next_mask": nm, "done": np.asarray(terminal, dtype=np.float32),
                                 **({"state": s_now, "next_state": np.where(
                                     ended, res["final_state"], venv.state).astype(np.float32)}
                                    if self.mixer is not None else {})},
                                env_steps)
                if self.replay.ready:
                    for _ in range(self.algo.updates_per_step):
                        for key, v in self.learn(env_steps).items():
                            sums[key] = sums.get(key, 0.0) + v
                        n_learn += 1
                if env_steps % (E * T) == 0:
                    rec = self._record(k, env_steps, start, t0, sums, n_learn, eps)
                    eps_done = venv.pop_episodes()
                    self._episodes(rec, eps_done)
                    episodes += [{"iteration": k, "env_steps": env_steps,
                                  "returns": e.returns, **e.metrics} for e in eps_done]
                    records.append(rec)
                    if log is not None:
                        log.write(json.dumps(rec) + "\n")
                    if on_iteration is not None:
                        on_iteration(rec)
                    k, sums, n_learn, t0 = k + 1, {}, 0, time.perf_counter()
        finally:
            if log is not None:
                log.close()
        if out is not None:
            from safetensors.torch import save_file

            d = out / "checkpoints" / "final" / "shared"
            d.mkdir(parents=True, exist_ok=True)
            state = {f"q.{k}": v.contiguous() for k, v in self.q.state_dict().items()}
            if self.mixer is not None:
                state.update({f"mixer.{k}": v.contiguous()
                              for k, v in self.mixer.state_dict().items()})
            if self.norm is not None:
                state.update({f"obs_norm.{k}": v for k, v in self.norm.state_dict().items()})
            save_file(state, str(d / "model.safetensors"))
        return MarlResult(out, records, {}, {}, time.perf_counter() - start, env_steps,
                          episodes)

    def _record(self, k, env_steps, start, t0, sums, n_learn, eps) -> dict[str, Any]:
        now = time.perf_counter()
        E, T = self.venv.num_envs, self.cfg.train.rollout_steps
        rec: dict[str, Any] = {"iteration": k, "env_steps": env_steps, "wall_s": now - t0,
                               "time_s": now - start,
                               "env_steps_per_s": E * T / max(now - t0, 1e-9),
                               "replay/size": len(self.replay), "epsilon": eps}
        for key, v in sums.items():
            rec[f"agent/shared/{key}"] = v / max(n_learn, 1)
        return rec

    def _episodes(self, rec: dict[str, Any], eps) -> None:
        rec["episodes/total"] = len(eps)
        if eps:
            per_agent = {a: float(np.mean([e.returns[a] for e in eps])) for a in self.agents}
            rec["return_mean"] = float(np.mean(list(per_agent.values())))
            for key in eps[0].metrics:
                rec[f"task/{key}"] = float(np.mean([e.metrics[key] for e in eps]))


def train_vdn(cfg: MarlRunConfig, out: str | Path | None = None, on_iteration=None
              ) -> MarlResult:
    return VdnTrainer(cfg).run(Path(out) if out is not None else None, on_iteration)
