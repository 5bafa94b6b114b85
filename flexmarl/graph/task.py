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
