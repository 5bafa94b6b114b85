"""Greedy evaluation of MAPPO/IPPO policies: each agent takes its most likely action (the
mean action for a Gaussian head), on a fixed set of evaluation episodes.

The training records' `return_mean` and `task/*` are measured on the stochastic training
rollouts, whose sampling noise blurs what a policy has learnt (an agent that hovers near a
landmark may still drift out of the 0.1 radius at the last step). `GreedyEvaluator` acts the
same networks without sampling, on environments seeded apart from the training ones and reset
to the same start states at every evaluation, so successive evaluations of a run differ only
by the weights. It uses no random number generator that training uses: a run with
evaluations trains bit-identically to one without (`tests/marl/test_evaluate.py`).

Used by the driver (`train.eval_every`, `eval/*` in metrics.jsonl) and by
`benchmarks/mpe.py --part greedy`, which evaluates the generations of a run's checkpoints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexmarl.config.schema import RunConfig
from flexmarl.envs.pettingzoo import Episode, VecParallelEnv
from flexmarl.marl.policies import PolicyLayout
from flexmarl.marl.policies import layouts as policy_layouts
from flexmarl.marl.rollout import EnvRollout
from flexmarl.orchestrator.checkpoint import CheckpointManager, find_checkpoints
from flexmarl.runtime.local.workers import from_numpy

EVAL_SEED_OFFSET = 7_777_777  # evaluation environments are seeded at seed + this
MAX_STEPS = 100_000  # per evaluation: an environment that never ends is an error


class GreedyEvaluator:
    """`episodes` environments stepped together until each has ended one episode; their
    first episodes are the evaluation."""

    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout],
                 episodes: int) -> None:
        if episodes <= 0:
            raise ValueError(f"train.eval_episodes must be > 0, got {episodes}")
        ecfg = cfg.model_copy(deep=True)
        ecfg.environment.num_envs = episodes
        ecfg.seed = cfg.seed + EVAL_SEED_OFFSET
        # the rollout's networks and its input construction (padding, critic input, masks,
        # FP16 rounding with store.compress_obs), reused so the actor sees what it trains on
        self.rollout = EnvRollout(ecfg, layouts)
        self.cfg, self.episodes = ecfg, episodes
        self.loaded: dict[str, int] = {}

    def load(self, name: str, version: int, weights: dict[str, torch.Tensor]) -> None:
        """A policy's published weights (network with its normalisers, `vnorm.*`)."""
        self.rollout.load(name, version, weights)
        self.loaded[name] = version

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """`eval/return` (mean over episodes of the mean return per agent), `eval/<agent>/return`,
        `eval/length` and `eval/<task metric>` (mean over episodes)."""
        missing = sorted(set(self.rollout.actors) - set(self.loaded))
        if missing:
            raise RuntimeError(f"greedy evaluation: no weights loaded for policies {missing}")
        r = self.rollout
        env = self.cfg.environment
        venv = VecParallelEnv(env.id, env.options, self.episodes,
                              self.cfg.seed)
        venv.reset()  # the same start states at every evaluation
        r.venv = venv
        E = venv.num_envs
        hidden = {n: (torch.zeros_like(p.hidden) if p.hidden is not None else None)
                  for n, p in r.actors.items()}
        start = {a: np.ones(E, bool) for a in r.agents}
        first: list[Episode | None] = [None] * E
        steps = 0
        while any(ep is None for ep in first):
            actions: dict[str, np.ndarray] = {}
            for name, p in r.actors.items():
                obs, _, ids, masks = r._inputs(p)
                starts = torch.from_numpy(np.concatenate([start[a] for a in p.agents]))
                out, hidden[name] = p.net.actor.step(p.net.actor_input(obs, ids),
                                                     hidden[name], starts)
                act = p.net.actor.dist(out, masks).mode()
                for i, a in enumerate(p.agents):
                    actions[a] = act[i * E:(i + 1) * E].numpy()
            alive = {a: venv.alive[a].copy() for a in r.agents}
            res = venv.step(actions)
            # the environments that ended this step were reset (length 0); their episodes
            # were appended in environment order
            ended = [e for e in range(E) if venv._lengths[e] == 0]
            for e, ep in zip(ended, venv.pop_episodes(), strict=True):
                if first[e] is None:
                    first[e] = ep
            for a in r.agents:
                start[a] = res["done"][a] | (start[a] & ~alive[a])
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"greedy evaluation of env {env.id!r}: "
                                   f"{sum(ep is None for ep in first)} of {E} episodes had "
                                   f"not ended after {MAX_STEPS} steps")
        return summarize([ep for ep in first if ep is not None])


def summarize(episodes: list[Episode]) -> dict[str, float]:
    agents = list(episodes[0].returns)
    per_agent = {a: float(np.mean([e.returns[a] for e in episodes])) for a in agents}
    out = {"eval/return": float(np.mean(list(per_agent.values()))),
           "eval/length": float(np.mean([e.length for e in episodes])),
           "eval/episodes": float(len(episodes))}
    for a, v in per_agent.items():
        out[f"eval/{a}/return"] = v
    for key in episodes[0].metrics:
        out[f"eval/{key}"] = float(np.mean([e.metrics[key] for e in episodes]))
    return out


def evaluate_checkpoint(cfg: RunConfig, path: str | Path, episodes: int
                        ) -> tuple[int, dict[str, float]]:
    """Greedy evaluation of one checkpoint generation (`OUT/checkpoints/gen-N/`, or a run
    folder / its checkpoints/ for the LATEST one): (iterations completed, `eval/*` metrics)."""
    path = Path(path)
    if path.name.startswith("gen-"):
        ckpt = CheckpointManager(path.parent).load(path.name)
    else:
        ckpt = find_checkpoints(path).load()
    env = cfg.environment
    probe = VecParallelEnv(env.id, env.options, 1, cfg.seed, env.opponents)
    probe.reset()
    layouts = policy_layouts(cfg, probe)  # the policies, checked against the spaces
    if sorted(ckpt.trainer_states) != sorted(layouts):
        raise ValueError(f"{path}: the checkpoint has policies {sorted(ckpt.trainer_states)}, "
                         f"the config has {sorted(layouts)} (the agents' network.base?)")
    ev = GreedyEvaluator(cfg, layouts, episodes)
    for name, (arrays, meta) in ckpt.trainer_states.items():
        ev.load(name, int(meta["version"]), weights_of_state(arrays))
    return ckpt.completed, ev.run()


def weights_of_state(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A learner's checkpointed state (`PolicyLearner.capture`: `w/net/*`, `w/vnorm/*`) as
    the published weights a rollout loads."""
    out = {}
    for k, v in arrays.items():
        t = torch.as_tensor(np.array(v, copy=True))
        if k.startswith("w/net/"):
            out[k[6:]] = t
        elif k.startswith("w/vnorm/"):
            out[f"vnorm.{k[8:]}"] = t
    return out


class PeriodicEvaluation:
    """`train.eval_every` in a run: after iterations eval_every - 1, 2 * eval_every - 1, ...
    and the last one, the greedy evaluation of version k+1 (`eval/*`, with `eval_s`). It reads
    the published weights only, so training is unchanged by it."""

    def __init__(self, cfg: RunConfig, layouts: dict[str, PolicyLayout], n_iter: int) -> None:
        self.cfg, self.layouts, self.n_iter = cfg, layouts, n_iter
        self.evaluator: GreedyEvaluator | None = None

    def after(self, k: int, published: dict[str, tuple[int, Any]]) -> dict[str, float]:
        every = self.cfg.train.eval_every
        if every is None or ((k + 1) % every != 0 and k != self.n_iter - 1):
            return {}
        t0 = time.perf_counter()
        if self.evaluator is None:
            self.evaluator = GreedyEvaluator(self.cfg, self.layouts, self.cfg.train.eval_episodes)
        for name, (version, wire) in published.items():
            if version != k + 1:
                raise RuntimeError(f"evaluation after iteration {k}: policy {name!r} "
                                   f"published version {version}")
            self.evaluator.load(name, version, from_numpy(wire))
        out = self.evaluator.run()
        out["eval_s"] = time.perf_counter() - t0
        return out
