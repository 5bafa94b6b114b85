"""A tiny hybrid task for tests: an LLM `caller` names a cell of a line every K steps, two
network-policy `walker`s step left / stay / right towards it."""

from __future__ import annotations

import numpy as np

from flexmarl.config.schema import NetworkSpaces
from flexmarl.graph.envs import EnvSegment, EnvSession, Observation, session
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt
from flexmarl.graph.task import Task

BOS = 1
CELLS = [2, 3, 4, 5, 6]  # token ids naming cells 0..4


class LineSession(EnvSession):
    def __init__(self, ctx: EpisodeContext, steps: int, horizon: int) -> None:
        super().__init__(["walker0", "walker1"])
        self.ctx, self.k, self.horizon = ctx, steps, horizon
        self.pos = {a: int(p) for a, p in zip(self.agents, ctx.data["start"], strict=True)}

    def target(self) -> int:
        s = min(self.t // self.k, self.horizon // self.k - 1)
        if f"caller-seg{s}" not in self.ctx.outputs:
            s -= 1
        return CELLS.index(self.ctx.output(f"caller-seg{s}")[0])

    def observe(self, agent: str) -> Observation:
        t = self.target()
        return Observation(np.array([self.pos[agent], t], np.float32),
                           np.array([*self.pos.values(), t], np.float32))

    def step(self, actions: dict[str, int]) -> dict[str, tuple[float, bool]]:
        t = self.target()
        for a, act in actions.items():
            self.pos[a] = min(4, max(0, self.pos[a] + act - 1))
        done = self.t + 1 >= self.horizon
        return {a: (-abs(self.pos[a] - t), done) for a in self.agents}


def build_line(segments: int = 2, steps: int = 3) -> Task:
    def make(ctx: EpisodeContext) -> EnvSession:
        return LineSession(ctx, steps, segments * steps)

    graph = MEG()
    for s in range(segments):
        before = [f"walker{i}-seg{s - 1}" for i in range(2)] if s else []
        graph.node(f"caller-seg{s}", agent="caller", inputs=before,
                   prompt=lambda ctx, s=s: NodePrompt([BOS, CELLS[ctx.data["goal"][s]]], 1, CELLS),
                   reward=lambda ctx, s=s: float(
                       ctx.output(f"caller-seg{s}")[0] == CELLS[ctx.data["goal"][s]]))
        for i in range(2):
            graph.node(f"walker{i}-seg{s}", agent=f"walker{i}",
                       inputs=[f"caller-seg{s}", *([f"walker{i}-seg{s - 1}"] if s else [])],
                       prompt=lambda ctx: EnvSegment(session(ctx, make), steps))
    graph.set_episode_reward(lambda ctx: -float(
        sum(abs(p - ctx.data["goal"][-1]) for p in ctx.env.pos.values())))

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict]:
        return [{"start": [int(x) for x in rng.integers(5, size=2)],
                 "goal": [int(x) for x in rng.integers(5, size=segments)]} for _ in range(n)]

    spaces = NetworkSpaces(obs_dim=2, critic_dim=3, actions=3)
    return Task(graph=graph, sample_inputs=sample_inputs, vocab_size=8, max_seq_len=8,
                network_spaces={"walker0": spaces, "walker1": spaces})
