"""The `vllm` backend: a vLLM engine inside a rollout replica (GPU clusters).

Optional: `pip install flexmarl[vllm]`. It offers the replica the same engine surface as the
transformers engine (`fits`, `admit`, `step`, `load_weights`, `reset`, `active`), driving
vLLM's `LLMEngine` one step at a time so that vLLM's own continuous batching and paged KV
cache do the work. Log-probs are requested as `processed_logprobs` (after temperature and the
allowed-token mask), the distribution that sampled, which is what the trainer recomputes.
Weights are published through a worker extension that calls the model's `load_weights`.

Not exercised on CPU-only machines: vLLM needs CUDA. Tests skip with that reason.
"""

from __future__ import annotations

import time
from typing import Any

from flexmarl.errors import UserError
from flexmarl.policy.sampling import GenerationRequest, GenerationResult, noise_seed_of

INSTALL_HINT = ("the vllm backend needs vLLM and a CUDA GPU: pip install 'flexmarl[vllm]' "
                "(or set agents.<name>.backend.kind: hf)")


class VLLMUnavailable(UserError, ImportError):
    """vLLM (or CUDA) is not there: a setup problem the user can fix."""


def import_vllm(agent: str = "<name>") -> Any:
    """vLLM, or a clear error naming the agent whose backend asked for it."""
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable(f"agents.{agent}.backend.kind: "
                              f"{INSTALL_HINT.replace('<name>', agent)} ({exc})") from None
    import torch

    if not torch.cuda.is_available():
        raise VLLMUnavailable(f"agents.{agent}.backend.kind: vllm needs a CUDA GPU and none "
                              "is visible (set backend.kind: hf on CPU machines)")
    return vllm


class WeightLoaderExtension:
    """Mixed into vLLM's GPU workers (`worker_extension_cls`): receives published weights."""

    def flexmarl_load_weights(self, weights: list[tuple[str, Any]]) -> None:
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]


class VLLMEngine:
    """One agent's vLLM engine on one replica."""

    def __init__(self, agent: str, agent_cfg: Any, max_seqs: int) -> None:
        vllm = import_vllm(agent)
        model = agent_cfg.model
        if model.kind != "path":
            raise ValueError(f"agents.{agent}.backend: vllm serves models from a path "
                             "(model.kind: path), not random tiny models")
        self.agent = agent
        self.vllm = vllm
        self.llm = vllm.LLM(
            model=model.path,
            max_num_seqs=max_seqs,
            gpu_memory_utilization=agent_cfg.backend.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
            enable_prefix_caching=True,
        )
        self.engine = self.llm.llm_engine
        self.max_seqs = max_seqs
        self.running: dict[str, tuple[GenerationRequest, float]] = {}

    @property
    def active(self) -> int:
        return len(self.running)

    def active_for(self, agent: str) -> int:
        return len(self.running)  # one agent per vLLM engine

    def budget(self, request: GenerationRequest) -> int:
        return len(request.prompt) + request.max_new_tokens

    def fits(self, request: GenerationRequest, already: int = 0, extra_tokens: int = 0) -> bool:
        return self.active + already < self.max_seqs  # vLLM's scheduler owns the KV budget

    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        for r in requests:
            if r.stop or r.top_p < 1:
                raise ValueError(f"agent {self.agent!r}: the vllm backend does not apply stop "
                                 "strings or top_p yet; use stop tokens (NodePrompt.stop_tokens)")
            params = self.vllm.SamplingParams(
                temperature=r.temperature, max_tokens=r.max_new_tokens, logprobs=0,
                seed=noise_seed_of(r) & 0x7FFFFFFF, allowed_token_ids=r.allowed_tokens,
                stop_token_ids=list(r.stop_tokens) or None,
            )
            self.engine.add_request(r.sample_id, {"prompt_token_ids": list(r.prompt)}, params)
            self.running[r.sample_id] = (r, time.time())
        return []

    def step(self) -> list[GenerationResult]:
        done = []
        for out in self.engine.step():
            if not out.finished or out.request_id not in self.running:
                continue
            request, admitted = self.running.pop(out.request_id)
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(step[tok].logprob) for tok, step in
                        zip(tokens, completion.logprobs or [], strict=True)]
            done.append(GenerationResult(request.sample_id, tokens, logprobs, request.version,
                                         admitted_at=admitted, finished_at=time.time()))
        return done

    def load_weights(self, weights: dict[str, Any], agent: str | None = None) -> None:
        if self.running:
            raise RuntimeError("cannot load weights while sequences are running")
        self.llm.collective_rpc("flexmarl_load_weights", args=(list(weights.items()),))

    def reset(self) -> None:
        for sample_id in list(self.running):
            self.engine.abort_request(sample_id)
        self.running.clear()
