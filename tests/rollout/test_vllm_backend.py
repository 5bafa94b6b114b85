"""The vllm backend: a clear error where vLLM or CUDA is absent; real generation where present."""

import importlib.util

import pytest
import torch
import yaml

from flexmarl.config.schema import config_from_dict
from flexmarl.errors import UserError
from flexmarl.orchestrator.run import prepare
from tests.rollout.test_openai_backend import ROOT

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def _config(kind: str) -> dict:
    raw = yaml.safe_load((ROOT / "examples/referential_game.yaml").read_text())
    raw["agents"]["listener"]["backend"] = {"kind": kind}
    return raw


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM and a GPU are present: the error path cannot occur")
def test_vllm_backend_without_vllm_is_a_clear_error():
    cfg = config_from_dict(_config("vllm"))
    with pytest.raises(UserError, match=r"agents.listener.backend.kind: .*(vllm|CUDA)"):
        prepare(cfg)


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM needs CUDA; this machine has no GPU or no vLLM")
def test_vllm_engine_generates_with_logprobs(tmp_path):
    from flexmarl.config.schema import AgentConfig
    from flexmarl.policy.model import build_model
    from flexmarl.policy.sampling import GenerationRequest
    from flexmarl.rollout.backends.vllm import VLLMEngine

    model = build_model("a", AgentConfig().model, vocab_size=64, max_seq_len=64, run_seed=0)
    model.save_pretrained(tmp_path / "m")
    acfg = AgentConfig.model_validate({"model": {"kind": "path", "path": str(tmp_path / "m")},
                                       "backend": {"kind": "vllm"}, "trainable": False})
    engine = VLLMEngine("a", acfg, max_seqs=8)
    reqs = [GenerationRequest(f"0-{i}_0_0", "a", 0, [1, 5 + i, 2], 6, list(range(10, 20)))
            for i in range(4)]
    engine.admit(reqs)
    done = []
    while engine.active:
        done += engine.step()
    assert {r.sample_id for r in done} == {r.sample_id for r in reqs}
    for res in done:
        assert len(res.tokens) == 6 and len(res.logprobs) == 6
        assert set(res.tokens) <= set(range(10, 20))
        assert all(lp <= 0 for lp in res.logprobs)
