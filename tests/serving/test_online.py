"""Online experience without a server: truncated importance weights against hand-computed
cases, the KL bound undoing an update, no captured row trained on twice (restarts included),
and the compressed weight format's round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexmarl.policy.sampling import make_token_batch, response_forward
from flexmarl.rollout.engine import generate
from flexmarl.serving.agents import load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.compress import pack, unpack
from flexmarl.serving.online import OnlineLearner, importance_weights
from flexmarl.types import GenerationRequest

LN = math.log


def test_importance_weights_hand_computed():
    # one token: pi_train / pi_serve = 0.5 / 0.25 = 2, truncated at is_max
    assert importance_weights([[LN(0.5)]], [[LN(0.25)]], 2.0) == pytest.approx([2.0])
    assert importance_weights([[LN(0.5)]], [[LN(0.25)]], 1.5) == pytest.approx([1.5])
    # a token the training policy likes less than the server did: 0.1 / 0.4
    assert importance_weights([[LN(0.1)]], [[LN(0.4)]], 2.0) == pytest.approx([0.25])
    # a sequence: the product of its token ratios, (0.5/0.25) * (0.5/1.0) = 1
    assert importance_weights([[LN(0.5), LN(0.5)]], [[LN(0.25), LN(1.0)]], 2.0) == \
        pytest.approx([1.0])
    # long sequences do not overflow: 200 tokens at ratio 2 each are truncated, not inf
    assert importance_weights([[LN(0.5)] * 200], [[LN(0.25)] * 200], 3.0) == [3.0]
    assert importance_weights([[LN(0.25)] * 200], [[LN(0.5)] * 200], 3.0)[0] == \
        pytest.approx(0.5 ** 200)
    with pytest.raises(ValueError, match="served tokens"):
        importance_weights([[0.0]], [[0.0, 0.0]], 2.0)


def _rows(capture: Capture, model, n: int, version: int, seed: int = 0) -> list[str]:
    """`n` real listener interactions of the referential game decoded by `model`, captured
    with a reward (1 when the listener named the target)."""
    from flexmarl.tasks.referential import build_referential_game

    task = build_referential_game(num_objects=8, num_candidates=4, num_symbols=8)
    inputs = task.sample_inputs(np.random.default_rng(seed), n)
    reqs, allowed = [], []
    for i, d in enumerate(inputs):
        prompt = [1, 4, *d["candidates"], 2, 14 + i % 8]
        reqs.append(GenerationRequest(f"r{seed}-{i}", "listener", 0, prompt, 1,
                                      d["candidates"], noise_seed=seed * 1000 + i))
        allowed.append(d["candidates"])
    ids = []
    for req, res, d in zip(reqs, generate(model, reqs), inputs, strict=True):
        capture.record(res.sample_id, "listener", {"version": version}, "episodes", req.prompt,
                       res.tokens, res.logprobs, "", "length", 1.0, 1.0, req.allowed_tokens)
        capture.feedback(res.sample_id, float(res.tokens == [d["target"]]))
        ids.append(res.sample_id)
    return ids


@pytest.fixture
def learner_parts(toy_run, tmp_path):
    run = load_run(toy_run, "cpu")
    spec = run.agents["listener"]
    capture = Capture(tmp_path / "c.sqlite")
    yield run, spec, capture
    capture.close()


def _learner(run, spec, kl_max: float, is_max: float = 2.0) -> OnlineLearner:
    return OnlineLearner(spec, run.task.vocab_size, run.task.max_seq_len, run.cfg.seed, "cpu",
                         kl_max=kl_max, is_max=is_max, lr=0.01)


def test_off_policy_rows_get_their_truncated_importance_weight(learner_parts):
    run, spec, capture = learner_parts
    _rows(capture, spec.model, 16, version=1)
    lr = _learner(run, spec, kl_max=100.0, is_max=1.5)
    rows = capture.claim("listener", 16, step=1)
    # served by "version 7": pretend the server's log-probs were those of another policy
    for i, r in enumerate(rows):
        r.version, r.logprobs = 7, [LN(0.1 + 0.05 * i)]
    batch = make_token_batch([r.prompt for r in rows], [r.response for r in rows],
                             [r.allowed for r in rows], [r.temperature for r in rows],
                             lr.vocab)
    with torch.no_grad():
        lp = response_forward(lr.trainer.model, batch)[0][:, 0].tolist()
    lr.train(rows, spec.model, capture, micro_batch=8)
    expected = [min(1.5, math.exp(lp[i] - LN(0.1 + 0.05 * i))) for i in range(16)]
    assert lr.last_weights == pytest.approx(expected, rel=1e-5)
    assert max(lr.last_weights) == 1.5 and min(lr.last_weights) < 1.0  # both sides exercised
    # rows served by exactly the weights the trainer holds need no correction
    _rows(capture, spec.model, 8, version=spec.version.number, seed=1)
    lr2 = _learner(run, spec, kl_max=100.0)
    lr2.train(capture.claim("listener", 8, step=1), spec.model, capture, micro_batch=8)
    assert lr2.last_weights == [1.0] * 8


def test_kl_bound_stops_an_update_that_drifts_too_far(learner_parts):
    run, spec, capture = learner_parts
    _rows(capture, spec.model, 32, version=1)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    tight = _learner(run, spec, kl_max=1e-9)
    rows = capture.claim("listener", 16, step=1)
    rep = tight.train(rows, spec.model, capture, micro_batch=16)
    assert not rep.applied and rep.kl > 1e-9
    after = tight.trainer.model.state_dict()
    assert all(torch.equal(after[k].float(), before[k].float()) for k in before)
    assert tight.trainer.version == 0  # the step was undone, version included
    loose = _learner(run, spec, kl_max=100.0)
    rep2 = loose.train(capture.claim("listener", 16, step=1), spec.model, capture, 16)
    assert rep2.applied and 0 < rep2.kl <= 100.0
    changed = loose.trainer.model.state_dict()
    assert any(not torch.equal(changed[k].float(), before[k].float()) for k in before)
    outcomes = dict(capture._db.execute("SELECT outcome, COUNT(*) FROM consumed "
                                        "GROUP BY outcome").fetchall())
    assert outcomes == {"kl_stop": 16, "trained": 16}


def test_no_captured_row_is_trained_twice_across_restarts(learner_parts, tmp_path):
    run, spec, capture = learner_parts
    ids = _rows(capture, spec.model, 20, version=1)
    capture.record("greedy", "listener", {"version": 1}, "completions", [1, 4, 6, 7, 8, 9, 2, 15],
                   [6], [0.0], "", "length", 1e-4, 1.0, None)
    capture.feedback("greedy", 1.0)  # decoded greedily: never trainable
    capture.record("no-feedback", "listener", {"version": 1}, "completions", [1], [6], [-1.0],
                   "", "length", 1.0, 1.0, None)
    lr = _learner(run, spec, kl_max=100.0)
    trained: list[str] = []
    for step in (1, 2):
        rows = capture.claim("listener", 8, step)
        lr.train(rows, spec.model, capture, micro_batch=8)
        trained += [r.id for r in rows]
    crashed = capture.claim("listener", 8, 3)  # claimed, then the server dies before training
    assert len(crashed) == 4
    capture.close()
    again = Capture(tmp_path / "c.sqlite")  # the restarted server's view of the same file
    try:
        assert again.available("listener") == 0
        assert again.claim("listener", 8, 4) == []
        consumed = [r[0] for r in again._db.execute("SELECT response_id FROM consumed")]
    finally:
        again.close()
    assert len(trained) == len(set(trained)) == 16
    assert sorted(consumed) == sorted(ids)  # each rewarded, trainable row exactly once
    assert not {r.id for r in crashed} & set(trained)


def test_compression_round_trip_within_fp16_tolerance(toy_run):
    spec = load_run(toy_run, "cpu").agents["listener"]
    tensors = {**spec.model.state_dict(), "steps": torch.arange(5),
               "half": torch.randn(3, 3, dtype=torch.bfloat16)}
    raw = pack(tensors, fp16=False, zstd_level=None)
    half = pack(tensors, fp16=True, zstd_level=None)
    small = pack(tensors, fp16=True, zstd_level=3)
    assert len(half) < 0.55 * len(raw) and len(small) <= len(half)
    for blob, exact in ((raw, True), (pack(tensors, False, 3), True), (half, False),
                        (small, False)):
        out = unpack(blob)
        assert set(out) == set(tensors)
        for k, v in tensors.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            if exact or not v.is_floating_point() or v.dtype != torch.float32:
                assert torch.equal(out[k], v), k
            else:
                assert torch.allclose(out[k], v, rtol=1e-3, atol=1e-4), k
                assert torch.equal(out[k], v.half().float()), k  # exactly FP16 rounding
    with pytest.raises(ValueError, match="FMW1"):
        unpack(b"not weights")


def test_fp16_packing_refuses_weights_beyond_fp16_range():
    """A float32 weight FP16 cannot hold would come back as inf: refused by name instead."""
    from flexmarl.store.compression import CompressionError

    tensors = {"ok": torch.ones(2), "scale": torch.tensor([1.0, 1e6])}
    with pytest.raises(CompressionError, match="'scale'.*FP16"):
        pack(tensors, fp16=True)
    assert torch.equal(unpack(pack(tensors, fp16=False))["scale"], tensors["scale"])


def test_ppo_online_learns_with_a_critic_under_the_kl_bound(learner_parts):
    """`--online-algorithm ppo`: the trainer gets a value head, the served log-probs are the
    behaviour policy's (PPO's old log-probs), and the KL bound undoes a step as for GRPO."""
    run, spec, capture = learner_parts
    _rows(capture, spec.model, 32, version=1)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    ppo = OnlineLearner(spec, run.task.vocab_size, run.task.max_seq_len, run.cfg.seed, "cpu",
                        kl_max=100.0, is_max=2.0, lr=0.01, algorithm="ppo")
    assert ppo.algorithm.name == "ppo" and ppo.trainer.value_head is not None
    head = ppo.trainer.value_head.weight.detach().clone()
    rep = ppo.train(capture.claim("listener", 16, step=1), spec.model, capture, 16)
    assert rep.applied and 0 < rep.kl <= 100.0
    assert any("value" in k for k in rep.metrics), rep.metrics
    assert not torch.equal(ppo.trainer.value_head.weight.detach(), head)  # the critic learnt
    changed = ppo.trainer.model.state_dict()
    assert any(not torch.equal(changed[k].float(), before[k].float()) for k in before)
    tight = OnlineLearner(spec, run.task.vocab_size, run.task.max_seq_len, run.cfg.seed, "cpu",
                          kl_max=1e-9, is_max=2.0, lr=0.01, algorithm="ppo")
    rep2 = tight.train(capture.claim("listener", 16, step=1), spec.model, capture, 16)
    assert not rep2.applied and tight.trainer.version == 0
    after = tight.trainer.model.state_dict()
    assert all(torch.equal(after[k].float(), before[k].float()) for k in before)
    with pytest.raises(Exception, match="expected auto, grpo or ppo"):
        OnlineLearner(spec, run.task.vocab_size, run.task.max_seq_len, run.cfg.seed, "cpu",
                      kl_max=1.0, is_max=2.0, algorithm="a2c")
