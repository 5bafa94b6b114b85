"""Checks on what user-supplied functions return (prompt builders, conditions, rewards, input
samplers), before anything reaches a worker.

A value of the wrong type or range is a bug in the task, the same in every episode: it stops the
run at once with a `ContractError` (a `UserError`: one line naming the node, agent and value, exit
code 2), instead of a worker's `IndexError` recorded as every episode's error. Exceptions that a
user function *raises* stay episode failures (a judge may fail transiently); the failure budget
(`train.max_failed_fraction`) bounds those.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from flexmarl.errors import UserError
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.envs import EnvSegment
from flexmarl.graph.meg import EpisodeContext, NodePrompt
from flexmarl.policy.tokenizer import model_vocab


class ContractError(UserError, ValueError):
    """A user function returned a value the run cannot use."""


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _token_list(where: str, what: str, value: Any, vocab: int, agent: str,
                allow_empty: bool) -> None:
    if not isinstance(value, (list, tuple)):
        raise ContractError(f"{where}: {what} must be a list of token ids, got "
                            f"{type(value).__name__}")
    if not value and not allow_empty:
        raise ContractError(f"{where}: {what} is empty")
    # The common case in C (every node's prompt passes here): plain ints within the vocabulary.
    if value and set(map(type, value)) == {int} and min(value) >= 0 and max(value) < vocab:
        return
    for i, tok in enumerate(value):
        if not _is_int(tok):
            raise ContractError(f"{where}: {what}[{i}] is {tok!r} ({type(tok).__name__}), "
                                "not an integer token id")
        if not 0 <= int(tok) < vocab:
            raise ContractError(
                f"{where}: {what}[{i}] = {int(tok)} is outside agent {agent!r}'s vocabulary "
                f"[0, {vocab}) (the task's vocab_size)")


def _plain_ids(value: Any, vocab: int) -> bool:
    """A list of plain ints within [0, vocab), or an empty one: what passes `_token_list`."""
    return type(value) is list and (not value or (
        set(map(type, value)) == {int} and min(value) >= 0 and max(value) < vocab))


def check_prompt(node: str, agent: str, prompt: Any, vocab: int, max_seq_len: int) -> None:
    """A prompt builder's return value: a NodePrompt whose ids the agent's model can take."""
    # every node's prompt passes here: the common case first, without building messages
    if (type(prompt) is NodePrompt and prompt.tokens and _plain_ids(prompt.tokens, vocab)
            and type(prompt.max_new_tokens) is int
            and 0 < prompt.max_new_tokens <= max_seq_len - len(prompt.tokens)
            and (prompt.allowed_tokens is None or (
                prompt.allowed_tokens and _plain_ids(prompt.allowed_tokens, vocab)))
            and _plain_ids(prompt.stop_tokens, vocab)
            and type(prompt.stop) in (list, tuple)
            and all(type(x) is str and x for x in prompt.stop)):
        return
    where = f"node {node!r} (agent {agent!r}): prompt builder"
    if not isinstance(prompt, NodePrompt):
        raise ContractError(f"{where} returned {type(prompt).__name__}, not NodePrompt")
    _token_list(where, "tokens", prompt.tokens, vocab, agent, allow_empty=False)
    n = prompt.max_new_tokens
    if not _is_int(n):
        raise ContractError(f"{where}: max_new_tokens is {n!r}, not an integer")
    if n <= 0:
        raise ContractError(f"{where}: max_new_tokens is {n}; the token budget must be >= 1")
    if len(prompt.tokens) + n > max_seq_len:
        raise ContractError(
            f"{where}: prompt of {len(prompt.tokens)} tokens + max_new_tokens {n} = "
            f"{len(prompt.tokens) + n} exceeds the task's max_seq_len {max_seq_len}")
    if prompt.allowed_tokens is not None:
        _token_list(where, "allowed_tokens", prompt.allowed_tokens, vocab, agent,
                    allow_empty=False)
    _token_list(where, "stop_tokens", prompt.stop_tokens, vocab, agent, allow_empty=True)
    if not isinstance(prompt.stop, (list, tuple)) or not all(
            isinstance(x, str) and x for x in prompt.stop):
        raise ContractError(f"{where}: stop must be a list of non-empty strings, got "
                            f"{prompt.stop!r}")


def check_condition(node: str, value: Any) -> bool:
    try:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
    except ImportError:  # pragma: no cover - numpy is a dependency
        if isinstance(value, bool):
            return value
    raise ContractError(f"node {node!r}: condition (when=) returned {value!r} "
                        f"({type(value).__name__}), not a bool")


def check_reward(what: str, value: Any, finite: bool = True) -> float:
    """A reward function's return value: a (finite) real number."""
    bad = ContractError(f"{what} returned {value!r} ({type(value).__name__}), not a number")
    if value is None or isinstance(value, (str, bytes, list, tuple, dict)):
        raise bad
    try:  # ints, floats, numpy and 0-d torch scalars
        out = float(value)
    except (TypeError, ValueError):
        raise bad from None
    if finite and not math.isfinite(out):
        raise ContractError(f"{what} returned {out}, not a finite number")
    return out


def check_inputs(builder: str, inputs: Any) -> None:
    """`Task.sample_inputs(rng, n)`: a list of dicts (the count is checked by the caller)."""
    if not isinstance(inputs, (list, tuple)):
        raise ContractError(f"task {builder}: sample_inputs returned {type(inputs).__name__}, "
                            "not a list of dicts")
    for i, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise ContractError(f"task {builder}: sample_inputs returned an item #{i} of type "
                                f"{type(item).__name__}, not dict")


def dry_run(task: Any, builder: str, agents: Any) -> None:
    """One episode of the task's user functions with placeholder outputs, before any worker
    starts: a prompt builder, condition, input sampler or reward that returns the wrong kind of
    value fails here in seconds. User code that raises on placeholder outputs (it needs real
    ones) ends the dry run quietly; the real run checks the same things on every episode.

    `agents`: the agents' names, or their configs (`{name: AgentConfig}`): then text and chat
    prompts are rendered with each agent's tokenizer too (a missing tokenizer, a bad message)."""


    renderer = PromptRenderer(agents, task.vocab_size) if isinstance(agents, Mapping) else None

    try:
        inputs = task.sample_inputs(np.random.default_rng(0), 1)
    except Exception as exc:  # noqa: BLE001 - user code
        raise ContractError(f"task {builder}: sample_inputs raised {type(exc).__name__}: "
                            f"{exc}") from exc
    check_inputs(builder, inputs)
    if not inputs:
        return
    graph = task.graph
    ctx = EpisodeContext(input_id="dry-0", trajectory_id=0, data=copy.deepcopy(inputs[0]))
    ran = []
    for name in graph.validate(agents):
        node = graph.nodes[name]
        if any(d not in ctx.outputs for d in node.inputs):
            continue
        try:
            if node.when is not None and not check_condition(name, node.when(ctx)):
                continue
            prompt = node.prompt(ctx)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - needs real outputs: the real run will tell
            return
        if isinstance(prompt, EnvSegment):  # a network agent: the real run steps its env
            return
        vocab = task.vocab_size
        if renderer is not None:
            prompt, is_text = renderer.render(name, node.agent, prompt)
            if is_text:
                vocab = model_vocab(agents[node.agent].model, task.vocab_size)
                ctx.texts[name] = ""  # placeholder text
        check_prompt(name, node.agent, prompt, vocab, task.max_seq_len)
        choices = prompt.allowed_tokens or [int(prompt.tokens[-1])]
        ctx.outputs[name] = [int(choices[i % len(choices)])
                             for i in range(prompt.max_new_tokens)]
        ran.append(name)
    checks = [("episode reward", graph.episode_reward)]
    checks += [(f"node {n!r}: reward", graph.nodes[n].reward) for n in ran]
    for what, fn in checks:
        if fn is None:
            continue
        try:
            value = fn(ctx)
        except Exception:  # noqa: BLE001 - needs real outputs
            continue
        check_reward(what, value, finite=False)  # NaN may be the placeholder's doing
