"""Batched generation with per-token log-probs, and the trainer's matching log-prob computation.

Sampling is an inverse-CDF draw with one uniform per sequence and step that is a pure function
of (the sequence's key, the token's position in the response): the key comes from the request's
noise seed, keyed by (run seed, sample_id, policy version), so a sequence's tokens do not depend
on which other requests shared its batch, on when the scheduler ran it, or on the device (the
uniform is computed on the device by a counter-based hash, with no per-sequence generator to
copy from the host). One hash per row, not per vocabulary entry: a step costs an `exp`, a
`cumsum` and a `searchsorted` over the vocabulary besides the log-softmax it needs anyway.
Log-probs are those of the (masked, tempered) distribution sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from flexmarl.policy.model import stable_seed
from flexmarl.types import GenerationRequest

PAD = 0


def noise_seed_of(request: GenerationRequest) -> int:
    """The seed of a request's sampling stream (its `sampling_key`): the same on every replica
    and endpoint."""
    if request.noise_seed is not None:
        return request.noise_seed
    return stable_seed(request.seed, request.sample_id, request.version)


def mask_row(vocab: int, allowed: list[int] | None,
             device: str | torch.device = "cpu") -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    if allowed is None:
        mask[:] = True
    else:
        mask[torch.as_tensor(allowed, dtype=torch.long, device=device)] = True
    return mask


# --- counter-based keyed uniforms ------------------------------------------------------------
_M32 = 0xFFFFFFFF
_Int = TypeVar("_Int", int, torch.Tensor)


def _mul32(x: _Int, m: int) -> _Int:
    """(x * m) mod 2**32 for x in [0, 2**32) (a Python int, or int64 tensor): the int64 product
    wraps modulo 2**64 (two's complement, on every torch backend), which keeps its low 32 bits
    exact. Two kernels, not the six of a split 16-bit product (`tests/policy/test_sampling.py`
    checks they agree)."""
    return (x * m) & _M32


def _mix32(x: _Int) -> _Int:
    """A 32-bit integer finaliser (lowbias32): every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sampling_key(noise_seed: int) -> int:
    """The 32-bit key of a sequence's sampling stream, from its 63-bit noise seed: mixed once on
    the host at admission, so a decode step hashes only (key, step)."""
    return _mix32((noise_seed & _M32) ^ _mix32(((noise_seed >> 32) & _M32) ^ 0x85EBCA6B))


def keyed_uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniforms [B] in [0, 1 - 2**-24] (multiples of 2**-24, float32) for sequences with
    `sampling_key` keys [B] at response positions `steps` [B] (int64, >= 0): a pure function of
    (key, step), computed where the tensors are, the same for a row alone or in any batch."""
    h = _mix32(_mul32(steps, 0x9E3779B1) ^ keys)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_keyed(logp: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of `logp` [B, V] (log-probabilities; -inf: masked) by inverting
    its CDF at the row's `keyed_uniform`; `keep` [B, V] (False: excluded, a nucleus cut)
    restricts the draw. Returns int64 [B]. Never picks a token of probability 0: the point
    drawn is `u * total` with u < 1, so it lies below the row's total mass, and the first CDF
    entry above it is one that a positive probability raised."""
    probs = logp.exp()
    if keep is not None:
        probs = probs.masked_fill(~keep, 0.0)
    cdf = probs.cumsum(-1)
    point = keyed_uniform(keys, steps).unsqueeze(1) * cdf[:, -1:]
    # a row with no finite mass (NaN logits from diverged weights) would index past the end:
    # it draws the last token instead, its log-prob is NaN, and the trainer's non-finite check
    # names the divergence (train.max_skipped_steps) rather than the rollout crashing
    return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=logp.shape[-1] - 1)


def top_p_mask(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] True for the tokens of each row's nucleus: the most likely tokens whose
    probabilities sum to at least `top_p` [B] (the most likely one always stays)."""
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    probs = sorted_logp.exp()
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
    keep_sorted = before < top_p.unsqueeze(1)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    return keep.scatter(1, order, keep_sorted)


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

    def to(self, device: str | torch.device) -> TokenBatch:
        """The same batch on `device` (non-blocking where the source is pinned)."""
        dev = torch.device(device)
        if self.input_ids.device == dev:
            return self
        return TokenBatch(*(t.to(dev, non_blocking=True) for t in (
            self.input_ids, self.attention_mask, self.response_mask, self.response_tokens,
            self.response_start, self.allowed, self.temperature)))


def make_token_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    allowed: list[list[int] | None],
    temperatures: list[float],
    vocab: int,
) -> TokenBatch:
    """Rows of prompt + response, right-padded to the longest; one scatter per tensor (not a
    copy per row) and one mask per distinct `allowed` (a node's rows share theirs)."""
    bsz = len(prompts)
    if len(responses) != bsz:
        raise ValueError(f"{bsz} prompts but {len(responses)} responses")
    plen = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=bsz)
    rlen = np.fromiter((len(r) for r in responses), dtype=np.int64, count=bsz)
    seq_len = plen + rlen
    width = int(seq_len.max())
    rwidth = max(int(rlen.max()), 1)
    row = np.arange(bsz)
    # every token of every row, in order, and where it goes: (row, column)
    flat = np.fromiter((t for p, r in zip(prompts, responses, strict=True)
                        for part in (p, r) for t in part), dtype=np.int64,
                       count=int(seq_len.sum()))
    rows = np.repeat(row, seq_len)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(seq_len) - seq_len, seq_len)
    input_ids = np.full((bsz, width), PAD, dtype=np.int64)
    input_ids[rows, cols] = flat
    attn = (np.arange(width)[None, :] < seq_len[:, None]).astype(np.int64)
    rmask = (np.arange(rwidth)[None, :] < rlen[:, None]).astype(np.float32)
    rtok = np.zeros((bsz, rwidth), dtype=np.int64)
    is_response = cols >= np.repeat(plen, seq_len)
    rtok[rows[is_response], (cols - np.repeat(plen, seq_len))[is_response]] = flat[is_response]
    masks: dict[tuple[int, ...] | None, torch.Tensor] = {}
    for a in allowed:
        key = None if a is None else tuple(a)
        if key not in masks:
            masks[key] = mask_row(vocab, a)
    mask = torch.stack([masks[None if a is None else tuple(a)] for a in allowed])
    temps = torch.tensor(temperatures, dtype=torch.float32).unsqueeze(1)
    return TokenBatch(torch.from_numpy(input_ids), torch.from_numpy(attn),
                      torch.from_numpy(rmask), torch.from_numpy(rtok), torch.from_numpy(plen),
                      mask, temps)


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
    steps = torch.arange(rwidth, device=batch.response_start.device)
    idx = (batch.response_start.unsqueeze(1) + steps.unsqueeze(0) - 1).clamp(
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
    # padding after a shorter response (token 0) may be a masked token, log-prob -inf: zero it
    # by selection (-inf * 0 would be NaN, and poison the loss of the whole micro-batch)
    logp = torch.where(batch.response_mask > 0, logp, torch.zeros((), dtype=logp.dtype))
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
