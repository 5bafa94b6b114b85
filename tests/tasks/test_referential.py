import numpy as np
import pytest

from flexmarl.graph.meg import EpisodeContext, GraphError
from flexmarl.tasks.referential import build_referential_game, build_relay_chain


def test_referential_game_prompts_masks_and_reward():
    task = build_referential_game(num_objects=8, num_candidates=4, num_symbols=16)
    data = task.sample_inputs(np.random.default_rng(0), 5)
    assert all(d["target"] in d["candidates"] and len(set(d["candidates"])) == 4 for d in data)
    ctx = EpisodeContext("0-0", 0, data[0])
    speak = task.graph.nodes["speak"].prompt(ctx)
    assert speak.tokens[-1] == data[0]["target"] and len(speak.allowed_tokens) == 16
    ctx.outputs["speak"] = [speak.allowed_tokens[3]]
    listen = task.graph.nodes["listen"].prompt(ctx)
    assert listen.allowed_tokens == data[0]["candidates"] and listen.tokens[-1] == ctx.outputs[
        "speak"][0]
    ctx.outputs["listen"] = [data[0]["target"]]
    assert task.graph.episode_reward(ctx) == 1.0 and task.graph.success(ctx)
    ctx.outputs["listen"] = [c for c in data[0]["candidates"] if c != data[0]["target"]][:1]
    assert task.graph.episode_reward(ctx) == 0.0
    assert max(max(p.tokens + p.allowed_tokens) for p in (speak, listen)) < task.vocab_size


def test_relay_chain_is_a_three_agent_chain_with_a_long_middle():
    task = build_relay_chain(message_length=1, relay_length=4)
    assert task.graph.validate(["speaker", "relay", "listener"]) == ["speak", "relay", "listen"]
    ctx = EpisodeContext("0-0", 0, task.sample_inputs(np.random.default_rng(1), 1)[0])
    ctx.outputs["speak"] = [20]
    assert task.graph.nodes["relay"].prompt(ctx).max_new_tokens == 4


@pytest.mark.parametrize("options,field", [
    ({"num_objects": 1}, "num_objects"),
    ({"num_candidates": 9}, "num_candidates"),
    ({"message_length": 0}, "message_length"),
])
def test_bad_options_name_the_option(options, field):
    with pytest.raises(GraphError, match=f"task.options.{field}"):
        build_referential_game(**options)
