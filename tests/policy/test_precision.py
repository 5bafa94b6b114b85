"""Precision on the CPU, the same code paths a GPU takes: a bf16/fp16 checkpoint loads into
float32 master weights, trains under autocast, publishes in the compute dtype to a replica that
computes in it, and the saved checkpoint reloads with transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from flexmarl.config.schema import AgentConfig, ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.rollout.engine import HFEngine
from flexmarl.training.trainer import AgentTrainer, Sample
from flexmarl.types import GenerationRequest

VOCAB = 48
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
         "init_std": 0.2}


def _rows(engine: HFEngine, version: int, n: int = 8) -> list[Sample]:
    reqs = [GenerationRequest(f"{version}-{i}_0_0", "a", version, [1, 2, 3 + i], 6,
                              seed=version) for i in range(n)]
    res = engine.run_to_completion(reqs)
    return [Sample(q.sample_id, q.prompt, r.tokens, r.logprobs, 1.0 if i % 2 else -1.0, None,
                   1.0, version) for i, (q, r) in enumerate(zip(reqs, res, strict=True))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_checkpoint_trains_publishes_and_reloads(tmp_path, dtype):
    half = getattr(torch, dtype)
    src = build_model("a", ModelConfig(**SHAPE), VOCAB, 32, 0).to(half)
    src.save_pretrained(tmp_path / "ckpt")  # a half-precision checkpoint on disk
    cfg = AgentConfig.model_validate({
        "model": {"kind": "path", "path": str(tmp_path / "ckpt"), "dtype": dtype},
        "optim": {"lr": 0.01}})
    trainer = AgentTrainer("a", cfg, VOCAB, 32, run_seed=0, total_steps=4)
    assert trainer.compute_dtype == half
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # masters
    for name, p in trainer.model.named_parameters():  # loaded exactly (half -> fp32 is exact)
        assert torch.equal(p.detach(), src.state_dict()[name].float())
    replica = HFEngine(build_model("a", cfg.model, VOCAB, 32, 0, "cpu", half), 8)
    assert next(replica.model.parameters()).dtype == half
    weights = trainer.weights()
    assert {v.dtype for v in weights.values()} == {half}  # half the bytes of fp32 masters
    replica.load_weights(weights)
    for version in range(2):
        trainer.accumulate(_rows(replica, version))
        metrics = trainer.step()
        assert metrics.get("skipped") is None, metrics
        # the replica holds exactly the rounded masters; autocast computes with the same
        # rounding, so the two log-probs of a row agree to half-precision accuracy
        assert metrics["logprob_diff_mean"] < 0.05, metrics
        replica.load_weights(trainer.weights())
    moved = [n for n, p in trainer.model.named_parameters()
             if not torch.equal(p.detach(), src.state_dict()[n].float())]
    assert moved, "two steps left every weight unchanged"
    out = trainer.save(tmp_path / "trained")
    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(again.state_dict()[name], p.detach())


def test_fp32_rollout_and_trainer_logprobs_agree():
    cfg = AgentConfig.model_validate({"model": SHAPE})
    trainer = AgentTrainer("a", cfg, VOCAB, 32, run_seed=0, total_steps=2)
    replica = HFEngine(build_model("a", cfg.model, VOCAB, 32, 0), 8)
    replica.load_weights(trainer.weights())
    trainer.accumulate(_rows(replica, 0))
    metrics = trainer.step()
    assert metrics["logprob_diff_mean"] < 1e-5
    assert metrics["logprob_diff_max"] >= metrics["logprob_diff_mean"]


def test_stale_rows_are_left_out_of_the_logprob_diff():
    """Rows of an older version (one_step_off) were sampled from other weights: comparing
    them would report the policy change as a numerics mismatch."""
    cfg = AgentConfig.model_validate({"model": SHAPE})
    trainer = AgentTrainer("a", cfg, VOCAB, 32, run_seed=0, total_steps=3, max_staleness=1)
    replica = HFEngine(build_model("a", cfg.model, VOCAB, 32, 0), 8)
    replica.load_weights(trainer.weights())
    rows = _rows(replica, 0)
    trainer.accumulate(rows)
    trainer.step()  # version 1 now; rows of version 0 are one step stale
    stale = [Sample(s.sample_id + "x", s.prompt, s.response, s.old_logprobs, s.advantage,
                    None, 1.0, 0) for s in rows]
    trainer.accumulate(stale)
    assert "logprob_diff_mean" not in trainer.step()


def test_gradient_checkpointing_gives_the_same_step():
    def run(ckpt: bool) -> dict[str, torch.Tensor]:
        cfg = AgentConfig.model_validate({"model": {**SHAPE, "gradient_checkpointing": ckpt},
                                          "optim": {"lr": 0.01}})
        trainer = AgentTrainer("a", cfg, VOCAB, 32, run_seed=0, total_steps=2)
        flag = getattr(type(trainer.model), "is_activation_checkpointing", None)
        flag = flag if flag is not None else type(trainer.model).is_gradient_checkpointing
        assert flag.__get__(trainer.model) is ckpt
        replica = HFEngine(build_model("a", ModelConfig(**SHAPE), VOCAB, 32, 0), 8)
        trainer.accumulate(_rows(replica, 0))
        trainer.step()
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    plain, checkpointed = run(False), run(True)
    for k in plain:
        torch.testing.assert_close(checkpointed[k], plain[k], rtol=1e-5, atol=1e-6)
