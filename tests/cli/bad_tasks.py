"""Task builders with one user mistake each (tests of the clear-error contract).

Each wraps the referential game and breaks one thing a user function returns; `build(kind=...)`
picks the mistake, so a test passes `--set task.options.kind=...`.
"""

from __future__ import annotations

import math

from flexmarl.graph.meg import NodePrompt, TextPrompt
from flexmarl.tasks.referential import build_referential_game

OPTIONS = {"num_objects": 8, "num_candidates": 4, "message_length": 1, "num_symbols": 16}


def raises(**_options):
    raise RuntimeError("dataset shard 7 is missing")


def returns_dict(**_options):
    return {"graph": None}


def _patch_prompt(task, node, fn):
    inner = task.graph.nodes[node].prompt
    task.graph.nodes[node].prompt = lambda ctx: fn(inner(ctx))
    return task


def build(kind: str, **_ignored):
    task = build_referential_game(**OPTIONS)
    vocab = task.vocab_size
    if kind == "out_of_vocab":
        return _patch_prompt(task, "listen", lambda p: NodePrompt(
            p.tokens + [vocab + 5], p.max_new_tokens, p.allowed_tokens))
    if kind == "negative_id":
        return _patch_prompt(task, "speak", lambda p: NodePrompt(
            [-1] + p.tokens, p.max_new_tokens, p.allowed_tokens))
    if kind == "float_ids":
        return _patch_prompt(task, "speak", lambda p: NodePrompt(
            [float(t) for t in p.tokens], p.max_new_tokens, p.allowed_tokens))
    if kind == "not_a_prompt":
        return _patch_prompt(task, "speak", lambda p: p.tokens)
    if kind == "int_prompt":
        return _patch_prompt(task, "speak", lambda p: 42)
    if kind == "bad_stop":
        return _patch_prompt(task, "speak", lambda p: TextPrompt("hello", stop=[3]))
    if kind == "text_small_vocab":  # the byte-level tokenizer needs 261 ids, the game has 30
        return _patch_prompt(task, "speak", lambda p: [{"role": "user", "content": "hi"}])
    if kind == "empty_prompt":
        return _patch_prompt(task, "speak", lambda p: NodePrompt([], p.max_new_tokens,
                                                                 p.allowed_tokens))
    if kind == "zero_budget":
        return _patch_prompt(task, "speak", lambda p: NodePrompt(p.tokens, 0, p.allowed_tokens))
    if kind == "too_long":
        return _patch_prompt(task, "speak", lambda p: NodePrompt(
            p.tokens * 50, p.max_new_tokens, p.allowed_tokens))
    if kind == "bad_allowed":
        return _patch_prompt(task, "speak", lambda p: NodePrompt(
            p.tokens, p.max_new_tokens, [vocab]))
    if kind == "nan_reward":
        task.graph.set_episode_reward(lambda ctx: math.nan)
        return task
    if kind == "string_reward":
        task.graph.set_episode_reward(lambda ctx: "1.0")
        return task
    if kind == "condition_none":
        task.graph.nodes["listen"].when = lambda ctx: None
        return task
    if kind == "inputs_not_list":
        task.sample_inputs = lambda rng, n: None
        return task
    if kind == "inputs_raise":
        def sample(rng, n):
            raise KeyError("split 'train'")

        task.sample_inputs = sample
        return task
    if kind == "reward_always_raises":  # transient-looking: episode failures, the budget
        def reward(ctx):
            raise ConnectionError("judge unreachable")

        task.graph.set_episode_reward(reward)
        return task
    raise ValueError(f"unknown kind {kind!r}")
