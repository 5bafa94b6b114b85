import numpy as np
import torch

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.sampling import (
    _M32,
    _mul32,
    keyed_uniform,
    make_token_batch,
    response_forward,
    sample_keyed,
    sampling_key,
)
from flexmarl.rollout.engine import generate
from flexmarl.types import GenerationRequest


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
    logp, ent, _ = response_forward(model, batch, with_entropy=True)
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


def test_keyed_uniform_is_a_pure_function_of_key_and_step():

    keys = torch.tensor([sampling_key(7), sampling_key((1 << 62) + 12345), sampling_key(7)])
    steps = torch.tensor([0, 3, 1], dtype=torch.int64)
    batch = keyed_uniform(keys, steps)
    for i in range(3):  # the same row alone as in the batch
        assert torch.equal(keyed_uniform(keys[i:i + 1], steps[i:i + 1])[0], batch[i])
    assert batch[0] != batch[2]  # another step of the same sequence
    assert sampling_key(7) != sampling_key(8) and 0 <= sampling_key(1 << 62) < 1 << 32
    flat = keyed_uniform(torch.tensor([sampling_key(i) for i in range(200)]).repeat_interleave(
        500), torch.arange(500).repeat(200)).double()
    assert float(flat.min()) >= 0.0 and float(flat.max()) <= 1.0 - 2.0 ** -24
    assert abs(flat.mean().item() - 0.5) < 0.005 and abs(flat.var().item() - 1 / 12) < 0.002


def test_keyed_draw_follows_the_distribution_and_never_picks_a_masked_token():

    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.125])
    n = 40000
    logp = probs.log().expand(n, -1)
    keys = torch.tensor([sampling_key(i) for i in range(n)])
    tokens = sample_keyed(logp, keys, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert freq[1] == 0 and freq[4] == 0  # probability 0: never drawn
    assert torch.allclose(freq, probs.double(), atol=0.01), freq
    keep = torch.tensor([False, True, True, True, True, True]).expand(n, -1)  # a nucleus cut
    cut = torch.bincount(sample_keyed(logp, keys, torch.ones(n, dtype=torch.int64), keep),
                         minlength=6).double() / n
    assert cut[0] == 0 and abs(float(cut[2]) - 0.5) < 0.015
    # a row whose whole mass sits on the last token (the drawn point stays below the total)
    last = torch.full((64, 6), float("-inf"))
    last[:, 5] = 0.0
    assert (sample_keyed(last, keys[:64], torch.zeros(64, dtype=torch.int64)) == 5).all()


def test_mul32_wrapping_product_equals_the_split_one():
    """The hash multiplies in int64 and relies on the product wrapping modulo 2**64; its low 32
    bits must equal an overflow-free 16-bit split product, for every input the hash sees."""

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
    logp, _, _ = response_forward(model, batch)
    assert bool(torch.isfinite(logp).all())
    assert float((logp * (1 - batch.response_mask)).abs().sum()) == 0.0
    logp.sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def test_a_row_without_finite_mass_draws_a_token_in_range():
    """Diverged weights give NaN logits: the draw stays in the vocabulary (its log-prob is NaN
    and the trainer's non-finite check stops the run), the other rows are unchanged."""
    logp = torch.log_softmax(torch.randn(3, 7), -1)
    bad = logp.clone()
    bad[1] = float("nan")
    keys = torch.tensor([11, 12, 13], dtype=torch.int64)
    steps = torch.tensor([0, 1, 2], dtype=torch.int64)
    good, drawn = sample_keyed(logp, keys, steps), sample_keyed(bad, keys, steps)
    assert 0 <= int(drawn[1]) < 7
    assert drawn[0] == good[0] and drawn[2] == good[2]
