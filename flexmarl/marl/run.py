"""The classic MARL driver: vectorised PettingZoo rollout -> experience store -> MAPPO / IPPO.

Iteration k (the sync pipeline of docs/design.md section 5):
1. rollout: `num_envs` environments stepped together for `rollout_steps` steps; at each step
   one forward pass per policy covers every environment and every agent it serves. Every agent
   acts with version k of its policy (the version vector of iteration k);
2. one row per (agent, environment) goes into the agent's table of the `ExperienceStore`:
   sample_id `{k}-{env}_{agent index}_0`, policy_version k, the version vector, the step
   arrays by reference; rows become ready when the chain's rewards are in;
3. each policy takes its agents' ready rows of version k for step k (the store checks the
   iteration, the version and the vector, and hands each row out exactly once), computes GAE
   and runs `epochs` x `minibatches` PPO steps on exactly those rows; the audit trail records
   (sample_id, version, step, epoch) for each row in each epoch; the rows are released and
   evicted and the policy becomes version k+1 (its observation statistics too).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.envs.spaces import ActionSpec
from flexmarl.errors import UserError
from flexmarl.marl.config import MappoConfig, MarlRunConfig
from flexmarl.policy.nets import NetConfigView, NetPolicy
from flexmarl.store.compression import Codec
from flexmarl.store.experience import ExperienceStore, Row, make_sample_id
from flexmarl.training.algorithms import ippo, mappo

COMPRESSED = ("obs", "critic_x")  # the continuous payloads `store.compress_obs` compresses


class PolicyError(UserError, ValueError):
    """Agents that cannot share one network: names them and their spaces."""


@dataclass
class PolicyState:
    name: str
    agents: list[str]
    net: NetPolicy
    spec: ActionSpec
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer
    vnorm: mappo.ValueNorm
    hidden: torch.Tensor | None  # [E * len(agents), H], carried across iterations


@dataclass
class MarlResult:
    out_dir: Path | None
    records: list[dict[str, Any]]
    audit: dict[str, list[tuple[str, int, int, int]]]
    store_stats: dict[str, dict[str, int]]
    wall_s: float
    env_steps: int
    episodes: list[dict[str, Any]] = field(default_factory=list)


def _group_spec(agents: list[str], specs: dict[str, ActionSpec], env_id: str) -> ActionSpec:
    """The action spec one shared network emits for `agents`: identical specs, or Discrete
    ones of different sizes padded to the largest (the extra actions masked per agent)."""
    first = specs[agents[0]]
    if all(specs[a] == first for a in agents):
        return first
    if all(specs[a].kind == "discrete" for a in agents):
        return ActionSpec("discrete", nvec=(max(specs[a].nvec[0] for a in agents),))
    raise PolicyError(f"policy.share_parameters: agents of env {env_id!r} have different "
                      f"action spaces ({', '.join(f'{a}: {specs[a].kind}' for a in agents)}); "
                      "set policy.share_parameters: false")


class MarlTrainer:
    """Builds the environments, policies and store of a run and drives its iterations."""

    def __init__(self, cfg: MarlRunConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.runtime.torch_threads)
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.venv = VecParallelEnv(cfg.env.id, cfg.env.options, cfg.env.num_envs, cfg.seed)
        self.venv.reset()
        self.agents = list(self.venv.agents)
        E = self.venv.num_envs
        groups = ({"shared": self.agents} if cfg.policy.share_parameters
                  else {a: [a] for a in self.agents})
        net = NetConfigView(cfg.policy.network.kind, list(cfg.policy.network.hidden),
                            cfg.policy.network.activation, cfg.policy.network.gru_hidden)
        algo = cfg.algorithm
        if not isinstance(algo, MappoConfig):  # vdn runs in marl/offpolicy.py
            raise TypeError(f"the on-policy driver runs mappo/ippo, not {algo.name}")
        self.algo = algo
        self.policy_of: dict[str, str] = {}
        self.policies: dict[str, PolicyState] = {}
        for name, agents in groups.items():
            spec = _group_spec(agents, self.venv.action_specs, cfg.env.id)
            obs_dim = max(self.venv.obs_specs[a].dim for a in agents)
            critic_dim = self._critic_x(agents[0], obs_dim).shape[-1]
            policy = NetPolicy(agents, obs_dim, critic_dim, spec, net, cfg.policy.obs_norm)
            actor_params = list(policy.actor.parameters())
            hidden = (torch.zeros(E * len(agents), net.gru_hidden) if net.kind == "gru"
                      else None)
            self.policies[name] = PolicyState(
                name, agents, policy, spec,
                torch.optim.Adam(actor_params, lr=algo.lr, eps=algo.adam_eps),
                torch.optim.Adam(policy.critic.parameters(), lr=algo.critic_lr,
                                 eps=algo.adam_eps),
                mappo.ValueNorm(), hidden)
            for a in agents:
                self.policy_of[a] = name
        self.store = ExperienceStore(self.agents)
        self.codec = Codec(cfg.store.zstd_level) if cfg.store.compress_obs else None
        self.payload_bytes = [0, 0]  # observation payloads: raw, as stored (this iteration)
        self.version = 0
        self.audit: dict[str, list[tuple[str, int, int, int]]] = defaultdict(list)
        self._start_flag = {a: np.ones(E, bool) for a in self.agents}

    # --- inputs ------------------------------------------------------------------------------
    def _pad(self, x: np.ndarray, dim: int) -> np.ndarray:
        if x.shape[-1] == dim:
            return x
        return np.concatenate([x, np.zeros((*x.shape[:-1], dim - x.shape[-1]), x.dtype)], -1)

    def _critic_x(self, agent: str, obs_dim: int, obs: dict[str, np.ndarray] | None = None,
                  state: np.ndarray | None = None) -> np.ndarray:
        obs = self.venv.obs if obs is None else obs
        state = self.venv.state if state is None else state
        a = self.algo
        return ippo.critic_features(a.name, a.critic_input, self._pad(obs[agent], obs_dim),
                                    state, [obs[b] for b in self.agents]).astype(np.float32)

    def _inputs(self, p: PolicyState, obs=None, state=None) -> tuple[torch.Tensor, ...]:
        """Per policy: obs [E*n, D], critic input [E*n, C], agent ids [E*n], masks [E*n, L]."""
        d = p.net.obs_dim
        source = self.venv.obs if obs is None else obs
        xs = [self._pad(source[a], d) for a in p.agents]
        cs = [self._critic_x(a, d, obs, state) for a in p.agents]
        E = self.venv.num_envs
        masks = []
        for a in p.agents:
            m = self.venv.masks[a]
            if m.shape[1] != p.spec.logits_dim:  # a padded discrete head: mask the extra
                m = np.concatenate([m, np.zeros((E, p.spec.logits_dim - m.shape[1]), bool)], 1)
            masks.append(m)
        ids = np.repeat(np.arange(len(p.agents)), E)
        x, c = np.concatenate(xs), np.concatenate(cs)
        if self.codec is not None:  # act on what the store will hand the trainer
            x, c = x.astype(np.float16).astype(np.float32), c.astype(np.float16).astype(np.float32)
        return (torch.from_numpy(x), torch.from_numpy(c),
                torch.from_numpy(ids), torch.from_numpy(np.concatenate(masks)))

    # --- rollout -----------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, k: int) -> None:
        """Iteration k's steps, written to the store as one row per (agent, environment)."""
        cfg, venv = self.cfg, self.venv
        E, T = venv.num_envs, cfg.train.rollout_steps
        buf: dict[str, dict[str, list]] = {a: defaultdict(list) for a in self.agents}
        h0 = {name: (p.hidden.clone() if p.hidden is not None else None)
              for name, p in self.policies.items()}
        for _ in range(T):
            actions: dict[str, np.ndarray] = {}
            for p in self.policies.values():
                obs, cx, ids, masks = self._inputs(p)
                starts = torch.from_numpy(np.concatenate([self._start_flag[a]
                                                          for a in p.agents]))
                out, p.hidden = p.net.actor.step(p.net.actor_input(obs, ids), p.hidden, starts)
                dist = p.net.actor.dist(out, masks)
                act = dist.sample(self.gen)
                logp = dist.log_prob(act)
                value = p.net.value(cx, ids)
                for i, a in enumerate(p.agents):
                    cols = slice(i * E, (i + 1) * E)
                    b = buf[a]
                    b["obs"].append(obs[cols].numpy())
                    b["critic_x"].append(cx[cols].numpy())
                    b["actions"].append(act[cols].numpy())
                    b["mask"].append(masks[cols].numpy())
                    b["logp"].append(logp[cols].numpy())
                    b["values"].append(value[cols].numpy())
                    b["starts"].append(starts[cols].numpy())
                    b["alive"].append(venv.alive[a].copy())
                    actions[a] = act[cols].numpy()
            res = venv.step(actions)
            boot = self._truncation_values(res)
            for a in self.agents:
                b = buf[a]
                reward = res["reward"][a] + cfg.algorithm.gamma * boot[a] * res["truncated"][a]
                b["rewards"].append(reward.astype(np.float32))
                b["dones"].append(res["done"][a])
                alive_now = b["alive"][-1]
                self._start_flag[a] = res["done"][a] | (self._start_flag[a] & ~alive_now)
        last = {}
        for p in self.policies.values():
            _, cx, ids, _ = self._inputs(p)
            v = p.net.value(cx, ids).numpy()
            for i, a in enumerate(p.agents):
                last[a] = v[i * E:(i + 1) * E]
        self._write_rows(k, buf, last, h0)

    def _truncation_values(self, res: dict[str, Any]) -> dict[str, np.ndarray]:
        """V(final state) of chains cut by a time limit, unnormalised, for bootstrapping."""
        out = {a: np.zeros(self.venv.num_envs, np.float32) for a in self.agents}
        if not any(res["truncated"][a].any() for a in self.agents):
            return out
        for p in self.policies.values():
            _, cx, ids, _ = self._inputs(p, res["final_obs"], res["final_state"])
            v = p.net.value(cx, ids)
            if self.algo.value_norm:
                v = p.vnorm.denormalize(v)
            E = self.venv.num_envs
            for i, a in enumerate(p.agents):
                out[a] = v[i * E:(i + 1) * E].numpy()
        return out

    def _write_rows(self, k: int, buf, last, h0) -> None:
        vector = dict.fromkeys(self.agents, k)
        E = self.venv.num_envs
        for ai, a in enumerate(self.agents):
            arrays = {name: np.stack(vals) for name, vals in buf[a].items()}  # [T, E, ...]
            p = self.policies[self.policy_of[a]]
            col = p.agents.index(a)
            for e in range(E):
                sid = make_sample_id(f"{k}-{e}", ai, 0)
                self.store.add(Row(sample_id=sid, agent=a, node=a, input_id=f"{k}-{e}",
                                   turn=ai, trajectory_id=0, iteration=k, policy_version=k,
                                   version_vector=vector))
                payload = {name: arr[:, e] for name, arr in arrays.items()}
                payload["last_value"] = np.asarray(last[a][e], np.float32)
                if h0[p.name] is not None:
                    payload["h0"] = h0[p.name][col * E + e].numpy()
                data: dict[str, Any] = {"env": e, "agent_index": col}
                for name in COMPRESSED:
                    self.payload_bytes[0] += payload[name].nbytes
                    if self.codec is not None:
                        payload[name], header = self.codec.encode(
                            payload[name], f"agent {a!r}: {name}")
                        data.setdefault("codec", {})[name] = header
                    self.payload_bytes[1] += payload[name].nbytes
                self.store.set_generated(a, sid, data, payload)
                self.store.set_rewarded(a, sid, float(payload["rewards"].sum()))
                # per-step advantages come from GAE in the trainer (they need the critic's
                # value normaliser of this version); the row's scalar is its summed reward
                self.store.set_ready(a, sid, float(payload["rewards"].sum()))

    # --- training ----------------------------------------------------------------------------
    def _batch(self, p: PolicyState, k: int) -> tuple[mappo.PolicyBatch, list[Row]]:
        """Policy p's rows of iteration k, taken from the store once for step k."""
        rows: list[Row] = []
        vector = dict.fromkeys(self.agents, k)
        for a in p.agents:
            rows += self.store.take_ready(a, k, self.venv.num_envs, k, expected_vector=vector)
        def f(row: Row, name: str) -> np.ndarray:
            header = row.data.get("codec", {}).get(name)
            array = self.store.fetch(row, name)
            return Codec.decode(array, header) if header is not None else array

        def stack(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.from_numpy(np.stack([f(r, name) for r in rows], 1)).to(dtype)

        batch = mappo.PolicyBatch(
            sample_ids=[r.sample_id for r in rows], iteration=k,
            obs=stack("obs"), critic_x=stack("critic_x"),
            agent_ids=torch.tensor([r.data["agent_index"] for r in rows]),
            actions=stack("actions"), action_mask=stack("mask", torch.bool),
            logp=stack("logp"), values=stack("values"), rewards=stack("rewards"),
            dones=stack("dones"), alive=stack("alive"), starts=stack("starts", torch.bool),
            h0=(torch.from_numpy(np.stack([f(r, "h0") for r in rows]))
                if p.hidden is not None else None),
            last_values=torch.from_numpy(np.concatenate([f(r, "last_value").reshape(-1) for r in rows])),
        )
        return batch, rows

    def train_step(self, k: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for p in self.policies.values():
            batch, rows = self._batch(p, k)
            if batch.iteration != k or any(r.iteration != k for r in rows):
                raise AssertionError("a step must train on its own iteration's rows only")
            mappo.compute_advantages(batch, p.vnorm, self.algo)

            def on_epoch(epoch: int, ids: list[str], name: str = p.name) -> None:
                self.audit[name].extend((sid, k, k, epoch) for sid in ids)

            m = mappo.update(p.net, p.actor_opt, p.critic_opt, batch, p.vnorm,
                             self.algo, self.gen, on_epoch)
            live = batch.alive.bool()
            p.net.update_stats(batch.obs[live], batch.critic_x[live])  # version k+1's
            self.store.release(rows)
            for a in p.agents:
                self.store.evict(a, k)
            for key, value in m.items():
                metrics[f"agent/{p.name}/{key}"] = value
        self.version = k + 1
        return metrics

    # --- the run -----------------------------------------------------------------------------
    def run(self, out: Path | None = None, on_iteration=None,
            iterations: int | None = None) -> MarlResult:
        cfg = self.cfg
        n_iter = iterations if iterations is not None else cfg.iterations
        log = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            log = (out / "metrics.jsonl").open("w")
        records: list[dict[str, Any]] = []
        episodes: list[dict[str, Any]] = []
        start = time.perf_counter()
        try:
            for k in range(n_iter):
                t0 = time.perf_counter()
                self.rollout(k)
                t1 = time.perf_counter()
                metrics = self.train_step(k)
                t2 = time.perf_counter()
                eps = self.venv.pop_episodes()
                rec = self._record(k, eps, t0, t1, t2, start)
                rec.update(metrics)
                episodes += [{"iteration": k, "env_steps": rec["env_steps"],
                              "returns": e.returns, "length": e.length, **e.metrics}
                             for e in eps]
                records.append(rec)
                if log is not None:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if on_iteration is not None:
                    on_iteration(rec)
        finally:
            if log is not None:
                log.close()
        if out is not None:
            self.save(out / "checkpoints" / "final")
        return MarlResult(out, records, dict(self.audit), self.store.stats(),
                          time.perf_counter() - start, self.venv.env_steps, episodes)

    def _record(self, k: int, eps, t0: float, t1: float, t2: float, start: float
                ) -> dict[str, Any]:
        E, T = self.venv.num_envs, self.cfg.train.rollout_steps
        rec: dict[str, Any] = {
            "iteration": k, "env_steps": (k + 1) * E * T, "wall_s": t2 - t0,
            "time_s": t2 - start, "rollout_s": t1 - t0, "train_s": t2 - t1,
            "rollout/env_steps_per_s": E * T / max(t1 - t0, 1e-9),
            "env_steps_per_s": E * T / max(t2 - t0, 1e-9), "episodes/total": len(eps),
            "store/obs_bytes_raw": self.payload_bytes[0],
            "store/obs_bytes_stored": self.payload_bytes[1],
            "store/obs_bytes_saved_frac": 1 - self.payload_bytes[1] / max(self.payload_bytes[0], 1),
        }
        self.payload_bytes = [0, 0]
        if eps:
            per_agent = {a: float(np.mean([e.returns[a] for e in eps])) for a in self.agents}
            for a, v in per_agent.items():
                rec[f"agent/{a}/return_mean"] = v
            rec["return_mean"] = float(np.mean(list(per_agent.values())))
            for key in eps[0].metrics:
                rec[f"task/{key}"] = float(np.mean([e.metrics[key] for e in eps]))
        return rec

    def save(self, directory: Path) -> dict[str, Path]:
        from safetensors.torch import save_file

        paths = {}
        for name, p in self.policies.items():
            d = directory / name
            d.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().clone().contiguous() for k, v in p.net.state_dict().items()}
            state.update({f"vnorm.{k}": v.clone() for k, v in p.vnorm.state_dict().items()})
            save_file(state, str(d / "model.safetensors"))
            paths[name] = d
        return paths


def train_marl(cfg: MarlRunConfig, out: str | Path | None = None, on_iteration=None,
               iterations: int | None = None) -> MarlResult:
    """Train a classic MARL run; writes metrics.jsonl, config.yaml, checkpoints under `out`."""
    trainer = MarlTrainer(cfg)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        import yaml

        out_path.mkdir(parents=True, exist_ok=True)
        (out_path / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    result = trainer.run(out_path, on_iteration, iterations)
    if out_path is not None:
        (out_path / "summary.json").write_text(json.dumps({
            "status": "completed", "iterations": len(result.records),
            "env_steps": result.env_steps, "wall_s": result.wall_s,
            "final_return_mean": result.records[-1].get("return_mean")
            if result.records else None}, indent=2))
    return result
