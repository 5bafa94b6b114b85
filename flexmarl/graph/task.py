"""A task: the graph of one episode, where episode inputs come from, and the token vocabulary.

Tasks are named in a run's YAML by import path (`package.module:function`); the function takes
the task options from the config and returns a `Task`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.errors import UserError
from flexmarl.graph.meg import MEG


class TaskLoadError(UserError, ValueError):
    """The task's import path or its options are wrong."""


@dataclass
class Task:
    """What a task builder returns: one episode's graph, its inputs and its token space.

    Attributes:
        graph: the episode's agent invocations and rewards ([`MEG`][flexmarl.graph.meg.MEG]).
        vocab_size: the token vocabulary of models built from scratch (`model.kind: tiny` and
            the other random-init kinds) and the range token-level prompts
            ([`NodePrompt`][flexmarl.graph.meg.NodePrompt]) are checked against. An agent with
            a pretrained model uses its model's own vocabulary instead, derived without
            loading the weights (`kind: smollm2`: 49152; `kind: path`: `vocab_size` of the
            folder's `config.json`), so a text-level task for pretrained agents may give any
            value (the shipped ones give the byte tokenizer's 261, used by the tiny model).
        sample_inputs: `sample_inputs(rng, n)` returns `n` episode inputs, each a dict that
            prompt builders and rewards read as `ctx.data`; the `train.group_size`
            trajectories of one input form a GRPO group.
        max_seq_len: the longest prompt plus response, in tokens, of any node: the context
            window of models built from scratch, and the bound each node's prompt plus
            `max_new_tokens` is checked against. It is not read from a pretrained model: keep
            it within the model's context length.
        info: free-form facts about the task (the simulator's tasks record their layout).

    Example:
        ```python
        graph = MEG().node("say", agent="speaker", prompt=lambda ctx: ctx.data["question"],
                           reward=lambda ctx: float("yes" in ctx.text("say")))
        task = Task(graph=graph, vocab_size=49152, max_seq_len=256,
                    sample_inputs=lambda rng, n: [{"id": str(i), "question": "Ready?"}
                                                  for i in range(n)])
        ```
    """

    graph: MEG
    vocab_size: int
    sample_inputs: Callable[[np.random.Generator, int], list[dict[str, Any]]]
    max_seq_len: int = 64
    info: dict[str, Any] = field(default_factory=dict)


def resolve_import(path: str, field_name: str = "task.builder") -> Any:
    """`package.module:attr` -> the object, with an error naming the field and what failed."""
    if ":" not in path:
        raise TaskLoadError(f"{field_name}: {path!r} is not of the form 'package.module:function'")
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskLoadError(f"{field_name}: cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module fails while importing
        raise TaskLoadError(f"{field_name}: importing module {module_name!r} raised "
                            f"{type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise TaskLoadError(
            f"{field_name}: module {module_name!r} has no attribute {attr!r}"
        ) from exc


def load_task(builder: str, options: dict[str, Any]) -> Task:
    """Import `builder` (`package.module:function`), call it with `options` and check that it
    returned a [`Task`][flexmarl.graph.task.Task]; every failure is a
    [`TaskLoadError`][flexmarl.graph.task.TaskLoadError] naming the field at fault.

    Example:
        ```python
        task = load_task("flexmarl.tasks.math:build_math_pair", {"max_operand": 20})
        ```
    """
    fn = resolve_import(builder)
    if not callable(fn):
        raise TaskLoadError(f"task.builder: {builder!r} is not callable")
    try:
        task = fn(**options)
    except UserError:
        raise
    except TypeError as exc:
        raise TaskLoadError(f"task.options: {builder} rejected the options: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's builder fails: name it, no traceback
        raise TaskLoadError(f"task.builder: {builder}(**task.options) raised "
                            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskLoadError(f"task.builder: {builder!r} returned {type(task).__name__}, not Task")
    return task
