"""Gymnasium spaces -> flat float vectors and action specs a policy network can use.

Supported observations: Box (flattened), Discrete (one-hot), MultiDiscrete (concatenated
one-hots), and a Dict holding "observation" plus an "action_mask" (PettingZoo's classic games).
Supported actions: Discrete (with an optional mask), MultiDiscrete, Box (diagonal Gaussian).
Anything else is a UserError naming the environment, the agent and the space, before any
network is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexmarl.errors import UserError


class EnvError(UserError, ValueError):
    """An environment that cannot be built or driven: names the field, env id or agent."""


class SpaceError(UserError, ValueError):
    """A space the adapters cannot encode: names the env, agent and space."""


@dataclass(frozen=True)
class ObsSpec:
    """How one agent's raw observation becomes a float vector (and where its mask is)."""

    kind: str  # box | discrete | multi_discrete | dict_masked
    dim: int
    inner: ObsSpec | None = None  # dict_masked: the spec of the "observation" entry
    nvec: tuple[int, ...] = ()

    def encode(self, obs) -> np.ndarray:
        if self.kind == "box":
            return np.asarray(obs, dtype=np.float32).reshape(-1)
        if self.kind == "discrete":
            out = np.zeros(self.dim, np.float32)
            out[int(obs)] = 1.0
            return out
        if self.kind == "multi_discrete":
            out = np.zeros(self.dim, np.float32)
            offset = 0
            for n, v in zip(self.nvec, np.asarray(obs).reshape(-1), strict=True):
                out[offset + int(v)] = 1.0
                offset += n
            return out
        assert self.inner is not None
        return self.inner.encode(obs["observation"])

    @staticmethod
    def mask_of(obs) -> np.ndarray | None:
        """The action mask PettingZoo's classic envs put in the observation dict."""
        if isinstance(obs, dict) and "action_mask" in obs:
            return np.asarray(obs["action_mask"], dtype=bool)
        return None


@dataclass(frozen=True)
class ActionSpec:
    """What the policy head emits: categorical logits over `nvec` (one or several), or a
    diagonal Gaussian of `dim` clipped to [low, high] at the environment."""

    kind: str  # discrete | multi_discrete | box
    nvec: tuple[int, ...] = ()
    dim: int = 0
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    @property
    def logits_dim(self) -> int:
        return sum(self.nvec) if self.kind != "box" else self.dim

    def to_env(self, action: np.ndarray):
        """A stored action row -> what `env.step` takes."""
        if self.kind == "discrete":
            return int(action[0])
        if self.kind == "multi_discrete":
            return action.astype(np.int64)
        return np.clip(action, self.low, self.high).astype(np.float32)


def obs_spec(space, env_id: str, agent: str) -> ObsSpec:
    from gymnasium import spaces  # optional dependency: the optional `marl` extra

    where = f"env {env_id!r}, agent {agent!r}"
    if isinstance(space, spaces.Box):
        if not np.issubdtype(space.dtype, np.number):
            raise SpaceError(f"{where}: observation Box of dtype {space.dtype} is not numeric")
        return ObsSpec("box", int(np.prod(space.shape)))
    if isinstance(space, spaces.Discrete):
        return ObsSpec("discrete", int(space.n))
    if isinstance(space, spaces.MultiDiscrete):
        nvec = tuple(int(n) for n in np.asarray(space.nvec).reshape(-1))
        return ObsSpec("multi_discrete", sum(nvec), nvec=nvec)
    if isinstance(space, spaces.Dict) and "observation" in space.spaces:
        extra = set(space.spaces) - {"observation", "action_mask"}
        if extra:
            raise SpaceError(f"{where}: observation Dict with keys {sorted(extra)} is not "
                             "supported (only 'observation' and 'action_mask')")
        inner = obs_spec(space.spaces["observation"], env_id, agent)
        return ObsSpec("dict_masked", inner.dim, inner=inner)
    raise SpaceError(f"{where}: observation space {space} is not supported "
                     "(Box, Discrete, MultiDiscrete, or Dict(observation, action_mask))")


def action_spec(space, env_id: str, agent: str) -> ActionSpec:
    from gymnasium import spaces  # optional dependency: the optional `marl` extra

    where = f"env {env_id!r}, agent {agent!r}"
    if isinstance(space, spaces.Discrete):
        if int(space.start) != 0:
            raise SpaceError(f"{where}: Discrete action space starting at {space.start} is "
                             "not supported (start must be 0)")
        return ActionSpec("discrete", nvec=(int(space.n),))
    if isinstance(space, spaces.MultiDiscrete):
        return ActionSpec("multi_discrete",
                          nvec=tuple(int(n) for n in np.asarray(space.nvec).reshape(-1)))
    if isinstance(space, spaces.Box):
        if len(space.shape) != 1:
            raise SpaceError(f"{where}: action Box of shape {space.shape} is not supported "
                             "(a flat vector only)")
        low, high = np.asarray(space.low, float), np.asarray(space.high, float)
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise SpaceError(f"{where}: action Box with infinite bounds is not supported")
        return ActionSpec("box", dim=int(space.shape[0]), low=tuple(low), high=tuple(high))
    raise SpaceError(f"{where}: action space {space} is not supported "
                     "(Discrete, MultiDiscrete or Box)")
