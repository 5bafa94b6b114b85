"""Hybrid pursuit: an LLM coordinator names a landmark every K steps, network-policy pursuers
on an MPE scenario go to it (a hybrid graph: docs/hybrid.md).

The environment is MPE's `simple_spread_v3` (mpe2) with `pursuers` agents and as many
landmarks; its own reward is not used. An episode is `segments` segments of `segment_steps`
steps. Each segment has a goal landmark, hidden from the pursuers; the coordinator sees the
goal's *colour* (colour c marks landmark (c + shift) mod L: a code it must learn) and names a
landmark (one token); for the segment's steps the pursuers see the named landmark (after their
MPE observation: its one-hot and its position relative to the pursuer) and move.

Rewards, combined by `train.credit` (team * team + node * own + downstream shares):
- a pursuer's step reward: minus its distance to the *named* landmark (its own reward is the
  segment's sum);
- the coordinator's own reward: 1 when it named the goal;
- the team reward: minus the pursuers' mean distance to the *goal*, averaged over the
  episode's steps (it needs both: a right name and pursuers that follow it).

Graph per episode (S segments, N pursuers): `coordinator-seg{s}` (inputs: every pursuer's
node of segment s-1), then `pursuer{i}-seg{s}` for each pursuer (inputs: the coordinator's
node of its segment and its own node of the previous one). Rates: the coordinator acts once
per `segment_steps` environment steps, each pursuer at every step.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from flexmarl.config.schema import NetworkSpaces
from flexmarl.graph.envs import EnvSegment, EnvSession, Observation, session
from flexmarl.graph.meg import MEG, EpisodeContext, GraphError, NodePrompt
from flexmarl.graph.task import Task

BOS, SEGMENT = 1, 2  # token ids; then the segment tags, the colours, the landmark names
MPE_ACTIONS = 5  # simple_spread's discrete moves: stay, left, right, down, up


class Vocabulary:
    def __init__(self, segments: int, landmarks: int) -> None:
        self.segment_tags = list(range(3, 3 + segments))
        self.colours = list(range(3 + segments, 3 + segments + landmarks))
        first = 3 + segments + landmarks
        self.landmarks = list(range(first, first + landmarks))
        self.size = first + landmarks


class PursuitSession(EnvSession):
    """One episode's MPE world; the named landmark of each segment is read from the
    coordinator's node output in the episode's context."""

    def __init__(self, ctx: EpisodeContext, pursuers: int, segment_steps: int,
                 vocab: Vocabulary) -> None:
        from mpe2 import simple_spread_v3  # optional dependency: the `marl` extra

        super().__init__([f"pursuer{i}" for i in range(pursuers)])
        self.ctx, self.k, self.vocab = ctx, segment_steps, vocab
        self.goals: list[int] = list(ctx.data["goals"])
        self.env = simple_spread_v3.parallel_env(
            N=pursuers, max_cycles=segment_steps * len(self.goals), continuous_actions=False)
        self.obs, _ = self.env.reset(seed=int(ctx.data["seed"]))
        self.names = list(self.env.possible_agents)  # MPE's agent_0 ... in pursuer order
        self.world = self.env.unwrapped.world
        self.team_total = 0.0

    def named(self) -> int:
        """The landmark the coordinator named for the current segment (at a segment's end,
        before the next name exists: the one being pursued, for the critic's bootstrap)."""
        s = self.t // self.k
        if s and f"coordinator-seg{s}" not in self.ctx.outputs:
            s -= 1
        token = self.ctx.output(f"coordinator-seg{s}")[0]
        return self.vocab.landmarks.index(token)

    def _onehot(self) -> np.ndarray:
        out = np.zeros(len(self.vocab.landmarks), np.float32)
        out[self.named()] = 1.0
        return out

    def observe(self, agent: str) -> Observation:
        """MPE's observation, then the named landmark: one-hot and relative position."""
        named = self.named()
        i = self.agents.index(agent)
        where = (self.world.landmarks[named].state.p_pos
                 - self.world.agents[i].state.p_pos).astype(np.float32)
        target = np.concatenate([self._onehot(), where])
        own = self.obs[self.names[i]]
        every = np.concatenate([self.obs[n] for n in self.names])
        return Observation(np.concatenate([own, target]), np.concatenate([every, target]))

    def _distances(self, landmark: int) -> np.ndarray:
        pos = self.world.landmarks[landmark].state.p_pos
        return np.array([np.linalg.norm(a.state.p_pos - pos) for a in self.world.agents])

    def step(self, actions: dict[str, int]) -> dict[str, tuple[float, bool]]:
        named, goal = self.named(), self.goals[self.t // self.k]
        self.obs, _, term, trunc, _ = self.env.step(
            {self.names[self.agents.index(a)]: act for a, act in actions.items()})
        to_named, to_goal = self._distances(named), self._distances(goal)
        self.team_total -= float(to_goal.mean())
        done = bool(any(term.values()) or any(trunc.values()))
        return {a: (-float(to_named[i]), done) for i, a in enumerate(self.agents)}


def build_hybrid_pursuit(pursuers: int = 3, segments: int = 5, segment_steps: int = 5,
                         shift: int = 1) -> Task:
    """The task (see the module docstring); agents: `coordinator` (an LLM) and
    `pursuer0` ... (network policies)."""
    for name, value, low in (("pursuers", pursuers, 2), ("segments", segments, 1),
                             ("segment_steps", segment_steps, 1)):
        if not isinstance(value, int) or value < low:
            raise GraphError(f"task.options.{name}: must be an integer >= {low}, got {value!r}")
    if importlib.util.find_spec("mpe2") is None:
        raise GraphError("task.builder: the hybrid pursuit steps MPE's simple_spread world, "
                         "from the mpe2 package: pip install 'flexmarl[marl]'")
    vocab = Vocabulary(segments, pursuers)
    names = [f"pursuer{i}" for i in range(pursuers)]

    def make(ctx: EpisodeContext) -> EnvSession:
        return PursuitSession(ctx, pursuers, segment_steps, vocab)

    def goal(ctx: EpisodeContext, s: int) -> int:
        return int(ctx.data["goals"][s])

    def coordinate(s: int):
        def prompt(ctx: EpisodeContext) -> NodePrompt:
            colour = (goal(ctx, s) - shift) % pursuers  # colour c marks landmark c + shift
            return NodePrompt([BOS, SEGMENT, vocab.segment_tags[s], vocab.colours[colour]], 1,
                              vocab.landmarks)

        def right(ctx: EpisodeContext) -> float:
            token = ctx.output(f"coordinator-seg{s}")[0]
            return float(vocab.landmarks.index(token) == goal(ctx, s))

        return prompt, right

    def pursue(ctx: EpisodeContext) -> EnvSegment:
        return EnvSegment(session(ctx, make), segment_steps)

    graph = MEG()
    for s in range(segments):
        prompt, right = coordinate(s)
        before = [f"{p}-seg{s - 1}" for p in names] if s else []
        graph.node(f"coordinator-seg{s}", agent="coordinator", inputs=before, prompt=prompt,
                   reward=right)
        for p in names:
            graph.node(f"{p}-seg{s}", agent=p, prompt=pursue,
                       inputs=[f"coordinator-seg{s}", *([f"{p}-seg{s - 1}"] if s else [])])
    steps = segments * segment_steps
    graph.set_episode_reward(lambda ctx: ctx.env.team_total / steps)
    graph.set_success(lambda ctx: all(
        vocab.landmarks.index(ctx.output(f"coordinator-seg{s}")[0]) == goal(ctx, s)
        for s in range(segments)))

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        return [{"seed": int(rng.integers(2 ** 31)),
                 "goals": [int(g) for g in rng.integers(pursuers, size=segments)]}
                for _ in range(n)]

    spaces = NetworkSpaces(obs_dim=_mpe_obs(pursuers) + pursuers + 2,
                           critic_dim=pursuers * _mpe_obs(pursuers) + pursuers + 2,
                           actions=MPE_ACTIONS)
    return Task(graph=graph, sample_inputs=sample_inputs, vocab_size=vocab.size,
                max_seq_len=8, network_spaces=dict.fromkeys(names, spaces))


def _mpe_obs(n: int) -> int:
    """simple_spread's observation: own velocity and position, the landmarks' and the other
    agents' relative positions, the others' communication."""
    return 4 + 2 * n + 2 * (n - 1) + 2 * (n - 1)
