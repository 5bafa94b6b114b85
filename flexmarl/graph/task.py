"""A task: the graph of one episode, where episode inputs come from, and the token vocabulary.

Tasks are named in a run's YAML by import path (`package.module:function`); the function takes
the task options from the config and returns a `Task`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexmarl.config.schema import AgentConfig, NetworkSpaces
from flexmarl.errors import UserError
from flexmarl.graph.meg import MEG
from flexmarl.policy.tokenizer import pretrained_sizes


class TaskLoadError(UserError, ValueError):
    """The task's import path or its options are wrong."""


RANDOM_MODEL_SEQ_LEN = 64  # `Task.max_seq_len` when left out and some agent's model is random


@dataclass
class Task:
    """What a task builder returns: the graph of one episode, where episode inputs come from,
    and the sizes the agents' models need.

    Args:
        graph: the episode's graph (`MEG`): which agent runs where, and the rewards.
        sample_inputs: `sample_inputs(rng, n)` returns `n` episode inputs (dicts), drawn
            from the numpy Generator it is given (so a seed gives the same inputs).
        vocab_size: the token ids a prompt may hold, and the vocabulary of agents with random
            models. 0 (left out): the largest vocabulary of the agents' pretrained models
            (`model.kind: smollm2` or `path`); a task with random-model agents must give it.
        max_seq_len: a node's prompt plus its response, in tokens. 0 (left out): the
            smallest context of the agents' pretrained models, or 64 when some agent's model
            is random.
        info: anything the builder wants to keep with the task (shown nowhere).
        network_spaces: the sizes of each network-policy agent (an agent with `network:`,
            whose nodes act in an `EnvSegment`): observation, critic input, actions; the run
            copies them into the agent's config (`Task.resolve_networks`).

    Example:
        ```python
        def build_echo(max_digit: int = 9) -> Task:
            graph = MEG().node("say", agent="speaker",
                               prompt=lambda ctx: f"Repeat the digit {ctx.data['digit']}.",
                               reward=lambda ctx: float(ctx.text("say").strip()
                                                        == str(ctx.data["digit"])))
            return Task(graph=graph, sample_inputs=lambda rng, n: [
                {"digit": int(rng.integers(max_digit + 1))} for _ in range(n)])
        ```
        With a SmolLM2 agent (`model: {kind: smollm2}`) `vocab_size` and `max_seq_len` come
        from the model (49152 and 8192).
    """

    graph: MEG
    sample_inputs: Callable[[np.random.Generator, int], list[dict[str, Any]]]
    vocab_size: int = 0
    max_seq_len: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    network_spaces: dict[str, NetworkSpaces] = field(default_factory=dict)

    def resolve_networks(self, agents: Mapping[str, AgentConfig],
                         builder: str = "task") -> None:
        """Give each network agent (`agents.<name>.network`) the sizes its environment has
        (`network_spaces`), so every process builds the same network; errors name the agent."""
        for name, acfg in agents.items():
            if acfg.network is None:
                if name in self.network_spaces:
                    raise TaskLoadError(f"agents.{name}: {builder} gives network sizes for it "
                                        "(Task.network_spaces), so it acts in an environment; "
                                        f"give agents.{name} a `network:` instead of a model")
                continue
            if name not in self.network_spaces:
                raise TaskLoadError(f"agents.{name}.network: {builder} gives no sizes for it "
                                    "(Task.network_spaces); a network agent acts in the "
                                    "task's environment, whose spaces set its network's sizes")
            given = acfg.network.spaces
            spaces = self.network_spaces[name]
            if given is not None and given != spaces:
                raise TaskLoadError(f"agents.{name}.network.spaces: {given} differs from what "
                                    f"{builder} gives ({spaces}); leave it out")
            acfg.network.spaces = spaces

    def resolve_sizes(self, agents: Mapping[str, AgentConfig], builder: str = "task") -> None:
        """Fill `vocab_size` and `max_seq_len` left at 0 from the agents' models (see the
        class docstring); a random-model agent with no `vocab_size` is an error naming it."""
        sizes = {name: pretrained_sizes(a.model) for name, a in agents.items()}
        known = [s for s in sizes.values() if s is not None]
        if self.vocab_size <= 0:
            random = sorted(name for name, s in sizes.items() if s is None)
            if random or not known:
                raise TaskLoadError(
                    f"{builder}: the task gives no vocab_size, and agent(s) "
                    f"{', '.join(random) or '(none)'} have random models, whose vocabulary it "
                    "sets; give Task(vocab_size=...)")
            self.vocab_size = max(v for v, _ in known)
        if self.max_seq_len <= 0:
            if known and len(known) == len(sizes):
                self.max_seq_len = min(c for _, c in known)
            else:
                self.max_seq_len = RANDOM_MODEL_SEQ_LEN


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


def load_task(builder: str, options: dict[str, Any],
              agents: Mapping[str, AgentConfig] | None = None) -> Task:
    """The task `builder(**options)` returns, its sizes completed from `agents`' models
    (`Task.resolve_sizes`); errors name the field at fault."""
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
    task.resolve_sizes(agents or {}, f"task.builder {builder}")
    return task
