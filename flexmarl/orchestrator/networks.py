"""Network-policy agents inside episodes (hybrid graphs, docs/hybrid.md).

A network agent's forward is tiny (an MLP on one observation), so it runs in the episode,
where the environment is, with the weights its training slot published: `NetworkActors` holds
each network agent's policy at its published version and acts for a node's `EnvSegment`;
`NetworkRollout` is the rollout pool the episodes see, sending LLM agents' calls and weights
to the replicas and network agents' weights to the actors. A node's K steps become one row of
the agent's table: the arrays MAPPO / IPPO's learner trains on (`PolicyLearner`), sampled with
a generator keyed by (seed, sample id, version), as LLM sampling is, so a run is the same
whatever the order its episodes interleave in.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flexmarl.api.runtime import RolloutPool
from flexmarl.config.schema import RunConfig
from flexmarl.graph.envs import EnvSegment
from flexmarl.graph.meg import GraphError
from flexmarl.planning.planner import Plan
from flexmarl.policy.model import stable_seed
from flexmarl.policy.nets import NetPolicy
from flexmarl.store.experience import Row
from flexmarl.training.policy_learner import MarlSample, agent_network
from flexmarl.training.state import from_wire
from flexmarl.types import GenerationRequest, GenerationResult


class NetworkAgentError(GraphError):
    """A network agent used like an LLM (or the reverse), or weights it cannot load."""


@dataclass
class SegmentResult:
    """One network node's segment: the actions it took (its node's output), the arrays of its
    row, and the sum of its step rewards (its own reward)."""

    actions: list[int]
    arrays: dict[str, np.ndarray]
    reward_sum: float


def _is_ippo(cfg: RunConfig, agent: str) -> bool:
    network = cfg.agents[agent].network
    return network is not None and network.algorithm.name == "ippo"


def network_agents(cfg: RunConfig) -> list[str]:
    return [a for a, acfg in cfg.agents.items() if acfg.network is not None]


class NetworkActors:
    """Each network agent's policy at its published version, acting for segments."""

    def __init__(self, cfg: RunConfig) -> None:
        self.seed = cfg.seed
        # initial weights as the learner's (same seed): a frozen agent keeps them
        self.nets = {a: agent_network(a, cfg.agents[a], cfg.seed) for a in network_agents(cfg)}
        self.versions = dict.fromkeys(self.nets, 0)
        # IPPO: the critic reads the agent's own observation (MAPPO: the session's critic input)
        self.own_critic = {a: _is_ippo(cfg, a) for a in self.nets}
        # runtime.deterministic: one step per forward pass, so a step's float rounding never
        # depends on which other steps shared its batch (sync == async bit for bit)
        self.batchers = {a: ForwardBatcher(net, cfg.runtime.deterministic)
                         for a, net in self.nets.items()}

    def __contains__(self, agent: str) -> bool:
        return agent in self.nets

    def load(self, agent: str, version: int, weights: Any) -> None:
        """Published weights (the wire form of `PolicyLearner.weights`: the network's state
        dict and the value normaliser's `vnorm.*`, which acting does not need)."""
        if not (isinstance(weights, tuple) and len(weights) == 2):
            raise NetworkAgentError(
                f"agent {agent!r}: network agents take their weights through the pipe "
                f"(got {type(weights).__name__}); leave runtime.publication unset")
        tensors = from_wire(weights).tensors
        self.nets[agent].load_state_dict(
            {k: v for k, v in tensors.items() if not k.startswith("vnorm.")})
        self.versions[agent] = version

    async def run_segment(self, agent: str, version: int, segment: EnvSegment,
                          sample_id: str) -> SegmentResult:
        """Act `segment.steps` steps in the episode's environment with `version`; after an
        episode's end the rest of the segment is padding (`alive` 0)."""
        if self.versions[agent] != version:
            raise NetworkAgentError(f"agent {agent!r}: node {sample_id} needs version "
                                    f"{version}, the actors hold {self.versions[agent]}")
        net, env = self.nets[agent], segment.env
        n_actions = net.actor.spec.logits_dim
        gen = torch.Generator().manual_seed(
            stable_seed(self.seed, "network", sample_id, version) % (2 ** 63))
        first = env.t == 0
        buf: dict[str, list[Any]] = defaultdict(list)
        actions: list[int] = []
        total = 0.0
        for t in range(segment.steps):
            if env.done:
                break
            o = env.observe(agent)
            # copies: a session may hand out buffers it updates in place
            obs = torch.tensor(np.asarray(o.obs), dtype=torch.float32).reshape(1, -1)
            cx = (obs if self.own_critic[agent]
                  else torch.tensor(np.asarray(o.critic), dtype=torch.float32).reshape(1, -1))
            self._check_sizes(agent, obs, cx)
            mask = (torch.ones(1, n_actions, dtype=torch.bool) if o.mask is None
                    else torch.tensor(np.asarray(o.mask), dtype=torch.bool).reshape(1, -1))
            act, logp, value = await self.batchers[agent].act(obs, cx, mask, gen)
            action = int(act[0, 0])
            reward, done = await env.act(agent, action)
            actions.append(action)
            total += float(reward)
            for name, v in (("obs", obs[0].numpy()), ("critic_x", cx[0].numpy()),
                            ("actions", act[0].numpy()), ("mask", mask[0].numpy()),
                            ("logp", np.float32(logp[0])), ("values", np.float32(value[0])),
                            ("rewards", np.float32(reward)), ("dones", bool(done)),
                            ("alive", True), ("starts", first and t == 0)):
                buf[name].append(v)
        if not actions:
            raise NetworkAgentError(f"agent {agent!r}: node {sample_id} starts after its "
                                    "episode's environment ended")
        last = np.float32(0.0)
        if not env.done:  # bootstrap from the state the segment ends in
            o = env.observe(agent)
            cx = torch.as_tensor(np.asarray(o.obs if self.own_critic[agent] else o.critic,
                                            np.float32)).reshape(1, -1)
            with torch.no_grad():
                last = np.float32(net.value(cx, torch.zeros(1, dtype=torch.long))[0])
        arrays = {name: np.asarray(vals) for name, vals in buf.items()}
        pad = segment.steps - len(actions)
        if pad:  # the episode ended inside the segment: rows of one agent stack to K steps
            arrays = {name: np.concatenate([a, _padding(name, a, pad)])
                      for name, a in arrays.items()}
        arrays["last_value"] = np.asarray(last, np.float32)
        return SegmentResult(actions, arrays, total)

    def _check_sizes(self, agent: str, obs: torch.Tensor, cx: torch.Tensor) -> None:
        net = self.nets[agent]
        if obs.shape[1] != net.obs_dim or cx.shape[1] != net.critic_dim:
            raise NetworkAgentError(
                f"agent {agent!r}: the environment gives observations of {obs.shape[1]} and "
                f"critic inputs of {cx.shape[1]} features; Task.network_spaces says "
                f"{net.obs_dim} and {net.critic_dim}")


class ForwardBatcher:
    """One forward pass for every episode's pending step of one network agent: the steps
    submitted while the event loop runs one round of ready episodes are batched (a policy
    forward of batch 1 costs about as much as one of batch 64 on a CPU). Each step's action
    is drawn with its own node's generator, so which steps share a batch decides nothing but
    float rounding; `exact` (runtime.deterministic) runs each step alone, so not even that."""

    def __init__(self, net: NetPolicy, exact: bool = False) -> None:
        self.net = net
        self.exact = exact
        self.queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator,
                               asyncio.Future]] = []
        self.batches = 0  # forward passes run (steps / batches: the batching achieved)
        self.steps = 0

    async def act(self, obs: torch.Tensor, cx: torch.Tensor, mask: torch.Tensor,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action [1, 1], log-prob [1], value [1]) of one step."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        if not self.queue and not self.exact:
            loop.call_soon(self._flush)
        self.queue.append((obs, cx, mask, gen, fut))
        if self.exact:
            self._flush()
        return await fut

    def _flush(self) -> None:
        batch, self.queue = self.queue, []
        net = self.net
        try:
            with torch.no_grad():
                obs = torch.cat([b[0] for b in batch])
                cx = torch.cat([b[1] for b in batch])
                mask = torch.cat([b[2] for b in batch])
                ids = torch.zeros(len(batch), dtype=torch.long)
                out, _ = net.actor.step(net.actor_input(obs, ids), None, None)
                dist = net.actor.dist(out, mask)
                probs = dist.cats[0].probs
                act = torch.stack([torch.multinomial(probs[i], 1, generator=b[3])
                                   for i, b in enumerate(batch)]).to(torch.float32)
                logp = dist.log_prob(act)
                value = net.value(cx, ids)
        except Exception as exc:  # noqa: BLE001 - every waiting step fails with it
            for b in batch:
                if not b[4].done():
                    b[4].set_exception(exc)
            return
        self.batches += 1
        self.steps += len(batch)
        for i, b in enumerate(batch):
            if not b[4].done():  # (an episode cancelled meanwhile)
                b[4].set_result((act[i:i + 1], logp[i:i + 1], value[i:i + 1]))


def _padding(name: str, a: np.ndarray, n: int) -> np.ndarray:
    """`n` steps after the episode's end: not alive, done, any legal action."""
    fill = {"mask": True, "dones": True}.get(name, 0)
    return np.full((n, *a.shape[1:]), fill, dtype=a.dtype)


def network_samples(store: Any, rows: list[Row]) -> list[MarlSample]:
    """What a network agent's learner gets for rows just taken: their arrays, with the
    credited reward's difference from the step rewards' sum (team share, downstream shares,
    `train.credit`) added at the last live step, so GAE sees the credit."""
    out = []
    for r in rows:
        arrays = {name: store.fetch(r, name) for name in r.refs}
        extra = float(r.data["reward"]) - float(r.data["step_reward"])
        if extra != 0.0:
            rewards = np.array(arrays["rewards"], np.float32, copy=True)
            live = np.flatnonzero(arrays["alive"])
            rewards[live[-1]] += np.float32(extra)
            arrays["rewards"] = rewards
        out.append(MarlSample(r.sample_id, r.iteration, r.policy_version, 0, arrays))
    return out


class NetworkRollout(RolloutPool):
    """The rollout pool of a hybrid run as its episodes see it: LLM agents' requests and
    weights go to `pool`, network agents' weights to `actors` (they generate nothing)."""

    def __init__(self, pool: RolloutPool, actors: NetworkActors) -> None:
        self.pool = pool
        self.actors = actors

    @property
    def n_workers(self) -> int:
        return self.pool.n_workers

    async def generate(self, request: GenerationRequest, priority: tuple) -> GenerationResult:
        if request.agent in self.actors:
            raise NetworkAgentError(f"agent {request.agent!r} is a network policy: its node's "
                                    "prompt builder returns an EnvSegment, not a prompt")
        return await self.pool.generate(request, priority)

    async def publish(self, agent: str, version: int, weights: Any) -> None:
        if agent in self.actors:
            self.actors.load(agent, version, weights)
        else:
            await self.pool.publish(agent, version, weights)

    def end_iteration(self, k: int, stats: dict[str, Any]) -> dict[str, Any] | None:
        return self.pool.end_iteration(
            k, {a: s for a, s in stats.items() if a not in self.actors})

    def follow_plan(self, plan: Plan) -> None:
        self.pool.follow_plan(plan)

    def __getattr__(self, name: str) -> Any:  # the pool's own figures (busy time, workers)
        return getattr(self.__dict__["pool"], name)
