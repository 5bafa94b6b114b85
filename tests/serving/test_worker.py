"""The serving engine samples as the rollout engine does: a served request with `top_p`
decodes the same tokens with the same log-probs (the nucleus cut once, log-probs of the
distribution before the cut, as training records and recomputes them)."""

import pytest

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.tokenizer import byte_tokenizer
from flexmarl.rollout.engine import HFEngine
from flexmarl.serving.worker import ServeEngine, ServeRequest
from flexmarl.types import GenerationRequest

TOK = byte_tokenizer()


def test_served_nucleus_requests_decode_as_the_rollout_engine():
    model = build_model("w", ModelConfig(init_std=0.3), vocab_size=320, max_seq_len=64,
                        run_seed=0)
    prompts = [TOK.encode(f"<|user|>go {i}</s><|assistant|>", add_special_tokens=False)
               for i in range(4)]
    args = [(f"s{i}", "w", 0, p, 12, None, [], 1.0, 7) for i, p in enumerate(prompts)]
    top_p = [0.6, 1.0, 0.8, 0.6]
    served = ServeEngine(model, 4).run_to_completion(
        [ServeRequest(*a, top_p=t) for a, t in zip(args, top_p, strict=True)])
    rollout = HFEngine(model, 4).run_to_completion(
        [GenerationRequest(*a, top_p=t) for a, t in zip(args, top_p, strict=True)])
    for s, r in zip(served, rollout, strict=True):
        assert s.tokens == r.tokens
        assert s.logprobs == pytest.approx(r.logprobs, abs=1e-6)
