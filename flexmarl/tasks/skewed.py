"""A rollout-skew workload: a router fans out to three experts of very different verbosity.

What the rollout balancer is for, in miniature: per agent mean output lengths differ by 4x and
more, and each request's length is long-tailed (log-normal, capped), as in the paper's
multi-agent traces. The reward is a token-matching score, so the agents can also be trained;
the rollout benchmark runs them frozen and measures only the generation side.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt
from flexmarl.graph.task import Task, TaskLoadError
from flexmarl.policy.model import stable_seed

BOS, SEP = 1, 2
FIRST = 4  # token ids from here are content


def _length(mean: float, sigma: float, cap: int, *key: object) -> int:
    rng = np.random.default_rng(stable_seed("len", *key))
    # log-normal with the given mean: mu = ln(mean) - sigma^2 / 2
    value = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma)
    return int(min(cap, max(1, round(value))))


def build_skewed_fanout(
    lengths: dict[str, float] | None = None,
    sigma: float = 0.8,
    cap_factor: float = 4.0,
    prompt_length: int = 8,
    vocab_size: int = 64,
    conditional: list[str] | None = None,
) -> Task:
    """`lengths`: mean output tokens per node (= agent); the first node routes to the rest.
    `conditional`: experts called only when the router asks for them (its first token in the
    upper half of the content ids): a conditional edge, whose branch the router learns to take
    or skip, so the work per episode varies with the router's policy."""
    lengths = dict(lengths or {"router": 4, "brief": 8, "detailed": 24, "verbose": 96})
    if len(lengths) < 2:
        raise TaskLoadError("options.lengths: needs a router and at least one expert")
    for name, mean in lengths.items():
        if not isinstance(mean, (int, float)) or mean < 1:
            raise TaskLoadError(f"options.lengths.{name}: mean length must be >= 1, got {mean!r}")
    if sigma < 0:
        raise TaskLoadError(f"options.sigma: must be >= 0, got {sigma}")
    names = list(lengths)
    router, experts = names[0], names[1:]
    conditional = list(conditional or [])
    for name in conditional:
        if name not in experts:
            raise TaskLoadError(f"options.conditional: {name!r} is not an expert (experts: "
                                f"{', '.join(experts)})")
    caps = {n: max(1, int(lengths[n] * cap_factor)) for n in names}
    content = list(range(FIRST, vocab_size))

    def prompt_for(node: str, upstream: str | None):
        def prompt(ctx: EpisodeContext) -> NodePrompt:
            n = _length(lengths[node], sigma, caps[node], ctx.input_id, ctx.trajectory_id, node)
            tokens = [BOS, *ctx.data["query"], SEP]
            if upstream is not None:
                tokens += ctx.output(upstream)[:prompt_length]
            return NodePrompt(tokens, n, content)
        return prompt

    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        return [{"query": rng.integers(FIRST, vocab_size, size=prompt_length).tolist()}
                for _ in range(n)]

    def match(ctx: EpisodeContext) -> float:
        """Share of the query's tokens that the experts echo: a dense, learnable reward."""
        query = set(ctx.data["query"])
        said = [t for e in experts if e in ctx.outputs for t in ctx.output(e)]
        return sum(t in query for t in said) / max(1, len(said))

    midpoint = (FIRST + vocab_size) // 2

    def asked(ctx: EpisodeContext) -> bool:
        return ctx.output(router)[0] >= midpoint

    graph = MEG().node(router, agent=router, prompt=prompt_for(router, None))
    for e in experts:
        graph = graph.node(e, agent=e, inputs=[router], prompt=prompt_for(e, router),
                           when=asked if e in conditional else None)
    graph = graph.set_episode_reward(match).set_success(lambda ctx: match(ctx) > 0.5)
    longest = max(caps.values())
    return Task(graph=graph, vocab_size=vocab_size, sample_inputs=sample_inputs,
                max_seq_len=2 * prompt_length + 2 + longest + 4,
                info={"lengths": lengths, "caps": caps})
