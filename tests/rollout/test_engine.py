"""Continuous batching: a sequence decodes the same alone or inside a changing batch."""

import numpy as np
import pytest

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import ContinuousBatcher, generate
from flexmarl.types import GenerationRequest


@pytest.fixture(scope="module")
def model():
    return build_model("a", ModelConfig(init_std=0.1), vocab_size=48, max_seq_len=96, run_seed=0)


def _requests(n=20, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = [1] + rng.integers(5, 40, size=int(rng.integers(1, 9))).tolist()
        allowed = None if i % 3 == 0 else list(range(10, 40))
        max_new = int(rng.choice([2, 3, 5, 40])) if i % 4 else 60  # long tail
        stops = [7] if i % 5 == 0 else []
        reqs.append(GenerationRequest(f"x-{i}_0_0", "a", 0, prompt, max_new, allowed, stops,
                                      0.9 + 0.05 * (i % 3), 3))
    return reqs


def _close(a, b):
    assert a.tokens == b.tokens, (a.sample_id, a.tokens, b.tokens)
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)),
               default=0.0) < 1e-5


def test_continuous_batch_equals_alone(model):
    reqs = _requests()
    alone = {r.sample_id: generate(model, [r])[0] for r in reqs}
    # a small batch: requests join as others finish, at many different cache offsets
    batched = ContinuousBatcher(model, max_seqs=5).run_to_completion(reqs)
    for res in batched:
        _close(alone[res.sample_id], res)
    for req, res in zip(reqs, batched, strict=True):
        assert res.sample_id == req.sample_id
        if not req.stop_tokens:
            assert len(res.tokens) == req.max_new_tokens
        if req.allowed_tokens is not None:
            assert set(res.tokens) <= set(req.allowed_tokens)


def test_admission_between_steps(model):
    """Newcomers admitted mid-decode (staggered arrivals) change nothing for anyone."""
    reqs = _requests(12, seed=1)
    alone = {r.sample_id: generate(model, [r])[0] for r in reqs}
    engine = ContinuousBatcher(model, max_seqs=64)
    out = {}
    pending = list(reqs)
    while pending or engine.active:
        if pending:
            for res in engine.admit([pending.pop(0)]):
                out[res.sample_id] = res
        for res in engine.step():
            out[res.sample_id] = res
    assert set(out) == set(alone)
    for sid, res in out.items():
        _close(alone[sid], res)


def test_budgets_bound_the_batch(model):
    engine = ContinuousBatcher(model, max_seqs=3, max_tokens=40)
    reqs = _requests(6, seed=2)
    big = GenerationRequest("big-0_0_0", "a", 0, [1, 5, 6], 100, None, [], 1.0, 0)
    assert engine.fits(big)  # an empty batch always takes one, however long
    engine.admit([big])
    assert not engine.fits(reqs[0])  # the KV budget is spent
    assert engine.kv_budget_used() == 103
    seen_max = 0
    done = ContinuousBatcher(model, max_seqs=3)
    queue = list(reqs)
    while queue or done.active:
        take = []
        while queue and done.fits(queue[0], take):
            take.append(queue.pop(0))
        done.admit(take)
        seen_max = max(seen_max, done.active)
        done.step()
    assert seen_max == 3


def test_sleep_releases_the_kv_pool_and_wake_gives_the_same_tokens(model):
    """A colocated replica's engine (runtime.colocate): asleep it holds no KV pool and admits
    nothing; a version loaded while asleep is the one it generates with once awake; and
    what it generates after a wake is what a fresh engine generates (CPU: the weights stay in
    host memory, only the KV cache is released)."""
    import copy
    import dataclasses

    import torch

    from flexmarl.rollout.engine import HFEngine

    reqs = [dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, 6))
            for r in _requests(4, seed=3)]
    engine = HFEngine(copy.deepcopy(model), max_seqs=4)
    before = engine.run_to_completion(reqs)
    held = engine.memory()
    assert held["kv_pool_bytes"] > 0 and not held["asleep"]
    assert held["weights_device_bytes"] == 0 and held["weights_host_bytes"] > 0  # a CPU
    released = engine.sleep()
    assert released == {"kv_bytes": held["kv_pool_bytes"], "weight_bytes": 0}
    asleep = engine.memory()
    assert asleep["asleep"] and asleep["kv_pool_bytes"] == 0
    assert engine.sleep() == {"kv_bytes": 0, "weight_bytes": 0}  # already asleep
    with pytest.raises(RuntimeError, match="this engine is asleep"):
        engine.admit(reqs[:1])
    # a new version published while asleep: it loads into the host copy
    new = {k: v + 0.01 for k, v in model.state_dict().items() if k.endswith("weight")}
    engine.load_weights(new)
    assert engine.wake()["kv_bytes"] == held["kv_pool_bytes"]
    assert engine.memory()["kv_pool_bytes"] == held["kv_pool_bytes"]
    fresh_model = copy.deepcopy(model)
    fresh_model.load_state_dict(new, strict=False)
    fresh = HFEngine(fresh_model, max_seqs=4).run_to_completion(reqs)
    woken = engine.run_to_completion(reqs)
    for a, b in zip(fresh, woken, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert any(a.tokens != b.tokens for a, b in zip(before, woken, strict=True))
    engine.admit(reqs[:1])
    with pytest.raises(RuntimeError, match="cannot sleep with 1 sequences running"):
        engine.sleep()
    assert torch.equal(engine.model.lm_head.weight, fresh_model.lm_head.weight)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_on_a_gpu_moves_the_weights_to_host_and_frees_the_device(model):
    """On a GPU a sleeping engine holds nothing on the device (weights in pinned host memory,
    KV pool freed, allocator cache emptied) and generates the same tokens once awake."""
    import copy

    import torch

    from flexmarl.rollout.engine import HFEngine

    reqs = _requests(4, seed=3)
    base = torch.cuda.memory_allocated()
    engine = HFEngine(copy.deepcopy(model).cuda(), max_seqs=4)
    before = engine.run_to_completion(reqs)
    held = engine.memory()
    assert held["weights_device_bytes"] > 0 and held["kv_pool_bytes"] > 0
    released = engine.sleep()
    assert released["weight_bytes"] == held["weights_device_bytes"]
    asleep = engine.memory()
    assert asleep["weights_device_bytes"] == 0 and asleep["kv_pool_bytes"] == 0
    assert all(p.is_pinned() for p in engine.model.parameters())
    # nothing of the engine's left on the device (a few KB: its empty per-batch tensors)
    assert torch.cuda.memory_allocated() - base < 1 << 16
    engine.wake()
    assert engine.memory()["weights_device_bytes"] == held["weights_device_bytes"]
    after = engine.run_to_completion(reqs)
    assert [r.tokens for r in before] == [r.tokens for r in after]
