"""The paged KV cache: block allocator invariants, and the engine over it decoding exactly."""

import numpy as np
import pytest
import torch

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import ContinuousBatcher, HFEngine
from flexmarl.rollout.paged import NULL_BLOCK, BlockAllocator
from flexmarl.types import GenerationRequest


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
    # every block came back, but those the prefix cache keeps (and a flush hands back)
    assert batched.prefix is not None and batched.allocator.used == len(batched.prefix) > 0
    batched.prefix.flush()
    assert batched.allocator.used == 0
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
        while queue and engine.fits(queue[0], take):
            take.append(queue.pop(0))
        for res in engine.admit(take) + engine.step():
            done[res.sample_id] = res
        most = max(most, engine.allocator.used)
        assert engine.active < 8  # the token budget, not max_seqs, bounded the batch
    assert set(done) == {r.sample_id for r in reqs}
    # the pool never outgrew its budget: the prefix cache gave blocks back under pressure
    assert most <= engine.allocator.max_blocks - 1
    assert engine.allocator.capacity <= engine.allocator.max_blocks
    assert engine.prefix is not None and engine.allocator.used == len(engine.prefix)


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
    # three samples and the prefix cache
    assert all(engine.allocator.refs[b] == 4 for s in engine.seqs[:2] for b in s.blocks[:full])
    while engine.active:
        for res in engine.step():
            results[res.sample_id] = res
    assert engine.prefix is not None
    engine.prefix.flush()
    assert engine.allocator.used == 0
    for req in reqs:
        alone = ContinuousBatcher(model, max_seqs=1).run_to_completion([req])[0]
        res = results[req.sample_id]
        assert res.tokens == alone.tokens, req.sample_id
        assert np.allclose(res.logprobs, alone.logprobs, atol=1e-5)


def test_admission_counts_a_group_prompt_once_and_the_pool_stays_in_budget(model):
    # 2 groups of 4 on a 33-token prompt, 8 new tokens each: full budgets would be 8 x 41 =
    # 328 tokens; shared, each group holds its 32 full prompt tokens once: 2 x 32 + 8 x 9 = 136
    reqs = _groups(2, 4, seed=5, prompt_len=33)
    for r in reqs:
        r.max_new_tokens = 8
    engine = ContinuousBatcher(model, max_seqs=8, max_tokens=140, block_size=4)
    take = []
    while len(take) < len(reqs) and engine.fits(reqs[len(take)], take):
        take.append(reqs[len(take)])
    assert len(take) == 8  # unshared budgets would have stopped at 3
    engine.admit(take)
    assert engine.kv_budget_used() == 136
    assert engine.allocator.capacity <= engine.allocator.max_blocks
    # a later member of a running group shares through the prefix cache: it is counted so
    late = ContinuousBatcher(model, max_seqs=8, max_tokens=140, block_size=4)
    late.admit(reqs[:1])
    assert late.budget(reqs[1]) == 41 - 32 and late.budget(reqs[4]) == 41
    res = late.admit(reqs[1:2])
    assert not res and late.prefix is not None and late.prefix.hits == 8
    assert late.kv_budget_used() == 41 + 9
    while late.active:  # retiring releases the group's count: nothing left over
        late.step()
    assert late.kv_budget_used() == 0 and not late._running_keys
    # without a prefix cache a later member shares nothing, and is counted in full
    plain = ContinuousBatcher(model, max_seqs=8, max_tokens=140, block_size=4,
                              prefix_cache=False)
    plain.admit(reqs[:1])
    assert plain.budget(reqs[1]) == 41


def test_admission_budget_carried_on_between_fits_calls_equals_a_fresh_sum(model):
    """`fits` carries its sum over `take` on from the last call (an admission loop appends one
    request at a time); every answer equals a fresh sum's, also for another list and after
    the running batch changed."""
    reqs = _groups(3, 3, seed=2, prompt_len=13) + _long_tailed(6, seed=3)
    engine = ContinuousBatcher(model, max_seqs=16, max_tokens=150, block_size=4)
    engine.admit(reqs[:2])

    def fresh(take):
        engine._fits_memo = None
        return engine._budget_with(list(take))[0]

    take: list = []
    answers = []
    for r in reqs[2:]:
        answers.append(engine.fits(r, take))
        assert engine._budget_with(take)[0] == fresh(take)
        engine._budget_with(take)  # the memo of this very list again, as the loop leaves it
        take.append(r)
    assert answers[0] and not answers[-1]  # the budget runs out on the way
    assert engine._budget_with(take)[0] == fresh(take)
    assert engine._budget_with(take[:3])[0] == fresh(take[:3])  # another list
    engine._budget_with(take)
    while engine.active == 2:  # the batch changes (a retirement), its version with it
        engine.step()
    assert engine._budget_with(take)[0] == fresh(take)


def _request(sample_id, prompt, n, version=0):
    return GenerationRequest(sample_id, "a", version, prompt, n, None, [], 1.0, 11)


def _same(a, b):
    assert a.tokens == b.tokens
    assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_prefix_cache_serves_a_later_admission_exactly(model):
    prompt = [1] + list(range(5, 18))  # 14 tokens: 3 full blocks of 4
    engine = ContinuousBatcher(model, max_seqs=4, block_size=4)
    engine.run_to_completion([_request("first_0_0", prompt, 6)])
    assert engine.prefix is not None and len(engine.prefix) >= 3
    later = _request("second_0_0", prompt + [20, 21, 22], 9)
    used_before = engine.allocator.used
    res = engine.run_to_completion([later])[0]
    assert engine.prefix.hits == 3  # its first 12 prompt tokens were not prefilled again
    uncached = ContinuousBatcher(model, max_seqs=4, block_size=4, prefix_cache=False)
    _same(res, uncached.run_to_completion([later])[0])
    assert uncached.allocator.used == 0
    assert torch.allclose(_recomputed(model, later, res), torch.tensor(res.logprobs), atol=1e-5)
    assert engine.allocator.used >= used_before  # the new turn's blocks joined the cache


def test_next_turn_reuses_the_conversation_including_its_response(model):
    engine = ContinuousBatcher(model, max_seqs=4, block_size=4)
    turn1 = _request("ep0/turn1_0_0", [1] + list(range(5, 15)), 12)
    out1 = engine.run_to_completion([turn1])[0]
    conversation = turn1.prompt + out1.tokens + [3, 7, 9]
    turn2 = _request("ep0/turn2_0_0", conversation, 8)
    assert engine.prefix is not None
    hits = engine.prefix.hits
    out2 = engine.run_to_completion([turn2])[0]
    # the blocks of the first turn's response (fed back while decoding) were reused too
    fed = len(turn1.prompt) + len(out1.tokens) - 1
    assert engine.prefix.hits - hits == fed // 4 > len(turn1.prompt) // 4
    _same(out2, ContinuousBatcher(model, 4, block_size=4, prefix_cache=False)
          .run_to_completion([turn2])[0])
    assert torch.allclose(_recomputed(model, turn2, out2), torch.tensor(out2.logprobs),
                          atol=1e-5)


def test_prefix_cache_is_flushed_when_weights_load():
    net = build_model("a", ModelConfig(init_std=0.1), vocab_size=48, max_seq_len=128, run_seed=0)
    engine = HFEngine(net, 4, block_size=4)
    prompt = [1] + list(range(5, 20))
    engine.run_to_completion([_request("v0_0_0", prompt, 5)])
    assert engine.prefix is not None and len(engine.prefix) > 0
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in net.state_dict().items()}
    engine.load_weights(new)
    assert len(engine.prefix) == 0 and engine.allocator.used == 0
    req = _request("v1_0_0", prompt + [30], 7, version=1)
    res = engine.run_to_completion([req])[0]
    assert engine.prefix.hits == 0  # nothing of version 0 was read by version 1
    fresh = build_model("a", ModelConfig(init_std=0.1), vocab_size=48, max_seq_len=128,
                        run_seed=0)
    fresh.load_state_dict(new)
    _same(res, ContinuousBatcher(fresh, 4, block_size=4).run_to_completion([req])[0])


def test_prefix_cache_evicts_least_recently_used_under_pressure_without_leaks(model):
    # a budget of 64 KV tokens (+ a block per sequence): far less than 8 rounds cache
    engine = ContinuousBatcher(model, max_seqs=2, max_tokens=64, block_size=4)
    assert engine.prefix is not None
    rng = np.random.default_rng(9)
    hot = [1] + rng.integers(5, 48, size=12).tolist()
    for i in range(8):
        cold = [2] + rng.integers(5, 48, size=15).tolist()
        engine.run_to_completion([_request(f"cold{i}_0_0", cold, 8),
                                  _request(f"hot{i}_0_0", hot + [5 + i], 4)])
        assert engine.allocator.capacity <= engine.allocator.max_blocks
        assert engine.allocator.used == len(engine.prefix)  # no block outside the cache
        assert all(engine.allocator.refs[b] == 1 for b in engine.prefix.blocks.values())
    # the hot prefix, used every round, stayed; cold ones were evicted
    assert engine.prefix.hits >= 3 * 7
    assert len(engine.prefix) < 8 * 5  # 5 blocks each cold request cached
    engine.prefix.flush()
    assert engine.allocator.used == 0 and len(engine.allocator.free) == \
        engine.allocator.capacity - 1


def _decode_modes_agree(model, mode):
    reqs = _long_tailed(8, seed=3)
    eager = ContinuousBatcher(model, max_seqs=5, block_size=4).run_to_completion(reqs)
    engine = ContinuousBatcher(model, max_seqs=5, block_size=4, decode=mode)
    # the batch shrinks and grows through buckets of 1-8 rows and 1-32 blocks
    for a, b in zip(eager, engine.run_to_completion(reqs), strict=True):
        assert a.tokens == b.tokens, a.sample_id
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert engine.prefix is not None
    engine.prefix.flush()
    assert engine.allocator.used == 0


def test_bucketed_static_decode_steps_sample_the_same_tokens(model):
    _decode_modes_agree(model, "static")


@pytest.mark.slow  # one compilation per bucket: minutes on a CPU
def test_compiled_decode_steps_sample_the_same_tokens(model):
    _decode_modes_agree(model, "compile")


def test_cuda_graph_decode_needs_a_cuda_model(model):
    with pytest.raises(ValueError, match="needs a CUDA model"):
        ContinuousBatcher(model, decode="cuda_graph")


def test_lean_forward_equals_the_transformers_forward_with_grouped_queries():
    """The engine's own Llama prefill and decode step (rotary table, queries and keys rotated
    together, resolved layers, grouped-query attention) sample what transformers' forward
    samples, also after new weights are loaded in place."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2)
    net = LlamaForCausalLM(cfg).eval()
    reqs = [_request(f"g{i}_0_0", [1] + list(range(3 + i, 12 + 2 * i)), 6 + 4 * i)
            for i in range(3)]
    lean = ContinuousBatcher(net, 4, block_size=4)
    assert lean._lean and lean._kv_groups == 3
    slow = ContinuousBatcher(net, 4, block_size=4)
    slow._lean = False
    for a, b in zip(lean.run_to_completion(reqs), slow.run_to_completion(reqs), strict=True):
        _same(a, b)
    # the table is the model's own rotary output to the bit (the sin's first half negated)
    table = lean._rope_for(40)
    assert table is not None
    cos, sin = net.model.rotary_emb(torch.empty(0), torch.arange(40).unsqueeze(0))
    assert torch.equal(table[:40, 0], cos[0])
    assert torch.equal(table[:40, 1, 4:], sin[0, :, 4:])
    assert torch.equal(table[:40, 1, :4], -sin[0, :, :4])
    before = lean.run_to_completion(reqs[:1])[0]
    with torch.no_grad():  # new weights, copied into the parameters as a version load does
        net.load_state_dict({k: v * 1.5 for k, v in net.state_dict().items()})
    after = lean.run_to_completion(reqs[:1])[0]
    _same(after, slow.run_to_completion(reqs[:1])[0])
    assert after.logprobs != before.logprobs


@pytest.mark.slow  # loads the 135M model: about a minute on a loaded 2-core machine
def test_lean_llama_step_equals_the_transformers_forward_on_smollm2():
    """SmolLM2-135M (grouped-query attention, tied embeddings, its RoPE base): the engine's
    own Llama decode step samples what transformers' forward samples."""
    from flexmarl.policy.smollm import SmolLMUnavailable

    try:
        net = build_model("a", ModelConfig(kind="smollm2"), 49152, 256, 0)
    except SmolLMUnavailable as exc:
        pytest.skip(str(exc))
    reqs = [_request(f"s{i}_0_0", [1, 9690, 30, 2683 + i, 28, 253], 6) for i in range(3)]
    lean = ContinuousBatcher(net, 3)
    assert lean._lean and lean._kv_groups == 3
    slow = ContinuousBatcher(net, 3)
    slow._lean = False
    for a, b in zip(lean.run_to_completion(reqs), slow.run_to_completion(reqs), strict=True):
        _same(a, b)


def test_prefix_cache_hashes_by_namespace_and_flushes_one_agent():
    from flexmarl.rollout.paged import PrefixCache, block_hashes

    alloc = BlockAllocator(max_blocks=16)
    cache = PrefixCache(alloc, 4)
    tokens = list(range(12))
    ha = block_hashes(("a", "lora_a", 0), tokens, 4, 3)
    assert block_hashes(("a", "lora_a", 1), tokens, 4, 3)[0] != ha[0]  # another version
    assert block_hashes(("b", "lora_a", 0), tokens, 4, 3)[0] != ha[0]  # another agent
    assert block_hashes(("a", "lora_a", 0), [0, 1, 2, 3, 9, 9, 9, 9], 4, 2)[0] == ha[0]
    hb = block_hashes(("b", "lora_b", 0), tokens, 4, 3)
    blocks_a = [alloc.allocate() for _ in range(3)]
    blocks_b = [alloc.allocate() for _ in range(3)]
    cache.insert("a", ha, blocks_a)
    cache.insert("b", hb, blocks_b)
    for b in blocks_a + blocks_b:  # the sequences leave; the cache keeps the blocks
        alloc.release(b)
    assert alloc.used == 6 and cache.match(ha[:2]) == blocks_a[:2]
    for b in blocks_a[:2]:
        alloc.release(b)
    cache.flush("a")  # agent a's adapter loaded: its blocks go, b's stay
    assert len(cache) == 3 and alloc.used == 3 and cache.match(ha) == []
    assert cache.evict(10) == 3 and alloc.used == 0
