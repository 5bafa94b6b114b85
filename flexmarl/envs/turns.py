"""AEC-only (turn-based) games behind the Parallel API, so MAPPO / IPPO train them through the
same vectorised rollout: PettingZoo's classic games (tictactoe_v3, connect_four_v3, ...) have
`env()` only.

One parallel step is one turn of a trained agent (the AEC API's chain of turns):
- every trained agent gets its observation at every step, so its chain (GAE, the critic) runs
  through the other agents' turns; the agent whose turn it is gets the game's action mask,
  the others a mask that allows action 0 only: a forced pass that is ignored, whose log-prob
  is 0 and whose entropy is 0, so it adds nothing to the policy's gradient (masks are
  respected in sampling and in the loss by the masked categorical head);
- `opponents` (`env.opponents` in a run config: agent -> "random") are played inside the
  wrapper by a uniform random legal move after each trained turn, so a run can train one
  side against a random opponent; they are not agents of the run;
- each step's reward of an agent is the sum of the game's rewards to it since its previous
  step (the opponents' replies included); the game's end ends every agent's chain.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexmarl.envs.spaces import EnvError

OPPONENT_KINDS = ("random",)


class TurnParallelEnv:
    """A PettingZoo AEC environment as a Parallel one (see the module docstring)."""

    def __init__(self, aec: Any, env_id: str, opponents: dict[str, str] | None = None) -> None:
        opponents = dict(opponents or {})
        every = list(aec.possible_agents)
        for agent, kind in opponents.items():
            if agent not in every:
                raise EnvError(f"env.opponents: {env_id} has no agent {agent!r} "
                               f"(agents: {', '.join(every)})")
            if kind not in OPPONENT_KINDS:
                raise EnvError(f"env.opponents.{agent}: unknown opponent {kind!r} "
                               f"(known: {', '.join(OPPONENT_KINDS)})")
        self.aec, self.env_id = aec, env_id
        self.opponents = opponents
        self.possible_agents = [a for a in every if a not in opponents]
        if not self.possible_agents:
            raise EnvError(f"env.opponents: every agent of {env_id} is an opponent; leave at "
                           "least one to train")
        self.agents: list[str] = []
        self.rng = np.random.default_rng(0)
        self._acc: dict[str, float] = {}

    def observation_space(self, agent: str) -> Any:
        return self.aec.observation_space(agent)

    def action_space(self, agent: str) -> Any:
        return self.aec.action_space(agent)

    def _collect(self) -> None:
        for a, r in self.aec.rewards.items():
            if a in self._acc:
                self._acc[a] += float(r)

    def _over(self) -> bool:
        aec = self.aec
        return not aec.agents or all(aec.terminations.get(a, False)
                                     or aec.truncations.get(a, False) for a in aec.agents)

    def _advance(self) -> None:
        """Play dead agents' `None` steps and the opponents' turns until a trained agent's
        turn or the game's end."""
        aec = self.aec
        while not self._over():
            agent = aec.agent_selection
            if aec.terminations.get(agent, False) or aec.truncations.get(agent, False):
                aec.step(None)  # PettingZoo: a dead agent is stepped with None (no reward)
                continue
            if agent not in self.opponents:
                return
            mask = np.asarray(aec.observe(agent)["action_mask"], bool)
            aec.step(int(self.rng.choice(np.flatnonzero(mask))))
            self._collect()

    def _observe(self, agents: list[str]) -> dict[str, Any]:
        turn = self.aec.agent_selection
        out = {}
        for a in agents:
            o = self.aec.observe(a)
            if a != turn and isinstance(o, dict) and "action_mask" in o:
                forced = np.zeros_like(o["action_mask"])
                forced[0] = 1
                o = {**o, "action_mask": forced}
            out[a] = o
        return out

    def reset(self, seed: int | None = None, options: dict | None = None
              ) -> tuple[dict[str, Any], dict[str, dict]]:
        self.aec.reset(seed=seed, options=options)
        self.rng = np.random.default_rng(seed)
        self._acc = dict.fromkeys(self.possible_agents, 0.0)
        self._advance()
        self.agents = [] if self._over() else [a for a in self.possible_agents
                                                 if a in self.aec.agents]
        return self._observe(self.agents), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        """`actions` holds an action for every live agent; only the one whose turn it is
        plays (the others' forced passes are ignored)."""
        aec = self.aec
        turn = aec.agent_selection
        before = list(self.agents)
        aec.step(int(np.asarray(actions[turn]).reshape(-1)[0]))
        self._collect()
        self._advance()
        over = self._over()
        term = {a: bool(aec.terminations.get(a, a not in aec.agents)) for a in before}
        trunc = {a: bool(aec.truncations.get(a, False)) for a in before}
        if over:  # the game's end ends every chain (a truncation stays one)
            term = {a: term[a] or not trunc[a] for a in before}
        self.agents = [] if over else [a for a in before if not (term[a] or trunc[a])]
        rewards = {a: self._acc[a] for a in before}
        self._acc = dict.fromkeys(self.possible_agents, 0.0)
        return (self._observe(before), rewards, term, trunc, {a: {} for a in before})


__all__ = ["OPPONENT_KINDS", "TurnParallelEnv"]
