"""Referential (signalling) games: agents that must invent a shared code to succeed.

`build_referential_game`: a speaker sees a target object and emits a short message; a listener
sees the message and K candidate objects and names one. Team reward 1 when it names the target.
Chance is 1/K; success needs a convention that both agents learn together from scratch.

`build_relay_chain`: speaker -> relay -> listener. The relay re-encodes the speaker's message
into a message several times longer, so one agent's outputs (and its generation time) dominate:
the inter-agent skew the async pipeline exists for.

Token layout (one small vocabulary shared by all agents):
PAD=0, BOS=1, SEP=2, three role tags, then the objects, then the message symbols.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexmarl.graph.meg import MEG, EpisodeContext, GraphError, NodePrompt
from flexmarl.graph.task import Task

PAD, BOS, SEP, TAG_SPEAKER, TAG_LISTENER, TAG_RELAY = 0, 1, 2, 3, 4, 5
FIRST_OBJECT = 6


class Layout:
    def __init__(self, num_objects: int, num_symbols: int) -> None:
        self.num_objects = num_objects
        self.num_symbols = num_symbols
        self.objects = list(range(FIRST_OBJECT, FIRST_OBJECT + num_objects))
        self.symbols = list(range(FIRST_OBJECT + num_objects,
                                  FIRST_OBJECT + num_objects + num_symbols))
        self.vocab_size = FIRST_OBJECT + num_objects + num_symbols


def _check(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise GraphError(f"task.options.{name}: must be an integer >= {low}, got {value!r}")


def _layout(num_objects: int, num_candidates: int, num_symbols: int, **lengths: int) -> Layout:
    """Validate the options (errors name the option) and lay out the vocabulary."""
    for name, value, low in (("num_objects", num_objects, 2), ("num_candidates", num_candidates, 2),
                             ("num_symbols", num_symbols, 2),
                             *((k, v, 1) for k, v in lengths.items())):
        _check(name, value, low)
    if num_candidates > num_objects:
        raise GraphError("task.options.num_candidates: must not exceed num_objects")
    return Layout(num_objects, num_symbols)


def _speaker_prompt(layout: Layout, message_length: int):
    def speak(ctx: EpisodeContext) -> NodePrompt:
        # the target comes last, right where the message is decoded from
        return NodePrompt([BOS, TAG_SPEAKER, SEP, ctx.data["target"]], message_length,
                          layout.symbols)

    return speak


def _sampler(layout: Layout, num_candidates: int):
    def sample_inputs(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            cands = rng.choice(layout.num_objects, size=num_candidates, replace=False)
            target = int(cands[rng.integers(num_candidates)])
            out.append({
                "target": layout.objects[target],
                "candidates": [layout.objects[int(c)] for c in cands],
            })
        return out

    return sample_inputs


def _listener_prompt(source: str, max_tokens: int):
    def prompt(ctx: EpisodeContext) -> NodePrompt:
        cands = ctx.data["candidates"]
        message = ctx.output(source)
        return NodePrompt([BOS, TAG_LISTENER, *cands, SEP, *message], max_tokens, cands)

    return prompt


def _team_reward(ctx: EpisodeContext) -> float:
    return 1.0 if ctx.output("listen") == [ctx.data["target"]] else 0.0


def build_referential_game(
    num_objects: int = 8, num_candidates: int = 4, message_length: int = 1,
    num_symbols: int = 8,
) -> Task:
    layout = _layout(num_objects, num_candidates, num_symbols, message_length=message_length)
    speak = _speaker_prompt(layout, message_length)

    graph = (
        MEG()
        .node("speak", agent="speaker", prompt=speak)
        .node("listen", agent="listener", inputs=["speak"], prompt=_listener_prompt("speak", 1))
        .set_episode_reward(_team_reward)
        .set_success(lambda ctx: _team_reward(ctx) > 0.5)
    )
    return Task(
        graph=graph, vocab_size=layout.vocab_size, sample_inputs=_sampler(layout, num_candidates),
        max_seq_len=num_candidates + 2 * message_length + 8,
        info={"chance": 1.0 / num_candidates, "layout": "referential"},
    )


def build_relay_chain(
    num_objects: int = 8, num_candidates: int = 4, message_length: int = 2,
    relay_length: int = 8, num_symbols: int = 8,
) -> Task:
    layout = _layout(num_objects, num_candidates, num_symbols, message_length=message_length,
                     relay_length=relay_length)
    speak = _speaker_prompt(layout, message_length)

    def relay(ctx: EpisodeContext) -> NodePrompt:
        return NodePrompt([BOS, TAG_RELAY, SEP, *ctx.output("speak")], relay_length,
                          layout.symbols)

    graph = (
        MEG()
        .node("speak", agent="speaker", prompt=speak)
        .node("relay", agent="relay", inputs=["speak"], prompt=relay)
        .node("listen", agent="listener", inputs=["relay"], prompt=_listener_prompt("relay", 1))
        .set_episode_reward(_team_reward)
        .set_success(lambda ctx: _team_reward(ctx) > 0.5)
    )
    return Task(
        graph=graph, vocab_size=layout.vocab_size, sample_inputs=_sampler(layout, num_candidates),
        max_seq_len=num_candidates + message_length + 2 * relay_length + 8,
        info={"chance": 1.0 / num_candidates, "layout": "relay"},
    )
