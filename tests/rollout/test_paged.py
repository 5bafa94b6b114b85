"""The paged KV cache: block allocator invariants, and the engine over it decoding exactly."""

import numpy as np
import pytest
import torch

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.sampling import GenerationRequest
from flexmarl.rollout.engine import ContinuousBatcher
from flexmarl.rollout.paged import NULL_BLOCK, BlockAllocator


@pytest.fixture(scope="module")
def model():
    return build_model("a", ModelConfig(init_std=0.1), vocab_size=48, max_seq_len=128, run_seed=0)


def test_allocator_never_leaks_in_any_order():
    rng = np.random.default_rng(0)
    alloc = BlockAllocator(max_blocks=40, first_chunk=4)
    held: list[list[int]] = []
    for _ in range(500):
        if held and (rng.random() < 0.45 or alloc.used > 30):
            for b in held.pop(int(rng.integers(len(held)))):
                alloc.release(b)
        else:
            held.append([alloc.allocate() for _ in range(int(rng.integers(1, 4)))])
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat)) and NULL_BLOCK not in flat  # no block handed twice
        assert alloc.used == len(flat)
        assert set(alloc.free).isdisjoint(flat)
    for blocks in held:
        for b in blocks:
            alloc.release(b)
    assert alloc.used == 0 and len(alloc.free) == alloc.capacity - 1
    assert alloc.capacity <= 40  # grew in chunks, never past its limit


def test_shared_block_is_freed_with_its_last_reader():
    alloc = BlockAllocator(max_blocks=8)
    b = alloc.allocate()
    alloc.share(b)
    alloc.release(b)
    assert b not in alloc.free and alloc.used == 1
    alloc.release(b)
    assert b in alloc.free and alloc.used == 0
    with pytest.raises(AssertionError, match="released twice"):
        alloc.release(b)


def _long_tailed(n, seed, vocab=48):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(2.3, 0.8, size=n)), 4, 64).astype(int)
    return [GenerationRequest(f"t-{i}_0_0", "a", 0,
                              [1] + rng.integers(5, vocab, size=int(rng.integers(1, 20))).tolist(),
                              int(lengths[i]), None, [], 1.0, 5) for i in range(n)]


def _recomputed(model, req, res):
    """The trainer's view: one forward over prompt + response, no cache at all."""
    ids = torch.tensor([req.prompt + res.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(req.prompt) - 1:-1]
    return logp.gather(1, torch.tensor(res.tokens).unsqueeze(1)).squeeze(1)


def test_long_tailed_batch_equals_one_at_a_time_and_the_trainer(model):
    reqs = _long_tailed(8, seed=3)
    # block size 4: sequences cross many block boundaries, join and leave at every offset
    batched = ContinuousBatcher(model, max_seqs=5, block_size=4)
    out = {r.sample_id: r for r in batched.run_to_completion(reqs)}
    assert batched.allocator.used == 0  # every block came back
    for req in reqs:
        alone = ContinuousBatcher(model, max_seqs=1, block_size=16).run_to_completion([req])[0]
        res = out[req.sample_id]
        assert res.tokens == alone.tokens and len(res.tokens) == req.max_new_tokens
        assert np.allclose(res.logprobs, alone.logprobs, atol=1e-5)
        assert torch.allclose(_recomputed(model, req, res), torch.tensor(res.logprobs),
                              atol=1e-5)


def test_cache_exhaustion_queues_instead_of_failing(model):
    reqs = _long_tailed(10, seed=4)
    engine = ContinuousBatcher(model, max_seqs=8, max_tokens=90, block_size=4)
    most = 0
    queue, done = list(reqs), {}
    while queue or engine.active:
        take = []
        while queue and engine.fits(queue[0], len(take), sum(engine.budget(r) for r in take)):
            take.append(queue.pop(0))
        for res in engine.admit(take) + engine.step():
            done[res.sample_id] = res
        most = max(most, engine.allocator.used)
        assert engine.active < 8  # the token budget, not max_seqs, bounded the batch
    assert set(done) == {r.sample_id for r in reqs}
    assert most <= engine.allocator.max_blocks - 1 and engine.allocator.used == 0


def test_kv_bytes_follow_held_tokens(model):
    reqs = _long_tailed(16, seed=5)
    engine = ContinuousBatcher(model, max_seqs=16, block_size=4)
    engine.admit(reqs)
    for _ in range(6):
        engine.step()
    stats = engine.kv_stats()
    held = sum(s.kv for s in engine.seqs)
    assert stats.held_tokens == held and stats.blocks_in_use > 0
    # at most one partly filled block per sequence on top of the held tokens
    assert stats.blocks_in_use * 4 <= held + 3 * len(engine.seqs)
    padded = len(engine.seqs) * max(s.kv for s in engine.seqs) * stats.bytes_per_token
    assert stats.bytes_per_held_token * held < padded
    assert 0 < stats.fraction_in_use <= 1


def _groups(n_groups, size, seed, prompt_len):
    rng = np.random.default_rng(seed)
    reqs = []
    for g in range(n_groups):
        prompt = [1] + rng.integers(5, 48, size=prompt_len - 1).tolist()
        reqs += [GenerationRequest(f"g{g}-{k}_0_0", "a", 0, prompt, int(rng.integers(3, 30)),
                                   None if k % 2 else list(range(10, 40)), [],
                                   0.8 + 0.1 * (k % 3), 7) for k in range(size)]
    return reqs


@pytest.mark.parametrize("prompt_len", [8, 11])  # whole blocks; a partly filled last block
def test_shared_prefix_decodes_as_unshared(model, prompt_len):
    reqs = _groups(2, 3, seed=prompt_len, prompt_len=prompt_len)
    engine = ContinuousBatcher(model, max_seqs=6, block_size=4)
    results = {r.sample_id: r for r in engine.admit(reqs)}
    # each group prefilled once: its full blocks are held once, read by all three samples
    full = prompt_len // 4
    assert engine.allocator.used == 2 * full + 6 * (prompt_len % 4 > 0)
    assert all(engine.allocator.refs[b] == 3 for s in engine.seqs[:2] for b in s.blocks[:full])
    while engine.active:
        for res in engine.step():
            results[res.sample_id] = res
    assert engine.allocator.used == 0
    for req in reqs:
        alone = ContinuousBatcher(model, max_seqs=1).run_to_completion([req])[0]
        res = results[req.sample_id]
        assert res.tokens == alone.tokens, req.sample_id
        assert np.allclose(res.logprobs, alone.logprobs, atol=1e-5)
