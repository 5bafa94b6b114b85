"""Stop strings and top-p in the continuous batcher, on a tiny random model with the
byte-level tokenizer: a stop string ends a sequence exactly where its text first appears, the
sampled ids are kept whole, and top-p samples inside the nucleus while recording log-probs of
the untruncated distribution (the ones the trainer recomputes)."""

import pytest
import torch

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.sampling import make_token_batch, response_forward, top_p_mask
from flexmarl.policy.tokenizer import byte_tokenizer
from flexmarl.rollout.engine import ContinuousBatcher, generate
from flexmarl.types import GenerationRequest

TOK = byte_tokenizer()
LETTERS = [TOK.convert_tokens_to_ids(c) for c in "abcde"]


@pytest.fixture(scope="module")
def model():
    return build_model("w", ModelConfig(init_std=0.3), vocab_size=320, max_seq_len=64,
                       run_seed=0)


def _req(i, stop=(), top_p=1.0, n=30, allowed=LETTERS):
    prompt = TOK.encode(f"<|user|>go {i}</s><|assistant|>", add_special_tokens=False)
    return GenerationRequest(f"0-{i}_0_0", "w", 0, prompt, n, allowed, [], 1.0, 7,
                             stop=list(stop), top_p=top_p)


def test_stop_string_ends_the_sequence_where_its_text_first_appears(model):
    checked = 0
    for i in range(6):
        full = generate(model, [_req(i)])[0]
        text = TOK.decode(full.tokens)
        stop = text[5:7]  # two letters the free run writes
        cut = text.index(stop) + len(stop)  # one letter is one token here
        stopped = generate(model, [_req(i, stop=[stop])], tokenizer=TOK)[0]
        assert stopped.tokens == full.tokens[:cut]  # the sampled ids, whole, up to the stop
        assert stopped.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-6)
        assert TOK.decode(stopped.tokens).endswith(stop)
        checked += 1
    assert checked == 6


def test_stop_strings_inside_a_batch_and_with_a_lazy_tokenizer(model):
    reqs = [_req(i, stop=["ab", "ee"] if i % 2 else []) for i in range(8)]
    alone = [generate(model, [r], tokenizer=TOK)[0] for r in reqs]
    loads = []
    batched = ContinuousBatcher(model, max_seqs=3,
                                tokenizer=lambda: loads.append(1) or TOK).run_to_completion(reqs)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert len(loads) == 1  # loaded once, on the first request with stop strings
    for req, res in zip(reqs, batched, strict=True):
        text = TOK.decode(res.tokens)
        if req.stop and len(res.tokens) < req.max_new_tokens:
            assert text.endswith("ab") or text.endswith("ee")
            assert "ab" not in text[:-1] and "ee" not in text[:-1]


def test_stop_strings_without_a_tokenizer_are_refused(model):
    with pytest.raises(ValueError, match="stop strings \\['ab'\\] need the agent's tokenizer"):
        generate(model, [_req(0, stop=["ab"])])


def test_top_p_mask_keeps_the_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.9, 0.03, 0.02]]))
    keep = top_p_mask(logp, torch.tensor([0.75, 0.5]))
    assert keep.tolist() == [[True, True, False, False], [False, True, False, False]]
    assert top_p_mask(logp, torch.tensor([1.0, 1.0])).all()


def test_top_p_samples_in_the_nucleus_and_logs_untruncated_logprobs(model):
    greedy_like = [generate(model, [_req(i, top_p=1e-6, n=12, allowed=None)])[0]
                   for i in range(3)]
    batch = make_token_batch([_req(i).prompt for i in range(3)],
                             [r.tokens for r in greedy_like], [None] * 3, [1.0] * 3, 320)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp, _, _ = response_forward(model, batch)
    for i, res in enumerate(greedy_like):
        start = int(batch.response_start[i])
        argmax = out[i, start - 1:start - 1 + len(res.tokens)].argmax(-1).tolist()
        assert res.tokens == argmax  # a nucleus of one token: the most likely one
        # the recorded log-probs are those of the full distribution, as the trainer sees it
        assert res.logprobs == pytest.approx(logp[i, :len(res.tokens)].tolist(), abs=1e-5)
        assert max(res.logprobs) < -1e-3  # not the truncated distribution's log 1 = 0


def test_nucleus_rows_decode_the_same_in_a_mixed_batch_as_alone(model):
    """Rows with and without top-p in one batch, admitted in two waves and leaving at different
    steps (the batch's kept top-p values join and leave with them): each decodes as alone."""
    reqs = [_req(i, top_p=0.7 if i % 2 else 1.0, n=3 + 2 * i, allowed=None) for i in range(6)]
    alone = [generate(model, [r])[0] for r in reqs]
    engine = ContinuousBatcher(model, max_seqs=6)
    done = {r.sample_id: r for r in engine.admit(reqs[:2] + reqs[4:5])}
    for _ in range(3):
        done.update((r.sample_id, r) for r in engine.step())
    assert engine._top_p is not None  # row 1 samples from a nucleus
    done.update((r.sample_id, r) for r in engine.admit([reqs[2], reqs[3], reqs[5]]))
    while engine.active:
        done.update((r.sample_id, r) for r in engine.step())
    assert engine._top_p is None  # gone with the last nucleus row
    for req, res in zip(reqs, alone, strict=True):
        assert done[req.sample_id].tokens == res.tokens, req.sample_id
        assert done[req.sample_id].logprobs == pytest.approx(res.logprobs, rel=1e-5, abs=1e-5)
