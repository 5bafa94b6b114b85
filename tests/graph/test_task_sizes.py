"""A task's sizes left out are taken from the agents' pretrained models; a random model's
vocabulary must be given."""

import json

import pytest

from flexmarl.config.schema import AgentConfig
from flexmarl.graph.meg import MEG
from flexmarl.graph.task import RANDOM_MODEL_SEQ_LEN, Task, TaskLoadError


def _task(**sizes) -> Task:
    graph = MEG().node("say", agent="a", prompt=lambda ctx: "hi")
    return Task(graph=graph, sample_inputs=lambda rng, n: [{}] * n, **sizes)


def _pretrained(tmp_path, vocab: int, context: int) -> AgentConfig:
    folder = tmp_path / f"m{vocab}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"vocab_size": vocab, "max_position_embeddings": context}))
    return AgentConfig.model_validate({"model": {"kind": "path", "path": str(folder)}})


def test_sizes_come_from_pretrained_models(tmp_path):
    task = _task()
    task.resolve_sizes({"a": _pretrained(tmp_path, 300, 512),
                        "b": _pretrained(tmp_path, 320, 256)})
    assert (task.vocab_size, task.max_seq_len) == (320, 256)  # every id fits, every context
    smol = _task()
    smol.resolve_sizes({"a": AgentConfig.model_validate({"model": {"kind": "smollm2"}})})
    assert (smol.vocab_size, smol.max_seq_len) == (49152, 8192)


def test_given_sizes_stay_and_random_models_need_a_vocabulary(tmp_path):
    given = _task(vocab_size=40, max_seq_len=12)
    given.resolve_sizes({"a": _pretrained(tmp_path, 300, 512)})
    assert (given.vocab_size, given.max_seq_len) == (40, 12)
    random = _task(vocab_size=40)
    random.resolve_sizes({"a": AgentConfig()})
    assert random.max_seq_len == RANDOM_MODEL_SEQ_LEN
    with pytest.raises(TaskLoadError, match=r"agent\(s\) a have random models.*vocab_size"):
        _task().resolve_sizes({"a": AgentConfig()})
