"""What a classic-MARL rollout worker computes: its `num_envs` environments stepped together
for `rollout_steps` steps with the published version of every policy (one forward pass per
policy covers every environment and every agent it serves), returned as one row payload per
(agent, environment) for the driver to put into the experience store.

It holds actor and critic copies only (the critic gives the rollout's values and the
truncation bootstrap); the learners are in the training slots. Worker `index` owns the
environments `index * num_envs ...`, seeded apart, so sample ids are unique across workers.
"""

from __future__ import annotations

import io
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flexmarl.config.schema import NetworkConfig, RunConfig
from flexmarl.envs.pettingzoo import EnvError, VecParallelEnv
from flexmarl.marl.policies import COMPRESSED, PolicyLayout, build_net, critic_x, pad
from flexmarl.policy.nets import NetPolicy
from flexmarl.store.compression import Codec
from flexmarl.training.algorithms.mappo import MappoConfig, ValueNorm

WORKER_SEED_STRIDE = 100_003  # worker i's environments are seeded at seed + i * stride


def _new(cls: Any) -> Any:
    return cls.__new__(cls)


def _set_dict(obj: Any, state: dict[str, Any]) -> None:
    obj.__dict__.update(state)


class _StatePickler(pickle.Pickler):
    """Pickles objects by their attributes even where the class pickles itself by its
    constructor arguments (gymnasium's / PettingZoo's `EzPickle`, which every MPE environment
    and wrapper uses): what is wanted is the environment's *state* (positions, velocities,
    step counter, its `np_random`), not a fresh environment of the same kind. Render
    resources (pygame surfaces, fonts) are not state: they are left out by reference and the
    live worker's own are put back on load."""

    def __init__(self, buf: io.BytesIO) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.external: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj).__module__.startswith("pygame"):
            self.external.append(obj)
            return len(self.external) - 1
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or not hasattr(obj, "_ezpickle_args"):
            return NotImplemented
        return _new, (type(obj),), dict(vars(obj)), None, None, _set_dict


def dump_state(obj: Any) -> tuple[bytes, list[Any]]:
    """`obj` pickled by attribute, and the render resources it refers to (in order)."""
    buf = io.BytesIO()
    pickler = _StatePickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.external


def load_state(blob: bytes, external: list[Any]) -> Any:
    """The inverse of `dump_state`, with `external` the live object's render resources (a
    structure like the pickled one has them in the same order)."""
    unpickler = pickle.Unpickler(io.BytesIO(blob))  # noqa: S301 - the run's own state
    unpickler.persistent_load = lambda pid: external[pid]  # type: ignore[method-assign]
    return unpickler.load()


def capture_worker_state(env_id: str, index: int, venv: Any, **extra: Any) -> bytes:
    """A rollout worker's state as one blob: its environments (by attribute) with `extra`
    (generators, hidden states); an environment that does not pickle is refused by name."""
    try:
        blob, _ = dump_state({"index": index, "venv": venv, **extra})
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise EnvError(
            f"env.id: the state of {env_id!r} cannot be captured ({exc}), so "
            "its rollout can be neither checkpointed nor redone after a lost worker; "
            "set runtime.max_worker_restarts=0 and leave train.checkpoint_every unset"
        ) from exc
    return blob


def restore_worker_state(blob: bytes, index: int, venv: Any) -> dict[str, Any]:
    """`capture_worker_state`'s fields, for worker `index` only, keeping the live worker's
    render resources (`venv`'s, in order)."""
    _, external = dump_state(venv)
    state = load_state(blob, external)
    if state["index"] != index:
        raise ValueError(f"rollout worker {index}: offered the environment state of "
                         f"worker {state['index']}")
    return state


@dataclass
class RolledRow:
    """One (agent, environment) row of an iteration: what the driver writes to the store."""

    agent: str
    env: int  # global environment index (worker * num_envs + local)
    agent_index: int  # within its policy
    payload: dict[str, np.ndarray]
    data: dict[str, Any]


@dataclass
class RolloutResult:
    rows: list[RolledRow]
    episodes: list[dict[str, Any]]  # returns, length, task metrics of episodes that ended
    payload_bytes: tuple[int, int]  # observation payloads: raw, as stored
    env_steps: int
    seconds: float
    state: bytes | None = None  # the worker's state after this iteration (`get_state`)


class _Actor:
    def __init__(self, layout: PolicyLayout, net: NetPolicy, num_envs: int, gru: int | None):
        self.layout = layout
        self.agents = list(layout.agents)
        self.net = net
        self.vnorm = ValueNorm()
        self.version = -1  # nothing loaded yet
        self.hidden = torch.zeros(num_envs * len(self.agents), gru) if gru else None


def split_weights(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Published weights: the network's state dict plus the value normaliser's (`vnorm.*`)."""
    net = {k: v for k, v in weights.items() if not k.startswith("vnorm.")}
    vn = {k[6:]: v for k, v in weights.items() if k.startswith("vnorm.")}
    return net, vn


def _gru(net: NetworkConfig) -> int | None:
    """The recurrent state's width of a GRU network (None: an MLP has none)."""
    return net.gru_hidden if net.kind == "gru" else None


class EnvRollout:
    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout], index: int = 0
                 ) -> None:
        assert isinstance(cfg.env_algorithm, MappoConfig)
        self.cfg, self.algo, self.index = cfg, cfg.env_algorithm, index
        env = cfg.environment
        E = env.num_envs
        self.venv = VecParallelEnv(env.id, env.options, E, cfg.seed + WORKER_SEED_STRIDE * index,
                                   env.opponents)
        self.venv.reset()
        self.agents = list(self.venv.agents)
        self.gen = torch.Generator().manual_seed(cfg.seed + WORKER_SEED_STRIDE * index)
        self.actors = {name: _Actor(lay, build_net(cfg, lay), E, _gru(cfg.network_of(name)))
                       for name, lay in layouts.items()}
        self.codec = Codec(cfg.store.zstd_level) if cfg.store.compress_obs else None
        self._start_flag = {a: np.ones(E, bool) for a in self.agents}

    def get_state(self) -> bytes:
        """Everything the next iteration's rollout depends on besides the weights: the
        environments (pickled by attribute: positions, velocities, step counters, their RNGs),
        the worker's action sampler, the GRU hidden states and episode-start flags. Restored
        by `set_state` into a worker of the same config, the next `run` is bit-identical."""
        hidden = {n: p.hidden for n, p in self.actors.items()}
        return capture_worker_state(self.cfg.environment.id, self.index, self.venv,
                                    gen=self.gen.get_state(), hidden=hidden,
                                    start_flag=self._start_flag)

    def set_state(self, blob: bytes) -> None:
        state = restore_worker_state(blob, self.index, self.venv)
        self.venv = state["venv"]
        self.gen.set_state(state["gen"])
        for name, h in state["hidden"].items():
            self.actors[name].hidden = h
        self._start_flag = state["start_flag"]

    def load(self, name: str, version: int, weights: dict[str, torch.Tensor]) -> None:
        actor = self.actors[name]
        net, vn = split_weights(weights)
        actor.net.load_state_dict(net)
        actor.vnorm.load_state_dict(vn)
        actor.version = version

    # --- inputs ------------------------------------------------------------------------------
    def _inputs(self, p: _Actor, obs=None, state=None) -> tuple[torch.Tensor, ...]:
        """Per policy: obs [E*n, D], critic input [E*n, C], agent ids [E*n], masks [E*n, L]."""
        venv, lay = self.venv, p.layout
        obs = venv.obs if obs is None else obs
        state = venv.state if state is None else state
        xs = [pad(obs[a], lay.obs_dim) for a in p.agents]
        cs = [critic_x(self.algo, self.agents, a, lay.obs_dim, obs, state) for a in p.agents]
        E = venv.num_envs
        masks = []
        for a in p.agents:
            m = venv.masks[a]
            if m.shape[1] != lay.spec.logits_dim:  # a padded discrete head: mask the extra
                m = np.concatenate([m, np.zeros((E, lay.spec.logits_dim - m.shape[1]), bool)], 1)
            masks.append(m)
        ids = np.repeat(np.arange(len(p.agents)), E)
        x, c = np.concatenate(xs), np.concatenate(cs)
        if self.codec is not None:  # act on what the store will hand the trainer
            x, c = x.astype(np.float16).astype(np.float32), c.astype(np.float16).astype(np.float32)
        return (torch.from_numpy(x), torch.from_numpy(c),
                torch.from_numpy(ids), torch.from_numpy(np.concatenate(masks)))

    # --- one iteration -----------------------------------------------------------------------
    @torch.no_grad()
    def run(self, k: int) -> RolloutResult:
        """Iteration k's steps with version k of every policy."""
        for name, actor in self.actors.items():
            if actor.version != k:
                raise RuntimeError(f"rollout worker {self.index}: policy {name!r} holds "
                                   f"version {actor.version}, iteration {k} needs version {k}")
        t0 = time.perf_counter()
        venv = self.venv
        E, T = venv.num_envs, self.cfg.train.rollout_steps
        buf: dict[str, dict[str, list]] = {a: defaultdict(list) for a in self.agents}
        h0 = {name: (p.hidden.clone() if p.hidden is not None else None)
              for name, p in self.actors.items()}
        for _ in range(T):
            actions: dict[str, np.ndarray] = {}
            for p in self.actors.values():
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
                reward = res["reward"][a] + self.algo.gamma * boot[a] * res["truncated"][a]
                b["rewards"].append(reward.astype(np.float32))
                b["dones"].append(res["done"][a])
                alive_now = b["alive"][-1]
                self._start_flag[a] = res["done"][a] | (self._start_flag[a] & ~alive_now)
        last = {}
        for p in self.actors.values():
            _, cx, ids, _ = self._inputs(p)
            v = p.net.value(cx, ids).numpy()
            for i, a in enumerate(p.agents):
                last[a] = v[i * E:(i + 1) * E]
        rows, nbytes = self._rows(buf, last, h0)
        episodes = [{"returns": e.returns, "length": e.length, **e.metrics}
                    for e in venv.pop_episodes()]
        return RolloutResult(rows, episodes, nbytes, E * T, time.perf_counter() - t0)

    def _truncation_values(self, res: dict[str, Any]) -> dict[str, np.ndarray]:
        """V(final state) of chains cut by a time limit, unnormalised, for bootstrapping."""
        out = {a: np.zeros(self.venv.num_envs, np.float32) for a in self.agents}
        if not any(res["truncated"][a].any() for a in self.agents):
            return out
        E = self.venv.num_envs
        for p in self.actors.values():
            _, cx, ids, _ = self._inputs(p, res["final_obs"], res["final_state"])
            v = p.net.value(cx, ids)
            if self.algo.value_norm:
                v = p.vnorm.denormalize(v)
            for i, a in enumerate(p.agents):
                out[a] = v[i * E:(i + 1) * E].numpy()
        return out

    def _rows(self, buf, last, h0) -> tuple[list[RolledRow], tuple[int, int]]:
        E = self.venv.num_envs
        raw = stored = 0
        rows = []
        for a in self.agents:
            arrays = {name: np.stack(vals) for name, vals in buf[a].items()}  # [T, E, ...]
            p = next(p for p in self.actors.values() if a in p.agents)
            col = p.agents.index(a)
            for e in range(E):
                payload = {name: np.ascontiguousarray(arr[:, e]) for name, arr in arrays.items()}
                payload["last_value"] = np.asarray(last[a][e], np.float32)
                h = h0[p.layout.name]
                if h is not None:
                    payload["h0"] = h[col * E + e].numpy()
                data: dict[str, Any] = {"env": self.index * E + e, "agent_index": col}
                for name in COMPRESSED:
                    raw += payload[name].nbytes
                    if self.codec is not None:
                        payload[name], header = self.codec.encode(
                            payload[name], f"agent {a!r}: {name}")
                        data.setdefault("codec", {})[name] = header
                    stored += payload[name].nbytes
                rows.append(RolledRow(a, self.index * E + e, col, payload, data))
        return rows, (raw, stored)
