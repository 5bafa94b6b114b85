"""Batched generation with per-token log-probs, and the trainer's matching log-prob computation.

Sampling is Gumbel-max with noise drawn from a generator keyed by (run seed, sample_id, policy
version): a sequence's tokens do not depend on which other requests shared its batch, or on
when the scheduler ran it. Log-probs are those of the (masked, tempered) distribution sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from flexmarl.policy.model import stable_seed

PAD = 0


@dataclass
class GenerationRequest:
    sample_id: str
    agent: str
    version: int
    prompt: list[int]
    max_new_tokens: int
    allowed_tokens: list[int] | None = None
    stop_tokens: list[int] = field(default_factory=list)
    temperature: float = 1.0
    seed: int = 0


@dataclass
class GenerationResult:
    sample_id: str
    tokens: list[int]
    logprobs: list[float]
    version: int


def _mask_row(vocab: int, allowed: list[int] | None) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    if allowed is None:
        mask[:] = True
    else:
        mask[torch.as_tensor(allowed, dtype=torch.long)] = True
    return mask


@torch.no_grad()
def generate(model: torch.nn.Module, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Decode a batch of requests (left-padded, KV-cached) to their own lengths."""
    if not requests:
        return []
    vocab = model.config.vocab_size
    bsz = len(requests)
    width = max(len(r.prompt) for r in requests)
    input_ids = torch.full((bsz, width), PAD, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    for i, r in enumerate(requests):
        if not r.prompt:
            raise ValueError(f"request {r.sample_id}: empty prompt")
        input_ids[i, width - len(r.prompt) :] = torch.as_tensor(r.prompt)
        attn[i, width - len(r.prompt) :] = 1
    masks = torch.stack([_mask_row(vocab, r.allowed_tokens) for r in requests])
    temps = torch.tensor([r.temperature for r in requests], dtype=torch.float32).unsqueeze(1)
    rngs = [np.random.default_rng(stable_seed(r.seed, r.sample_id, r.version)) for r in requests]
    limits = [r.max_new_tokens for r in requests]
    stops = [set(r.stop_tokens) for r in requests]
    out_tokens: list[list[int]] = [[] for _ in requests]
    out_logps: list[list[float]] = [[] for _ in requests]
    done = [lim <= 0 for lim in limits]

    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                use_cache=True, logits_to_keep=1)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    next_pos = position_ids[:, -1:] + 1
    for _ in range(max(limits)):
        if all(done):
            break
        logits = out.logits[:, -1, :].float() / temps
        logits = logits.masked_fill(~masks, float("-inf"))
        logp = F.log_softmax(logits, dim=-1)
        noise = torch.from_numpy(
            np.stack([rng.gumbel(size=vocab) for rng in rngs]).astype(np.float32)
        )
        choice = torch.argmax(logp + noise, dim=-1)
        chosen_logp = logp.gather(1, choice.unsqueeze(1)).squeeze(1)
        for i in range(bsz):
            if done[i]:
                continue
            tok = int(choice[i])
            out_tokens[i].append(tok)
            out_logps[i].append(float(chosen_logp[i]))
            if len(out_tokens[i]) >= limits[i] or tok in stops[i]:
                done[i] = True
        if all(done):
            break
        attn = torch.cat([attn, torch.ones((bsz, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=choice.unsqueeze(1), attention_mask=attn, position_ids=next_pos,
                    cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        next_pos = next_pos + 1
    return [
        GenerationResult(r.sample_id, out_tokens[i], out_logps[i], r.version)
        for i, r in enumerate(requests)
    ]


@dataclass
class TokenBatch:
    """Right-padded prompt+response sequences ready for a training forward pass."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, R] 1 where a response token exists
    response_tokens: torch.Tensor  # [B, R]
    response_start: torch.Tensor  # [B] index of the first response token in input_ids
    allowed: torch.Tensor  # [B, V] bool
    temperature: torch.Tensor  # [B, 1]


def make_token_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    allowed: list[list[int] | None],
    temperatures: list[float],
    vocab: int,
) -> TokenBatch:
    bsz = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    rwidth = max(max(len(r) for r in responses), 1)
    input_ids = torch.full((bsz, width), PAD, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    rmask = torch.zeros((bsz, rwidth), dtype=torch.float32)
    rtok = torch.zeros((bsz, rwidth), dtype=torch.long)
    start = torch.zeros(bsz, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = list(p) + list(r)
        input_ids[i, : len(seq)] = torch.as_tensor(seq)
        attn[i, : len(seq)] = 1
        rmask[i, : len(r)] = 1.0
        if r:
            rtok[i, : len(r)] = torch.as_tensor(r)
        start[i] = len(p)
    masks = torch.stack([_mask_row(vocab, a) for a in allowed])
    temps = torch.tensor(temperatures, dtype=torch.float32).unsqueeze(1)
    return TokenBatch(input_ids, attn, rmask, rtok, start, masks, temps)


def response_logprobs(
    model: torch.nn.Module, batch: TokenBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, R] of the response tokens under `model` (same mask, temperature)."""
    logp, entropy, _ = response_forward(model, batch, with_entropy)
    return logp, entropy


def response_forward(
    model: torch.nn.Module, batch: TokenBatch, with_entropy: bool | str = False,
    with_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs [B, R], entropies [B, R] and last hidden states [B, R, H] of the positions that
    predict each response token (the state a value head scores), from one forward pass."""
    width = batch.input_ids.shape[1]
    # Only positions from the earliest response onwards need logits (the LM head over a large
    # vocabulary is a good part of the cost): keep the last `keep` positions.
    first = max(int(batch.response_start.min()) - 1, 0)
    keep = width - first
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                output_hidden_states=with_hidden, logits_to_keep=keep)
    logits = out.logits.float()
    bsz, rwidth = batch.response_tokens.shape
    # logits at position t predict token t+1: response token j sits at start+j.
    idx = (batch.response_start.unsqueeze(1) + torch.arange(rwidth).unsqueeze(0) - 1).clamp(
        0, width - 1
    )
    lidx = (idx - (width - logits.shape[1])).clamp(0, logits.shape[1] - 1)
    picked = logits.gather(1, lidx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    if not bool((batch.temperature == 1.0).all()):
        picked = picked / batch.temperature.unsqueeze(-1)
    restricted = not bool(batch.allowed.all())  # skip [B, R, V] masking when nothing is masked
    if restricted:
        picked = picked.masked_fill(~batch.allowed.unsqueeze(1), float("-inf"))
    logp_all = F.log_softmax(picked, dim=-1)
    logp = logp_all.gather(2, batch.response_tokens.unsqueeze(-1)).squeeze(-1)
    logp = logp * batch.response_mask
    entropy = None
    if with_entropy:
        # a metric only (no gradient) unless the caller trains on it
        src = logp_all if with_entropy == "grad" else logp_all.detach()
        safe = src.masked_fill(~batch.allowed.unsqueeze(1), 0.0) if restricted else src
        ent = -(src.exp() * safe).sum(-1)
        entropy = ent * batch.response_mask
    hidden = None
    if with_hidden:
        h = out.hidden_states[-1]
        hidden = h.gather(1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
    return logp, entropy, hidden
