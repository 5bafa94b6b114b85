"""One continuous batch over a shared base mixes requests of different adapter agents: each
row samples what its agent's adapter samples alone, and what a plain model with that adapter
merged in samples (today's per-agent replicas); an adapter loads while other agents decode."""

import copy

import pytest
import torch

from flexmarl.config.schema import config_from_dict
from flexmarl.policy import adapters
from flexmarl.rollout.engine import HFEngine, generate
from flexmarl.types import GenerationRequest

RAW = {
    "task": {"builder": "x:y"},
    "models": {"shared": {"init_std": 0.1}},
    "agents": {
        "solver": {"model": {"base": "shared"}, "lora": {"r": 4}},
        "critic": {"model": {"base": "shared"},
                   "lora": {"r": 2, "target_modules": ["q_proj", "v_proj", "o_proj"]}},
        "judge": {"model": {"base": "shared"}, "trainable": False},  # the bare base
    },
}
AGENTS = ["solver", "critic", "judge"]


@pytest.fixture(scope="module")
def shared():
    cfg = config_from_dict(RAW)
    model, names, memory = adapters.build_replica_model(cfg, AGENTS, 48, 96, "cpu",
                                                        torch.float32)
    # trained-looking adapters (B is zero at init: every agent would still be the base)
    gen = torch.Generator().manual_seed(1)
    for _, layer in adapters._lora_layers(model):
        for name in layer.lora_B:
            layer.lora_B[name].weight.data.normal_(0, 0.3, generator=gen)
    return model, names, memory


def _requests(n=12):
    return [GenerationRequest(f"r{i}_0_0", AGENTS[i % 3], 0, [1, 5 + i, 7, 9 + i % 4],
                              4 + 3 * (i % 4), None if i % 2 else list(range(10, 40)),
                              [], 0.9, 3) for i in range(n)]


def test_mixed_batch_samples_what_each_adapter_samples_alone(shared):
    model, names, _ = shared
    reqs = _requests()
    mixed = {r.sample_id: r for r in HFEngine(model, 5, adapters=names).run_to_completion(reqs)}
    merged = {}
    for agent in AGENTS:
        plain = copy.deepcopy(model)
        if names[agent] != adapters.BASE_ADAPTER:
            plain.set_adapter(names[agent])
            merged[agent] = plain.merge_and_unload()
        else:  # the bare base: adapters removed, nothing merged
            merged[agent] = plain.unload()
    for r in reqs:
        alone = HFEngine(model, 1, adapters=names).run_to_completion([r])[0]
        own = generate(merged[r.agent], [r])[0]
        got = mixed[r.sample_id]
        assert got.tokens == alone.tokens == own.tokens, r.sample_id
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs, strict=True)) < 1e-5
        assert max(abs(x - y) for x, y in zip(got.logprobs, own.logprobs, strict=True)) < 1e-4
    # the adapters really differ: the same request decodes differently per agent
    probe = [GenerationRequest("p_0_0", a, 0, [1, 5, 7], 6, None, [], 1.0, 3) for a in AGENTS]
    firsts = [HFEngine(model, 1, adapters=names).run_to_completion([p])[0].logprobs
              for p in probe]
    assert firsts[0] != firsts[1] != firsts[2] != firsts[0]


def test_adapter_loads_while_other_agents_decode(shared):
    model, names, _ = shared
    model = copy.deepcopy(model)
    engine = HFEngine(model, 8, adapters=names)
    engine.admit([GenerationRequest("c_0_0", "critic", 0, [1, 5], 30, None, [], 1.0, 0)])
    assert engine.active_for("critic") == 1 and engine.active_for("solver") == 0
    tensors = adapters.adapter_tensors(model, "agent_solver")
    new = {k: torch.zeros_like(v) for k, v in tensors.items()}
    engine.load_weights(new, "solver")  # critic's sequence keeps running
    assert all(torch.equal(v, adapters.adapter_tensors(model, "agent_solver")[k])
               for k, v in new.items())
    with pytest.raises(RuntimeError, match="critic"):
        engine.load_weights(adapters.adapter_tensors(model, "agent_critic"), "critic")
    with pytest.raises(ValueError, match="judge"):
        engine.load_weights(new, "judge")
    with pytest.raises(ValueError, match="lack"):
        engine.load_weights(dict(list(new.items())[1:]), "solver")
    with pytest.raises(ValueError, match="no adapter on this model"):
        engine.admit([GenerationRequest("x_0_0", "stranger", 0, [1], 2, None, [], 1.0, 0)])


def test_memory_per_added_agent(shared):
    _, _, memory = shared
    base, added = memory["base_bytes"], memory["agent_bytes"]
    assert added["judge"] == 0  # the bare base adds nothing
    # r=4 on q,v of 2 layers (64x64): 2 * 2 * 4 * (64 + 64) floats
    assert added["solver"] == 2 * 2 * 4 * 128 * 4
    assert added["critic"] == 2 * 3 * 2 * 128 * 4
    assert base > 20 * added["solver"]
