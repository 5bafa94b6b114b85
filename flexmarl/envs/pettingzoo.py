"""PettingZoo environments as FlexMARL episodes (docs/design.md section 3, docs/marl.md).

- Parallel API: each environment step is one *round* of parallel agent nodes, one node per live
  agent (`{agent}@{t}`), each depending on the previous round (the environment's state). An
  agent that terminates or is truncated stops producing nodes; the episode ends when no agent
  is left.
- AEC API (PettingZoo's classic board games): a *chain of turns*, trained through the Parallel
  API: turn t is a node of `env.agent_selection`, depending on turn t-1, with optional
  built-in opponents (`turns.py`).
- `VecParallelEnv`: many Parallel environments of one id stepped as a batch, so that one policy
  forward pass covers all of them (auto-reset, per-episode returns and task metrics).

Environments are named by module path (`mpe2.simple_spread_v3`,
`pettingzoo.classic.tictactoe_v3`) or by a bare scenario name looked up in mpe2 and
PettingZoo's families; an unknown id is a UserError naming the config field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexmarl.envs.spaces import ActionSpec, EnvError, ObsSpec, action_spec, obs_spec
from flexmarl.envs.turns import TurnParallelEnv

FAMILIES = ("mpe2", "pettingzoo.classic", "pettingzoo.butterfly", "pettingzoo.sisl")


def env_module(env_id: str, field_name: str = "env.id"):
    """`mpe2.simple_spread_v3` or `simple_spread_v3` -> the module with env()/parallel_env()."""
    candidates = [env_id] if "." in env_id else [f"{fam}.{env_id}" for fam in FAMILIES]
    errors = []
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - a deprecated env raises on import/use
            raise EnvError(f"{field_name}: importing {name!r} raised {type(exc).__name__}: "
                           f"{exc}") from exc
        if hasattr(module, "parallel_env") or hasattr(module, "env"):
            return module
        errors.append(f"{name}: has no env() or parallel_env()")
    if env_id.startswith(("mpe2", "pettingzoo")) or "." not in env_id:
        hint = " (pip install 'flexmarl[marl]' for pettingzoo and mpe2)"
    else:
        hint = ""
    raise EnvError(f"{field_name}: unknown environment {env_id!r}{hint}; tried "
                   + "; ".join(errors))


def make_parallel(env_id: str, options: dict[str, Any] | None = None,
                  field_name: str = "env.id", opponents: dict[str, str] | None = None):
    """The Parallel environment; an AEC-only (turn-based) game as a chain of turns behind the
    Parallel API (`turns.TurnParallelEnv`), with `opponents` played inside it."""
    module = env_module(env_id, field_name)
    if not hasattr(module, "parallel_env"):
        return TurnParallelEnv(make_aec(env_id, options, field_name), env_id, opponents)
    if opponents:
        raise EnvError(f"env.opponents: {env_id} has a Parallel API, every agent acts at "
                       "every step; opponents are for turn-based (AEC-only) games")
    try:
        return module.parallel_env(**(options or {}))
    except TypeError as exc:
        raise EnvError(f"env.options: {env_id} rejected the options: {exc}") from exc


def make_aec(env_id: str, options: dict[str, Any] | None = None, field_name: str = "env.id"):
    module = env_module(env_id, field_name)
    try:
        return module.env(**(options or {}))
    except TypeError as exc:
        raise EnvError(f"env.options: {env_id} rejected the options: {exc}") from exc


def _specs(env, env_id: str) -> tuple[dict[str, ObsSpec], dict[str, ActionSpec]]:
    agents = list(env.possible_agents)
    return ({a: obs_spec(env.observation_space(a), env_id, a) for a in agents},
            {a: action_spec(env.action_space(a), env_id, a) for a in agents})


@dataclass
class StepResult:
    obs: dict[str, np.ndarray]
    masks: dict[str, np.ndarray | None]
    rewards: dict[str, float]
    terminated: dict[str, bool]
    truncated: dict[str, bool]
    left: list[str]  # agents that stopped producing nodes at this step
    done: bool  # no agent left


class _Adapter:
    """A PettingZoo environment with its agents' observation and action specs."""

    def __init__(self, env: Any, env_id: str) -> None:
        self.env = env
        self.env_id = env_id
        self.agents = list(env.possible_agents)
        self.obs_specs, self.action_specs = _specs(env, env_id)


class ParallelAdapter(_Adapter):
    """One Parallel environment as rounds of parallel nodes (see the module docstring)."""

    def __init__(self, env: Any, env_id: str) -> None:
        super().__init__(env, env_id)
        self.rounds: list[list[str]] = []  # node names per environment step of this episode
        self.live: list[str] = []

    def _encode(self, raw: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
        obs = {a: self.obs_specs[a].encode(o) for a, o in raw.items()}
        return obs, {a: ObsSpec.mask_of(o) for a, o in raw.items()}

    def reset(self, seed: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        raw, _ = self.env.reset(seed=seed)
        self.live = list(self.env.agents)
        self.rounds = []
        return self._encode(raw)

    def step(self, actions: dict[str, np.ndarray]) -> StepResult:
        """`actions` holds one stored action row per live agent (ActionSpec.to_env decodes)."""
        missing = [a for a in self.live if a not in actions]
        if missing:
            raise EnvError(f"env {self.env_id!r}: no action for live agent(s) {missing}")
        self.rounds.append([f"{a}@{len(self.rounds)}" for a in self.live])
        env_actions = {a: self.action_specs[a].to_env(np.asarray(actions[a]))
                       for a in self.live}
        raw, rew, term, trunc, _ = self.env.step(env_actions)
        obs, masks = self._encode(raw)
        before = self.live
        self.live = [a for a in self.env.agents]
        ended = {a for a in before if term.get(a, False) or trunc.get(a, False)}
        left = [a for a in before if a not in self.live or a in ended]
        self.live = [a for a in self.live if a not in ended]
        return StepResult(obs, masks, {a: float(r) for a, r in rew.items()},
                          {a: bool(v) for a, v in term.items()},
                          {a: bool(v) for a, v in trunc.items()}, left, not self.live)

    def state(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """The global state for a centralised critic; concatenated observations (zeros for
        agents that left) when the environment has no `state()`."""
        try:
            return np.asarray(self.env.state(), dtype=np.float32).reshape(-1)
        except (NotImplementedError, AttributeError):
            return np.concatenate([obs.get(a, np.zeros(self.obs_specs[a].dim, np.float32))
                                   for a in self.agents])


# --- task metrics ----------------------------------------------------------------------------
def _dist(a, b) -> float:
    return float(np.linalg.norm(a.state.p_pos - b.state.p_pos))


def _spread_metrics(raw) -> dict[str, float]:
    """Landmarks with an agent within 0.1 (mpe2's own `benchmark_data` definition)."""
    world = raw.world
    covered = sum(min(_dist(a, lm) for a in world.agents) < 0.1 for lm in world.landmarks)
    return {"landmarks_covered": float(covered)}


def _speaker_listener_metrics(raw) -> dict[str, float]:
    speaker = raw.world.agents[0]
    return {"final_distance": _dist(speaker.goal_a, speaker.goal_b)}


def _reference_metrics(raw) -> dict[str, float]:
    """Mean over agents of the distance from the other agent to the landmark it was shown."""
    return {"final_distance": float(np.mean([_dist(a.goal_a, a.goal_b)
                                             for a in raw.world.agents]))}


TASK_METRICS: dict[str, Callable[[Any], dict[str, float]]] = {
    "simple_spread": _spread_metrics,
    "simple_speaker_listener": _speaker_listener_metrics,
    "simple_reference": _reference_metrics,
}


def task_metric_fn(env_id: str) -> Callable[[Any], dict[str, float]] | None:
    scenario = env_id.rsplit(".", 1)[-1].rsplit("_v", 1)[0]
    return TASK_METRICS.get(scenario)


# --- vectorised environments -----------------------------------------------------------------
@dataclass
class Episode:
    returns: dict[str, float]
    length: int
    metrics: dict[str, float]


class VecParallelEnv:
    """`num_envs` Parallel environments of one id stepped together, arrays per agent.

    `step` takes one action array per agent ([E, action_shape]) and returns per agent obs
    [E, D], reward [E], done [E] (the agent's node chain ends here), truncated [E] and alive
    [E] (the agent produces a node at the *next* step). Ended environments reset at once;
    `final_obs` / `final_state` then hold each agent's last observation and the last global
    state, for bootstrapping a truncation.
    """

    def __init__(self, env_id: str, options: dict[str, Any], num_envs: int, seed: int,
                 opponents: dict[str, str] | None = None) -> None:
        if num_envs <= 0:
            raise EnvError(f"env.num_envs must be > 0, got {num_envs}")
        self.env_id = env_id
        self.envs = [ParallelAdapter(make_parallel(env_id, options, opponents=opponents),
                                     env_id)
                     for _ in range(num_envs)]
        first = self.envs[0]
        self.agents = first.agents
        self.obs_specs, self.action_specs = first.obs_specs, first.action_specs
        self.num_envs = num_envs
        self.seed = seed
        self._resets = 0
        self.metric_fn = task_metric_fn(env_id)
        self._returns = [dict.fromkeys(self.agents, 0.0) for _ in self.envs]
        self._lengths = [0] * num_envs
        self.episodes: list[Episode] = []
        self.obs = {a: np.zeros((num_envs, self.obs_specs[a].dim), np.float32)
                    for a in self.agents}
        self.masks = {a: np.ones((num_envs, self.action_specs[a].logits_dim), bool)
                      for a in self.agents}
        self.alive = {a: np.zeros(num_envs, bool) for a in self.agents}
        self.state = np.zeros((num_envs, 0), np.float32)
        self.env_steps = 0

    def _next_seed(self) -> int:
        self._resets += 1
        return self.seed * 1_000_003 + self._resets

    def _load(self, e: int, obs: dict[str, np.ndarray], masks: dict) -> None:
        env = self.envs[e]
        for a in self.agents:
            live = a in env.live
            self.alive[a][e] = live
            if a in obs:
                self.obs[a][e] = obs[a]
            elif not live:
                self.obs[a][e] = 0.0
            m = masks.get(a)
            self.masks[a][e] = m if m is not None else True
        state = env.state(obs)
        if self.state.shape[1] != state.shape[0]:
            self.state = np.zeros((self.num_envs, state.shape[0]), np.float32)
        self.state[e] = state

    def reset(self) -> None:
        for e, env in enumerate(self.envs):
            self._load(e, *env.reset(seed=self._next_seed()))

    def step(self, actions: dict[str, np.ndarray]) -> dict[str, Any]:
        n = self.num_envs
        out = {k: {a: np.zeros(n, np.float32 if k == "reward" else bool) for a in self.agents}
               for k in ("reward", "done", "truncated")}
        final_obs = {a: self.obs[a].copy() for a in self.agents}
        final_state = self.state.copy()
        for e, env in enumerate(self.envs):
            res = env.step({a: actions[a][e] for a in env.live})
            self._lengths[e] += 1
            for a, r in res.rewards.items():
                if a in out["reward"]:
                    out["reward"][a][e] = r
                    self._returns[e][a] += r
            for a in res.left:
                out["done"][a][e] = True
                out["truncated"][a][e] = res.truncated.get(a, False) and not \
                    res.terminated.get(a, False)
                if a in res.obs:
                    final_obs[a][e] = res.obs[a]
            if res.done:
                final_state[e] = env.state(res.obs)
                metrics = self.metric_fn(env.env.unwrapped) if self.metric_fn else {}
                self.episodes.append(Episode(dict(self._returns[e]), self._lengths[e], metrics))
                self._returns[e] = dict.fromkeys(self.agents, 0.0)
                self._lengths[e] = 0
                self._load(e, *env.reset(seed=self._next_seed()))
            else:
                self._load(e, res.obs, res.masks)
        self.env_steps += n
        return {**out, "final_obs": final_obs, "final_state": final_state}

    def pop_episodes(self) -> list[Episode]:
        eps, self.episodes = self.episodes, []
        return eps
