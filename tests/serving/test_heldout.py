"""A canary's held-out score walks the graph with the training executor's nodes: text-level
prompts rendered with the agent's tokenizer, downstream nodes reading the decoded text, the
same noise for the same inputs (so one set of weights scores the same twice)."""

import numpy as np

from flexmarl.config.schema import config_from_dict
from flexmarl.graph.chat import PromptRenderer
from flexmarl.graph.executor import GraphExecutor
from flexmarl.policy.model import build_model
from flexmarl.policy.tokenizer import byte_tokenizer
from flexmarl.serving.deploy import heldout_score
from tests.orchestrator import text_tasks

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
         "init_std": 0.3}


def test_heldout_score_runs_text_level_graphs_as_training_does():
    cfg = config_from_dict({
        "task": {"builder": "tests.orchestrator.text_tasks:build_writer_reader"},
        "agents": {"writer": {"model": SMALL, "sampling": {"max_tokens": 6, "stop": ["e"]}},
                   "reader": {"model": SMALL, "sampling": {"max_tokens": 3}}}})
    task = text_tasks.build_writer_reader()
    executor = GraphExecutor(task.graph, PromptRenderer(cfg.agents, task.vocab_size),
                             cfg.agents)
    models = {a: build_model(a, c.model, task.vocab_size, task.max_seq_len, 0)
              for a, c in cfg.agents.items()}
    inputs = task.sample_inputs(np.random.default_rng(0), 4)
    temps = {a: 1.0 for a in cfg.agents}
    text_tasks.SEEN.clear()
    score = heldout_score(executor, models, inputs, temps, seed=5)
    assert score == heldout_score(executor, models, inputs, temps, seed=5)
    tok = byte_tokenizer()
    assert len(text_tasks.SEEN) == 2 * 2 * 4  # two rewards per episode, two scorings
    for seen in text_tasks.SEEN:
        ids, text = seen["write"]
        assert 1 <= len(ids) <= 6 and "e" not in text  # its budget; cut before the stop string
        assert tok.decode(ids, skip_special_tokens=True).startswith(text)
        assert len(seen["read"][0]) <= 3
