"""Which network serves which agents, and its sizes: decided once in the driver from the
environment's spaces, then handed to every rollout worker and training slot, so all of them
build the same networks without building an environment of their own.

Also the one definition of what the rollout records per step and what a learner trains on
(`COMPRESSED`, `MarlSample`), shared by both sides of the pipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexmarl.config.schema import RunConfig
from flexmarl.envs.pettingzoo import VecParallelEnv
from flexmarl.envs.spaces import ActionSpec
from flexmarl.errors import UserError
from flexmarl.policy.nets import NetConfigView, NetPolicy
from flexmarl.training.algorithms import ippo
from flexmarl.training.algorithms.mappo import MappoConfig
from flexmarl.training.policy_learner import MarlSample  # noqa: F401 - its home before

COMPRESSED = ("obs", "critic_x")  # the continuous payloads `store.compress_obs` compresses


class PolicyError(UserError, ValueError):
    """Agents that cannot share one network: names them and their spaces."""


@dataclass(frozen=True)
class PolicyLayout:
    """One policy: its agents (in order: their index is the agent id), input sizes, head."""

    name: str
    index: int  # position among the run's policies (seeds its initial weights)
    agents: tuple[str, ...]
    obs_dim: int
    critic_dim: int
    spec: ActionSpec


def group_spec(agents: list[str], specs: dict[str, ActionSpec], env_id: str) -> ActionSpec:
    """The action spec one shared network emits for `agents`: identical specs, or Discrete
    ones of different sizes padded to the largest (the extra actions masked per agent)."""
    first = specs[agents[0]]
    if all(specs[a] == first for a in agents):
        return first
    if all(specs[a].kind == "discrete" for a in agents):
        return ActionSpec("discrete", nvec=(max(specs[a].nvec[0] for a in agents),))
    raise PolicyError(f"agents.{agents[0]}.network.base: agents of env {env_id!r} sharing a "
                      f"network have different action spaces "
                      f"({', '.join(f'{a}: {specs[a].kind}' for a in agents)}); give each of "
                      "them a network of its own")


def pad(x: np.ndarray, dim: int) -> np.ndarray:
    if x.shape[-1] == dim:
        return x
    return np.concatenate([x, np.zeros((*x.shape[:-1], dim - x.shape[-1]), x.dtype)], -1)


def critic_x(algo: MappoConfig, agents: list[str], agent: str, obs_dim: int,
             obs: dict[str, np.ndarray], state: np.ndarray) -> np.ndarray:
    """[E, C] critic input of `agent` (MAPPO: state or concatenated observations; IPPO: own)."""
    return ippo.critic_features(algo.name, algo.critic_input, pad(obs[agent], obs_dim),
                                state, [obs[b] for b in agents]).astype(np.float32)


def layouts(cfg: RunConfig, venv: VecParallelEnv) -> dict[str, PolicyLayout]:
    """One policy per shared network (`networks:`) and per agent with a network of its own."""
    algo = cfg.env_algorithm
    if not isinstance(algo, MappoConfig):
        raise TypeError(f"the on-policy driver runs mappo/ippo, not {algo.name}")
    agents = list(venv.agents)
    groups = cfg.policy_groups(agents)
    out = {}
    for i, (name, members) in enumerate(groups.items()):
        spec = group_spec(members, venv.action_specs, cfg.environment.id)
        obs_dim = max(venv.obs_specs[a].dim for a in members)
        cdim = critic_x(algo, agents, members[0], obs_dim, venv.obs, venv.state).shape[-1]
        out[name] = PolicyLayout(name, i, tuple(members), obs_dim, cdim, spec)
    return out


def build_net(cfg: RunConfig, layout: PolicyLayout) -> NetPolicy:
    """The policy's network with its initial weights: the same in every process (seeded by
    the run's seed and the policy's index)."""
    n = cfg.network_of(layout.name)
    net = NetConfigView(n.kind, list(n.hidden), n.activation, n.gru_hidden,
                         n.layer_norm, n.orthogonal)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed * 1009 + layout.index)
        return NetPolicy(list(layout.agents), layout.obs_dim, layout.critic_dim, layout.spec,
                         net, n.obs_norm)
