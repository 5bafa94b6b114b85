import numpy as np
import torch

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.sampling import (
    GenerationRequest,
    generate,
    make_token_batch,
    response_logprobs,
)


def _model():
    return build_model("a", ModelConfig(init_std=0.3), vocab_size=40, max_seq_len=32, run_seed=0)


def _requests():
    reqs = []
    for i in range(12):
        prompt = [1] + [5 + (i * 7 + j) % 30 for j in range(1 + i % 5)]
        allowed = None if i % 3 == 0 else list(range(10, 30))
        reqs.append(GenerationRequest(f"x-{i}_0_0", "a", 0, prompt, 3 + i % 4, allowed, [], 1.0, 7))
    return reqs


def test_batched_equals_alone():
    torch.manual_seed(0)
    model = _model()
    reqs = _requests()
    batched = generate(model, reqs)
    for req, res in zip(reqs, batched, strict=True):
        alone = generate(model, [req])[0]
        assert alone.tokens == res.tokens
        assert max(abs(a - b) for a, b in zip(alone.logprobs, res.logprobs, strict=True)) < 1e-5
        assert len(res.tokens) == req.max_new_tokens
        if req.allowed_tokens is not None:
            assert set(res.tokens) <= set(req.allowed_tokens)


def test_sampling_is_keyed_by_sample_id_and_version():
    model = _model()
    req = _requests()[1]
    again = generate(model, [req])[0]
    assert generate(model, [req])[0].tokens == again.tokens
    others = {tuple(generate(model, [GenerationRequest(**{**req.__dict__, "version": v})])[0]
                    .tokens) for v in range(8)}
    assert len(others) > 1


def test_training_logprobs_match_generation():
    model = _model()
    reqs = _requests()
    res = generate(model, reqs)
    batch = make_token_batch([r.prompt for r in reqs], [r.tokens for r in res],
                             [r.allowed_tokens for r in reqs], [1.0] * len(reqs), 40)
    logp, ent = response_logprobs(model, batch, with_entropy=True)
    for i, r in enumerate(res):
        for j, lp in enumerate(r.logprobs):
            assert abs(float(logp[i, j]) - lp) < 1e-4
    assert ent is not None and float(ent.min()) >= 0.0


def test_stop_token_ends_sequence():
    model = _model()
    req = GenerationRequest("s-0_0_0", "a", 0, [1, 2, 3], 20, [10, 11], [10], 1.0, 0)
    res = generate(model, [req])[0]
    assert res.tokens[-1] == 10 or len(res.tokens) == 20
    assert 10 not in res.tokens[:-1]


def test_gumbel_noise_is_a_pure_function_of_seed_step_and_token():
    from flexmarl.policy.sampling import gumbel_noise

    seeds = torch.tensor([7, (1 << 62) + 12345, 7], dtype=torch.int64)
    steps = torch.tensor([0, 3, 1], dtype=torch.int64)
    batch = gumbel_noise(seeds, steps, 5000)
    for i in range(3):  # the same row alone as in the batch
        assert torch.equal(gumbel_noise(seeds[i:i + 1], steps[i:i + 1], 5000)[0], batch[i])
    assert not torch.equal(batch[0], batch[2])  # another step of the same sequence
    flat = gumbel_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64),
                        5000).flatten().double()
    # Gumbel(0, 1): mean is the Euler-Mascheroni constant, variance pi^2 / 6
    assert abs(flat.mean().item() - 0.5772) < 0.01
    assert abs(flat.var().item() - 1.6449) < 0.03
    # the argmax is uniform over tokens (Gumbel-max of equal logits)
    counts = torch.bincount(gumbel_noise(torch.arange(20000, dtype=torch.int64),
                                         torch.zeros(20000, dtype=torch.int64), 8).argmax(1),
                            minlength=8)
    assert counts.min() > 2300 and counts.max() < 2700


def test_mul32_wrapping_product_equals_the_split_one():
    """The hash multiplies in int64 and relies on the product wrapping modulo 2**64; its low 32
    bits must equal an overflow-free 16-bit split product, for every input the hash sees."""
    from flexmarl.policy.sampling import _M32, _mul32

    rng = np.random.default_rng(0)
    x = torch.tensor(np.concatenate([rng.integers(0, 1 << 32, 100000, dtype=np.int64),
                                     [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]]))
    for m in (0x7FEB352D, 0x846CA68B, 0x9E3779B1, _M32):
        lo, hi = m & 0xFFFF, m >> 16
        split = (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32
        assert torch.equal(_mul32(x, m), split)
        assert int(_mul32(x, m).min()) >= 0 and int(_mul32(x, m).max()) <= _M32


def test_padding_after_shorter_responses_is_finite_with_restricted_tokens():
    """Responses of different lengths under an allowed-token mask that excludes the padding
    token: the padded positions count 0 (not NaN), and so do their gradients."""
    model = _model()
    reqs = [r for r in _requests() if r.allowed_tokens is not None]
    res = generate(model, reqs)
    assert len({len(r.tokens) for r in res}) > 1
    batch = make_token_batch([r.prompt for r in reqs], [r.tokens for r in res],
                             [r.allowed_tokens for r in reqs], [1.0] * len(reqs), 40)
    logp, _ = response_logprobs(model, batch)
    assert bool(torch.isfinite(logp).all())
    assert float((logp * (1 - batch.response_mask)).abs().sum()) == 0.0
    logp.sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
