"""A text-level graph end to end on the local runtime (tiny random models, byte-level
tokenizer): prompts rendered per agent, each agent's own sampling settings, stop strings, the
decoded text handed downstream, and the trainer's recomputed log-probs equal to the sampled
ones (the ids are never re-tokenised)."""

import json

from flexmarl.config.schema import config_from_dict
from flexmarl.orchestrator.run import train
from flexmarl.policy.tokenizer import byte_tokenizer
from tests.orchestrator import text_tasks

STOPS = list("aeiou0123456789")  # frequent enough in a random model's bytes
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
         "init_std": 0.3}


def test_text_nodes_train_on_the_sampled_ids_with_per_agent_sampling(tmp_path):
    cfg = config_from_dict({
        "name": "text", "seed": 0,
        "task": {"builder": "tests.orchestrator.text_tasks:build_writer_reader"},
        "agents": {
            "writer": {"model": SMALL, "sampling": {"temperature": 0.8, "top_p": 0.95,
                                                    "max_tokens": 9, "stop": STOPS}},
            "reader": {"model": SMALL, "sampling": {"temperature": 1.3, "max_tokens": 4},
                       "algorithm": {"name": "grpo", "normalize": "agent"}},
        },
        "train": {"iterations": 1, "inputs_per_iteration": 2, "group_size": 4,
                  "micro_batch_size": 8},
        "runtime": {"kind": "local", "rollout_workers": 1, "train_workers": 1},
    })
    text_tasks.SEEN.clear()
    result = train(cfg, tmp_path / "run")
    assert len(result.records) == 1
    tok = byte_tokenizer()
    seen = text_tasks.SEEN[-2 * 2 * 4:]  # two rewards per episode (after the dry run's)
    writer_stopped = 0
    for s in seen:
        w_ids, w_text = s["write"]
        r_ids, r_text = s["read"]
        assert 1 <= len(w_ids) <= 9 and 1 <= len(r_ids) <= 4  # each agent's own budget
        full = tok.decode(w_ids, skip_special_tokens=True)
        # the text downstream sees: the sampled ids decoded, cut before the first stop string
        assert not any(c in w_text for c in STOPS) and full.startswith(w_text)
        if len(w_ids) < 9 and w_ids[-1] != tok.eos_token_id:
            assert full[-1] in STOPS  # ended by a stop string, its token kept for training
            writer_stopped += 1
        assert r_text == tok.decode(r_ids, skip_special_tokens=True)  # no stop strings
    assert writer_stopped > 0
    # samples.jsonl: the first trajectory of inputs 0 and 1 per agent, decoded as text
    kept = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted((k["agent"], k["input_id"]) for k in kept) == [
        ("reader", "0-0"), ("reader", "0-1"), ("writer", "0-0"), ("writer", "0-1")]
    for k in kept:
        assert isinstance(k["answer"], str) and isinstance(k["advantage"], float)
        assert len(tok.encode(k["answer"], add_special_tokens=False)) >= 1
    writer = next(k for k in kept if k["agent"] == "writer")
    assert "topic" in writer["prompt"] and writer["reward"] is not None
    for record in result.records:
        for agent in ("writer", "reader"):
            # the trainer recomputes the log-probs of the very ids that were sampled
            assert record[f"agent/{agent}/logprob_diff_max"] <= 1e-5
            assert record[f"agent/{agent}/rows_trained"] == 8
