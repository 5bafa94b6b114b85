"""Environments inside episodes: what a network-policy agent's node acts in (hybrid graphs).

A node whose agent is a network policy (`agents.<name>.network`) returns an `EnvSegment` from
its prompt builder: the episode's environment session and how many steps the agent acts in
it. Every network agent of a session acts at every step of a segment, so the nodes of one
segment (one per agent) run together and meet at each step: each submits its action
(`EnvSession.act`), and the session steps the environment once all of them have (a
rendezvous inside the episode's event loop). Rates follow from the graph's shape: an LLM node
between segments acts once every `steps` environment steps, a network node at every step of
its segment.

A task subclasses `EnvSession` (observations, the step, the rewards) and keeps one session per
episode on `ctx.env` (`session(ctx, make)`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexmarl.graph.meg import EpisodeContext, GraphError


@dataclass
class Observation:
    """What a network agent sees at one step: its observation, its critic's input (MAPPO:
    global features; IPPO's critic reads `obs`) and the legal actions (None: all)."""

    obs: np.ndarray
    critic: np.ndarray
    mask: np.ndarray | None = None


class EnvSession:
    """One episode's environment, stepped in lock step by the network agents in `agents`.

    Subclasses give `observe(agent)` and `step(actions) -> {agent: (reward, done)}` (the
    episode ends for all when any agent is done); `act` is the rendezvous the episode runner
    calls, never overridden."""

    def __init__(self, agents: list[str]) -> None:
        self.agents = list(agents)
        self.t = 0  # environment steps taken
        self.done = False
        self._actions: dict[str, int] = {}
        self._result: asyncio.Future[dict[str, tuple[float, bool]]] | None = None

    def observe(self, agent: str) -> Observation:
        raise NotImplementedError

    def step(self, actions: dict[str, int]) -> dict[str, tuple[float, bool]]:
        raise NotImplementedError

    async def act(self, agent: str, action: int) -> tuple[float, bool]:
        """Submit `agent`'s action for step `t`; returns its (reward, done) once every agent
        of the session acted and the environment stepped."""
        if agent not in self.agents:
            raise GraphError(f"agent {agent!r} acts in an environment session of agents "
                             f"{self.agents}")
        if self.done:
            raise GraphError(f"agent {agent!r} acts after its episode's environment ended "
                             f"(step {self.t}); segments must not outlast the episode")
        if agent in self._actions:
            raise GraphError(f"agent {agent!r} acted twice at step {self.t}: two of its "
                             "nodes run in one segment")
        if self._result is None:
            self._result = asyncio.get_running_loop().create_future()
        result = self._result
        self._actions[agent] = int(action)
        if len(self._actions) == len(self.agents):
            actions, self._actions, self._result = self._actions, {}, None
            try:
                out = self.step(actions)
            except Exception as exc:  # noqa: BLE001 - the task's step: every waiter fails
                result.set_exception(exc)
                raise
            self.t += 1
            self.done = any(done for _, done in out.values())
            result.set_result(out)
        return (await result)[agent]


@dataclass
class EnvSegment:
    """What a network agent's prompt builder returns: act `steps` steps in `env`.

    Example:
        ```python
        graph.node(f"pursuer0-seg{s}", agent="pursuer0", inputs=[f"coordinator-seg{s}"],
                   prompt=lambda ctx: EnvSegment(session(ctx, make_env), steps=5))
        ```
    """

    env: EnvSession
    steps: int

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise GraphError(f"EnvSegment.steps must be positive, got {self.steps}")


def session(ctx: EpisodeContext, make: Callable[[EpisodeContext], EnvSession]) -> Any:
    """The episode's environment session (`ctx.env`), made by `make(ctx)` the first time."""
    if ctx.env is None:
        ctx.env = make(ctx)
    return ctx.env
