"""Continuous batching for one transformers model: admit and retire sequences at each decode step.

A replica keeps one running batch per model over a paged KV cache (`rollout.paged`): newcomers
are prefilled together into blocks of their own, a sequence that finishes leaves the batch at
once and its blocks go back to the free list; neither copies the cache, so the batch stays full
while long-tail generations run. Its full blocks stay in a prefix cache, so a later request that
starts with the same tokens (the conversation's next turn) prefills only the rest.
Per-sequence state (position, sampling key from (seed, sample_id, version), token mask,
temperature) lives with the sequence, so a sequence decodes to the same tokens and log-probs
whether alone or inside any batch (up to float rounding).

Everything per step stays on the model's device (KV cache, masks, noise, sampling, log-probs);
one device-to-host copy per step brings back the chosen tokens and their log-probs. A decode
step can run on static shapes (`DecodeRunner`): captured once per bucket as a CUDA graph on a
GPU, optionally compiled on a CPU.
"""

from __future__ import annotations

import inspect
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from flexmarl.policy.adapters import BASE_ADAPTER, StackedLoRA, load_adapter
from flexmarl.policy.sampling import PAD, noise_seed_of, sample_keyed, sampling_key, top_p_mask
from flexmarl.rollout.paged import (
    NULL_BLOCK,
    BlockAllocator,
    KVStats,
    PagedKVCache,
    PrefixCache,
    block_hashes,
    shared_prompt_tokens,
)
from flexmarl.types import GenerationRequest, GenerationResult


@dataclass
class _Sequence:
    request: GenerationRequest
    mask: torch.Tensor | None  # None: every token allowed
    admitted_at: float
    adapter: str | None = None  # the LoRA adapter its rows run through (shared-base models)
    blocks: list[int] = field(default_factory=list)  # its block table in the paged cache
    share_key: tuple = ()  # `HFEngine._share_key` at admission (budgets of shared prompts)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def budget(self) -> int:
        """KV tokens this sequence may come to hold (prompt + its output limit)."""
        return len(self.request.prompt) + self.request.max_new_tokens

    @property
    def kv(self) -> int:
        """KV columns this running sequence fills (its prompt and every token fed back so far:
        all sampled ones but the last), known on the host: no device read to trim padding."""
        return len(self.request.prompt) + len(self.tokens) - 1

    def namespace(self) -> tuple[str, str | None, int]:
        """What its keys and values depend on besides the tokens: agent, adapter, weights."""
        return (self.request.agent, self.adapter, self.request.version)


def cache_argument(model: Any) -> str:
    """The forward argument that takes the KV cache: `cache` from transformers 5.2x on,
    `past_key_values` before. A wrong name is swallowed by **kwargs and every decode step would
    silently run without its past, so it is looked up, never assumed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(base).__name__}.forward takes neither `cache` nor "
                    "`past_key_values`: not a transformers causal LM with a KV cache")


def _host_to(device: torch.device, rows: list[list[int]] | list[int]) -> torch.Tensor:
    """An int64 tensor on `device` from host data, without a stream sync on a GPU: a blocking
    copy from pageable memory waits for the GPU to drain; a pinned, non-blocking one does not."""
    t = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


log = logging.getLogger(__name__)


def _plain(module: Any, kind: type) -> bool:
    """Is `module` exactly a `kind` with no hooks (so its forward may be called inline)?"""
    return type(module) is kind and not getattr(module, "_forward_hooks", None) \
        and not getattr(module, "_forward_pre_hooks", None)


def _resolved(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What calling `module` computes, resolved once: a plain `nn.Linear` as `F.linear` on its
    parameters, a plain `LlamaRMSNorm` and `LlamaMLP` as their very ops (bit-identical), all
    without the module calls and attribute look-ups around them, which cost a tiny model's
    decode step more host time than its compute. Anything else (LoRA layers, stacked
    adapters, hooked modules) is called as it is. The parameters are held, not their data,
    so loaded weights (copied in place, or swapped in by a wake-up) are the ones used."""
    if _plain(module, torch.nn.Linear):
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if _plain(module, LlamaRMSNorm):
        weight, eps = module.weight, module.variance_epsilon

        def rms_norm(x: torch.Tensor) -> torch.Tensor:
            dtype = x.dtype
            if dtype != torch.float32:
                x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return weight * (x if dtype == torch.float32 else x.to(dtype))
        return rms_norm
    if _plain(module, LlamaMLP):
        gate, up, down = (_resolved(m) for m in (module.gate_proj, module.up_proj,
                                                  module.down_proj))
        act = module.act_fn
        return lambda x: down(act(gate(x)) * up(x))
    return module  # type: ignore[no-any-return]


@dataclass
class _LlamaLayer:
    """One decoder layer's parts as a decode step calls them (`_resolved`)."""

    input_norm: Callable[[torch.Tensor], torch.Tensor]
    q: Callable[[torch.Tensor], torch.Tensor]
    k: Callable[[torch.Tensor], torch.Tensor]
    v: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]
    index: int
    scaling: float


def _llama_layers(net: Any) -> list[_LlamaLayer]:
    return [_LlamaLayer(_resolved(layer.input_layernorm), _resolved(layer.self_attn.q_proj),
                        _resolved(layer.self_attn.k_proj), _resolved(layer.self_attn.v_proj),
                        _resolved(layer.self_attn.o_proj),
                        _resolved(layer.post_attention_layernorm), _resolved(layer.mlp),
                        layer.self_attn.layer_idx, layer.self_attn.scaling)
            for layer in net.model.layers]


BLOCK_SIZE = 16  # tokens per KV block

DecodeMode = Literal["auto", "eager", "static", "compile", "cuda_graph"]


def _bucket(n: int) -> int:
    """The static size `n` rows (or blocks) are padded to: the next power of two, so a batch
    that shrinks and grows meets a handful of shapes (one capture or compilation each)."""
    return 1 << max(0, n - 1).bit_length()


class DecodeRunner:
    """Runs `ContinuousBatcher.decode_tensors` on static shapes, one (rows, blocks) bucket at a
    time: `static` eagerly (the padding alone: to test that bucketing never changes a token),
    `compile` through `torch.compile(dynamic=False)` (one compilation per bucket; optional on
    a CPU, where it costs seconds per bucket), `cuda_graph` replayed from a CUDA graph captured
    once per bucket (inputs copied into the graph's own buffers: a replay launches the whole
    step at once, and no host synchronisation happens inside it)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.graphs: dict[tuple[int, int], tuple[Any, list[torch.Tensor], tuple]] = {}
        self.compiled: Any = None
        # addresses of the KV pool and the engine's kept index tables the graphs read
        self.pool: tuple[int, ...] = ()
        self.captures = 0  # CUDA graphs captured (one per bucket met)

    def run(self, engine: ContinuousBatcher, rows: int, width: int, choice: torch.Tensor,
            state: torch.Tensor, temps: torch.Tensor,
            table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = choice.shape[0]
        if self.mode == "cuda_graph":
            return self._replay(engine, rows, width, (choice, state, temps, table), n)
        padded = (F.pad(choice, (0, rows - n)), F.pad(state, (0, 0, 0, rows - n)),
                  F.pad(temps, (0, 0, 0, rows - n), value=1.0),
                  F.pad(table, (0, width - table.shape[1], 0, rows - n)))
        fn = engine.decode_tensors
        if self.mode == "compile":
            if self.compiled is None:
                self.compiled = torch.compile(fn, dynamic=False)
            fn = self.compiled
        nxt, chosen, new = fn(*padded)
        return nxt[:n], chosen[:n], new[:n]

    def _replay(self, engine: ContinuousBatcher, rows: int, width: int,
                inputs: tuple[torch.Tensor, ...],
                n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # a graph bakes in the pool's addresses: a pool that grew (not reserved) since its
        # captures invalidates them (a reserved pool, as on a GPU replica, never grows), and
        # so does a kept table that grew (the column range, the rotary table)
        pool = (engine.kv.ensure_capacity(), *engine.kept_addresses())
        if pool != self.pool:
            self.graphs.clear()
            self.pool = pool
        key = (rows, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(engine, rows, width, inputs[3].dtype)
        graph, static, out = self.graphs[key]
        choice, state, temps, table = static
        # this step's rows; the padding rows reset (a row left by a larger batch would still
        # point at blocks that now belong to others)
        choice[:n].copy_(inputs[0])
        state[:n].copy_(inputs[1])
        state[n:].zero_()
        temps[:n].copy_(inputs[2])
        table[:n, :inputs[3].shape[1]].copy_(inputs[3])
        table[:n, inputs[3].shape[1]:].zero_()
        table[n:].zero_()
        graph.replay()
        return out[0][:n], out[1][:n], out[2][:n]

    def _capture(self, engine: ContinuousBatcher, rows: int, width: int,
                 dtype: torch.dtype) -> tuple[Any, list[torch.Tensor], tuple]:
        dev = engine.device
        static = [torch.zeros(rows, dtype=torch.long, device=dev),
                  torch.zeros((rows, 3), dtype=torch.long, device=dev),
                  torch.ones((rows, 1), dtype=torch.float32, device=dev),
                  torch.zeros((rows, width), dtype=dtype, device=dev)]
        # warm up on a side stream (lazy initialisations stay out of the graph); every row is
        # padding: writes go to the null block
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                engine.decode_tensors(*static)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = engine.decode_tensors(*static)
        self.captures += 1
        return graph, static, out


class ContinuousBatcher:
    """The running batch of one model on one replica.

    `max_seqs` bounds the sequences decoded together, `max_tokens` the KV tokens they may hold
    (prompt + max_new_tokens each): the two budgets a real engine gets from its KV memory.

    `adapters` (agent -> adapter name) makes it the engine of a shared base: `model` is a peft
    model holding one LoRA adapter per agent, and one batch mixes requests of all these agents,
    each row through its own agent's adapter (`policy.adapters.StackedLoRA`: two batched
    matmuls per layer whatever the number of adapters; `BASE_ADAPTER` is the bare base, for a
    frozen agent without an adapter).
    """

    def __init__(self, model: Any, max_seqs: int = 64, max_tokens: int = 1 << 20,
                 tokenizer: Any = None, adapters: dict[str, str] | None = None,
                 block_size: int = BLOCK_SIZE, prefix_cache: bool = True,
                 decode: DecodeMode = "auto"):
        """`tokenizer`: the agent's tokenizer (on a shared base, the base's), or a function that
        loads it on first use, for requests with stop strings (None: such requests are refused).
        `prefix_cache`: keep finished sequences' full blocks for later requests that start
        with the same tokens (`rollout.paged.PrefixCache`). `decode`: how a decode step runs
        (`DecodeRunner`); `auto` is `eager` everywhere until the CUDA-graph path has run on a
        GPU (`benchmarks/gpu_check.py` times both; `cuda_graph` is the option there), and on a
        CPU a compilation costs more than a run of tests saves (`compile` is the option)."""
        if max_seqs < 1:
            raise ValueError("max_seqs must be >= 1")
        self.model = model
        self.adapters = adapters
        self._stack: Any = None  # the stacked adapters of a shared base (`_hook_adapters`)
        self._net = model
        if adapters is not None:
            self._net = self._hook_adapters(model)
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self._cache_arg = cache_argument(model)
        self.vocab = model.config.vocab_size
        self.max_seqs = max_seqs
        self.seqs: list[_Sequence] = []
        # running sequences per share key (`_share_key`: its prompt length is key[3])
        self._running_keys: dict[tuple, int] = {}
        self._key_memo: dict[int, tuple[GenerationRequest, int, tuple]] = {}
        # `_budget_with`'s last sum: (take list, batch version, its length, its last request,
        # budget used, share keys held); the version changes whenever the running batch does
        self._fits_memo: tuple | None = None
        self._batch_version = 0
        # The paged cache: the token budget (admission control, `fits`) keeps every running
        # sequence within its blocks; one partly filled block per sequence on top. On a GPU the
        # pool is reserved at once (the budget is sized from rollout.kv_memory_fraction); on a
        # CPU it grows in chunks as tokens arrive.
        self.block_size = block_size
        self.allocator = BlockAllocator(2)
        self.kv = PagedKVCache(self.allocator, block_size, model.config.num_hidden_layers,
                               self.device)
        self.max_tokens = max_tokens
        self.prefix = PrefixCache(self.allocator, block_size) if prefix_cache else None
        # [B, blocks] the block table of each row on the device: rows join and leave on the
        # device; copied up (one small pinned copy) only on a step where a row opens a block.
        # `_columns`: the flat slots it gathers (None: to recompute)
        self._table: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None
        # the model gets its own 4D mask, so transformers builds none: boolean for SDPA,
        # additive for other attention implementations
        self._bool_mask = getattr(model.config, "_attn_implementation", None) in ("sdpa", None)
        self._dtype = param.dtype if param is not None else torch.float32
        self._banned: torch.Tensor | None = None  # [B, V] True: token masked; None: no mask
        self._rows: torch.Tensor | None = None  # [B] stacked-LoRA slot of each row
        self._only: int | None = None  # the one slot every row shares, if they do
        self.logits: torch.Tensor | None = None  # next-token logits not yet sampled from
        self._choice = torch.zeros(0, dtype=torch.long, device=self.device)  # not yet fed
        # per running sequence, on the device (no host copies per step): sampling key, tokens
        # sampled so far, position of the next fed token; and the temperature
        self._state = torch.zeros((0, 3), dtype=torch.long, device=self.device)
        self._temps = torch.zeros((0, 1), dtype=torch.float32, device=self.device)
        self._advance = torch.tensor([0, 1, 1], device=self.device)  # a step's state change
        self._arange = torch.arange(max(64, block_size), device=self.device)  # `_column_range`
        self._rope: torch.Tensor | None = None  # `_rope_for`
        self._top_p: torch.Tensor | None = None  # [B] rows' top_p, once a row has one < 1
        self._tokenizer = tokenizer
        # Llama-shaped models (random ones, SmolLM2) prefill and decode through
        # `_llama_forward`
        cfg = model.config
        self._lean = type(self._net) is LlamaForCausalLM and self._bool_mask
        # its layers, final norm and head as a decode step calls them (`_resolved`)
        self._layers = _llama_layers(self._net) if self._lean else []
        self._final_norm: Callable[[torch.Tensor], torch.Tensor] = torch.nn.Identity()
        self._head: Callable[[torch.Tensor], torch.Tensor] = torch.nn.Identity()
        if self._lean:
            self._final_norm = _resolved(self._net.model.norm)
            self._head = _resolved(self._net.lm_head)
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // \
            cfg.num_attention_heads
        self._kv_groups = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None)
                                                      or cfg.num_attention_heads)
        if decode == "auto":
            decode = "eager"  # cuda_graph becomes the GPU default once verified on one
        if decode == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"decode mode 'cuda_graph' needs a CUDA model, this one is on "
                             f"{self.device}")
        self.decode_mode: str = decode
        self._runner = DecodeRunner(decode)
        # a colocated replica's engine sleeps while a trainer computes on its device
        # (`HFEngine.sleep`): nothing is admitted then
        self.asleep = False

    @property
    def max_tokens(self) -> int:
        """The KV token budget (prompt + max_new_tokens of every running sequence)."""
        return self._max_tokens

    @max_tokens.setter
    def max_tokens(self, tokens: int) -> None:
        # one partly filled block per sequence on top of the budget, plus the null block
        self._max_tokens = tokens
        self.allocator.max_blocks = max(self.allocator.capacity,
                                        -(-tokens // self.block_size) + self.max_seqs + 1)

    def reserve_kv(self) -> None:
        """Reserve the whole pool now rather than growing it (a GPU replica, whose budget was
        sized from `rollout.kv_memory_fraction`): no allocation while decoding."""
        self.kv.preallocate = True
        self.allocator.grow(self.allocator.max_blocks)  # the prefix cache may use all of it

    def tokenizer(self) -> Any:
        if callable(self._tokenizer) and not hasattr(self._tokenizer, "decode"):
            self._tokenizer = self._tokenizer()  # a loader: load once, on first use
        return self._tokenizer

    def _stopped_by_string(self, s: _Sequence) -> bool:
        """Does the response end in one of its stop strings? Only a tail of tokens is decoded:
        a string of n characters spans at most 4n byte-level tokens, and any earlier match
        would have stopped the sequence a step before."""
        stop = s.request.stop
        tok = self.tokenizer()
        if tok is None:
            raise ValueError(f"request {s.request.sample_id}: stop strings {stop!r} need the "
                             f"agent's tokenizer, and this engine has none")
        window = 4 * max(len(x) for x in stop) + 1
        text = tok.decode(s.tokens[-window:], skip_special_tokens=True)
        return any(x in text for x in stop)

    def _hook_adapters(self, model: Any) -> Any:
        """Replace the forward of every LoRA layer by the stacked, batched one (`policy.
        adapters.StackedLoRA`); returns the transformers model inside the peft wrapper."""
        from peft import PeftModel  # optional: peft (the lora extra)


        if not isinstance(model, PeftModel):  # agents on a base without any adapter
            return model
        assert self.adapters is not None
        names = sorted({a for a in self.adapters.values() if a != BASE_ADAPTER})
        self._stack = StackedLoRA(model, names)
        return model.get_base_model()

    def _adapter_of(self, request: GenerationRequest) -> str | None:
        if self.adapters is None:
            return None
        if request.agent not in self.adapters:
            raise ValueError(f"request {request.sample_id}: agent {request.agent!r} has no "
                             f"adapter on this model (it serves {sorted(self.adapters)})")
        return self.adapters[request.agent]

    def _slots(self, adapters: list[str | None]) -> list[int]:
        slot = self._stack.slot
        return [slot.get(a, 0) if a else 0 for a in adapters]

    def _forward(self, rows: torch.Tensor | None, only: int | None, **kwargs: Any) -> Any:
        """A forward pass; on a shared base, row i through adapter slot `rows[i]` (a device
        tensor kept with the batch, so a step copies nothing from the host)."""
        if self._net is self.model:  # no adapter on this model
            return self._net(**kwargs)
        self._stack.use_rows(rows, only)
        try:
            return self._net(**kwargs)
        finally:
            self._stack.clear()

    # --- capacity ----------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.seqs)

    def active_for(self, agent: str) -> int:
        """Running sequences of `agent` (on a shared base, the batch holds other agents' too)."""
        if self.adapters is None:
            return len(self.seqs)
        return sum(1 for s in self.seqs if s.request.agent == agent)

    def _share_key(self, request: GenerationRequest) -> tuple:
        """Requests with equal keys share their prompt's full blocks (a GRPO group: the
        leader's at admission, a running member's through the prefix cache). The prompt enters
        by length and hash (a collision could only misjudge one admission's budget; sharing
        itself compares the tokens), computed once per request (admission asks often)."""
        hit = self._key_memo.get(id(request))
        if hit is not None and hit[0] is request and hit[1] == request.version:
            return hit[2]
        adapter = None if self.adapters is None else self.adapters.get(request.agent)
        key = (request.agent, adapter, request.version, len(request.prompt),
               hash(tuple(request.prompt)))
        if len(self._key_memo) > 4 * self.max_seqs + 256:
            self._key_memo.clear()
        self._key_memo[id(request)] = (request, request.version, key)
        return key

    def _shared_tokens(self, request: GenerationRequest) -> int:
        return shared_prompt_tokens(len(request.prompt), self.block_size)

    def budget(self, request: GenerationRequest,
               take: Sequence[GenerationRequest] = ()) -> int:
        """KV tokens `request` may come to hold (prompt + its output limit), less the prompt
        blocks it would share with a running sequence or with a newcomer in `take`."""
        seen = self._shared_keys(take)
        return self._added(request, seen)

    def _shared_keys(self, take: Sequence[GenerationRequest]) -> set[tuple]:
        """Keys whose prompt blocks a newcomer would share: the running sequences' (found
        through the prefix cache) and those of the newcomers `take`."""
        seen = set(self._running_keys) if self.prefix is not None else set()
        seen.update(self._share_key(t) for t in take)
        return seen

    def _added(self, request: GenerationRequest, seen: set[tuple]) -> int:
        full = len(request.prompt) + request.max_new_tokens
        if self._share_key(request) in seen:
            return full - self._shared_tokens(request)
        return full

    def kv_budget_used(self) -> int:
        """The running batch's budget, each group's shared prompt blocks counted once."""
        used = sum(s.budget for s in self.seqs)
        for key, n in self._running_keys.items():
            if n > 1:
                used -= (n - 1) * shared_prompt_tokens(key[3], self.block_size)  # key[3]: length
        return used

    def kv_stats(self) -> KVStats:
        """The paged cache now: blocks in use and held, KV bytes per held token."""
        stats = self.kv.stats(sum(s.kv for s in self.seqs))
        if self.prefix is not None:  # blocks only the prefix cache holds: kept, not in use
            stats.cached_blocks = len(self.prefix.idle)
            stats.blocks_in_use -= stats.cached_blocks
        return stats

    def fits(self, request: GenerationRequest, take: Sequence[GenerationRequest] = ()) -> bool:
        """Would `request` fit next to the running batch and the newcomers `take` chosen before
        it? Shared prompt blocks count once (a group of 8 on a 256-token prompt holds it once)."""
        if self.active + len(take) >= self.max_seqs:
            return False
        used, seen = self._budget_with(take)
        used += self._added(request, seen)
        # an empty batch always takes one request, however long, so nothing starves
        return used <= self.max_tokens or (self.active + len(take)) == 0

    def _budget_with(self, take: Sequence[GenerationRequest]) -> tuple[int, set[tuple]]:
        """The budget used by the running batch and the newcomers `take`, and the share keys
        they hold. An admission loop asks `fits` once per candidate with its `take` list grown
        by one: when `take` is the list of the last call, unchanged but for appends, and the
        batch is unchanged too, the sum carries on from there (linear, not quadratic, in the
        requests taken)."""
        n = len(take)
        memo = self._fits_memo
        if (memo is not None and memo[0] is take and memo[1] == self._batch_version
                and memo[2] <= n and (memo[2] == 0 or take[memo[2] - 1] is memo[3])):
            done, used, seen = memo[2], memo[4], memo[5]
        else:
            done, used = 0, self.kv_budget_used()
            seen = set(self._running_keys) if self.prefix is not None else set()
        for r in take[done:]:  # keys are computed once per request
            used += self._added(r, seen)
            seen.add(self._share_key(r))
        if isinstance(take, list):
            self._fits_memo = (take, self._batch_version, n, take[-1] if n else None, used,
                               seen)
        return used, seen

    # --- admission: batched prefill, merged into the running cache ---------------------------
    @torch.no_grad()
    def admit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Prefill `requests` and join them to the batch; returns any that finish at once."""
        if not requests:
            return []
        if self.asleep:
            raise RuntimeError(f"request {requests[0].sample_id}: this engine is asleep (a "
                               "colocated trainer holds its device); wake it first")
        now = time.time()
        for r in requests:
            if not r.prompt:
                raise ValueError(f"request {r.sample_id}: empty prompt")
        bs = self.block_size
        # Prefix sharing: requests with the same prompt on the same adapter (a GRPO group)
        # prefill it once. The first of each prompt (its leader) comes first in the batch;
        # the others share its full blocks (reference counts) and get a copy of its last,
        # partly filled block, which they will write their own tokens into (copy on write).
        leaders: dict[tuple[str | None, tuple[int, ...]], int] = {}
        lead_of: list[int] = []
        for r in requests:
            key = (self._adapter_of(r), tuple(r.prompt))
            lead_of.append(leaders.setdefault(key, len(leaders)))
        order = sorted(range(len(requests)),
                       key=lambda i: (0 if lead_of[i] not in lead_of[:i] else 1, i))
        requests = [requests[i] for i in order]
        lead_of = [lead_of[i] for i in order]
        n_lead = len(leaders)
        new = [_Sequence(r, None, now, self._adapter_of(r)) for r in requests]
        cow: dict[int, tuple[int, int]] = {}  # follower -> (leader's last block, its copy)
        # A leader's prompt starts with blocks the prefix cache holds (an earlier turn of the
        # conversation, an earlier sample of the group): it shares them and prefills the rest,
        # always at least its last token (whose logits it samples from). `cached[i]`: tokens
        # leader i takes from the cache; `hashes[i]`: its full prompt blocks' hashes.
        cached: list[int] = []
        hashes: list[list[bytes]] = []
        for i, s in enumerate(new):
            n = len(s.request.prompt)
            if i < n_lead:  # the prompt's blocks
                s.blocks = []
                if self.prefix is not None:
                    hashes.append(block_hashes(s.namespace(), s.request.prompt, bs, n // bs))
                    s.blocks = self.prefix.match(hashes[-1][:(n - 1) // bs])
                cached.append(len(s.blocks) * bs)
                s.blocks += [self.allocator.allocate() for _ in range(-(-n // bs) - len(s.blocks))]
                continue
            lead = new[lead_of[i]].blocks
            s.blocks = lead[:n // bs]
            for block in s.blocks:
                self.allocator.share(block)
            if n % bs:
                s.blocks.append(self.allocator.allocate())
                cow[i] = (lead[-1], s.blocks[-1])
        n_blocks = max(len(s.blocks) for s in new)
        width = max(len(s.request.prompt) - c for s, c in zip(new, cached, strict=False))
        # one host->device copy: left-padded ids not cached yet, each input token's slot
        # (padding: the null block), the block tables, then the state (sampling key, tokens
        # sampled, next position), the temperature's float64 bits, the offset of the logical
        # positions (padding - cached tokens), the row of its leader, and the blocks to copy
        # on write (null to null where none); followers feed nothing
        host = []
        for i, s in enumerate(new):
            r = s.request
            c = cached[i] if i < n_lead else 0
            pad = width - (len(r.prompt) - c) if i < n_lead else width
            fed = list(r.prompt[c:]) if i < n_lead else []
            slots = [s.blocks[j // bs] * bs + j % bs for j in range(c, c + len(fed))]
            temp = struct.unpack("<q", struct.pack("<d", r.temperature))[0]
            src, dst = cow.get(i, (NULL_BLOCK, NULL_BLOCK))
            host.append([PAD] * pad + fed + [NULL_BLOCK] * pad + slots
                        + s.blocks + [NULL_BLOCK] * (n_blocks - len(s.blocks))
                        + [sampling_key(noise_seed_of(r)), 0, len(r.prompt), temp, pad - c,
                           lead_of[i], src, dst])
        packed = _host_to(self.device, host)
        shared = n_lead < len(new)
        input_ids = packed[:n_lead, :width]
        slots_t = packed[:n_lead, width:2 * width]
        table = packed[:, 2 * width:2 * width + n_blocks]
        at = 2 * width + n_blocks
        state = packed[:, at:at + 3].clone()
        temps = packed[:, at + 3:at + 4].contiguous().view(torch.float64).float()
        # logical position of each input token (-1: padding)
        logical = (torch.arange(width, device=self.device).unsqueeze(0)
                   - packed[:n_lead, at + 4:at + 5])
        position_ids = logical.clamp(min=0)
        columns = self._columns_of(table[:n_lead])
        cols = torch.arange(columns.shape[1], device=self.device)
        # causal over each row's own gathered columns; a padding query sees column 0 only (its
        # output is dropped; an empty row would turn into NaN)
        allowed = cols[None, None, :] <= logical.clamp(min=0)[:, :, None]
        banned = None
        if any(r.allowed_tokens is not None for r in requests):
            banned = self._banned_rows(requests)
            for s, row in zip(new, banned, strict=True):
                if s.request.allowed_tokens is not None:
                    s.mask = ~row
        rows, only = None, None
        if self._stack is not None:
            slots = self._slots([s.adapter for s in new])
            rows, only = _host_to(self.device, slots), (slots[0] if len(set(slots)) == 1
                                                          else None)
        self.kv.slots, self.kv.columns = slots_t, columns
        logits = self._decode_logits(None if rows is None else rows[:n_lead], only, input_ids,
                                     position_ids, self._mask(allowed.unsqueeze(1))).float()
        if self.prefix is not None:  # the leaders' full prompt blocks, now written
            for s, h in zip(new, hashes, strict=False):
                self.prefix.insert(s.request.agent, h, s.blocks)
        if shared:  # followers: their leader's logits; their own copy of its last block
            logits = logits[packed[:, at + 5]]
            self.kv.copy_blocks(packed[n_lead:, at + 6], packed[n_lead:, at + 7])
        start = len(self.seqs)
        self._merge(new, table, logits, state, temps, banned, rows)
        self._join_top_p(start, new)
        for s in new:  # admission budgets count each group's shared prompt blocks once
            s.share_key = key = self._share_key(s.request)
            self._running_keys[key] = self._running_keys.get(key, 0) + 1
        self._batch_version += 1
        return self._sample(start)

    def _join_top_p(self, start: int, new: list[_Sequence]) -> None:
        """Keep the rows' nucleus sizes with the batch once one of them samples from a nucleus
        (a decode step then copies nothing up); the newcomers' (rows `start:`) go up with
        their admission."""
        if self._top_p is None and all(s.request.top_p >= 1.0 for s in new):
            return
        kept = self._top_p if self._top_p is not None else torch.ones(
            start, dtype=torch.float32, device=self.device)
        host = torch.tensor([s.request.top_p for s in new], dtype=torch.float32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self._top_p = torch.cat([kept[:start], host.to(self.device, non_blocking=True)])

    def _columns_of(self, table: torch.Tensor) -> torch.Tensor:
        """[B, blocks * block_size] the flat slot of each row's logical token, in order."""
        bs = self.block_size
        offsets = self._column_range(bs)
        return (table.unsqueeze(-1) * bs + offsets).reshape(table.shape[0], -1)

    def kept_addresses(self) -> tuple[int, ...]:
        """Where the tensors a decode step reads besides its inputs live (a captured step
        bakes them in): the column range and the rotary table."""
        return (self._arange.data_ptr(), 0 if self._rope is None else self._rope.data_ptr())

    def _column_range(self, n: int) -> torch.Tensor:
        """arange(n) on the device, a view of one kept arange (grown by doubling): a step
        builds no index tensor of its own."""
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]), device=self.device)
        return self._arange[:n]

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self._bool_mask:
            return allowed
        return torch.zeros(allowed.shape, dtype=self._dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(self._dtype).min)

    def _banned_rows(self, requests: list[GenerationRequest]) -> torch.Tensor:
        """[n, V] True for each request's disallowed tokens (built on the host, one copy)."""
        allowed = torch.zeros((len(requests), self.vocab), dtype=torch.bool)
        for i, r in enumerate(requests):
            if r.allowed_tokens is None:
                allowed[i] = True
            else:
                allowed[i, torch.as_tensor(r.allowed_tokens, dtype=torch.long)] = True
        if self.device.type == "cuda":
            return (~allowed).pin_memory().to(self.device, non_blocking=True)
        return (~allowed).to(self.device)

    def _merge(self, new: list[_Sequence], table: torch.Tensor, logits: torch.Tensor,
               state: torch.Tensor, temps: torch.Tensor, banned: torch.Tensor | None,
               rows: torch.Tensor | None) -> None:
        self._columns = None
        if not self.seqs or self._table is None:
            self._table = table
        else:  # the newcomers' block tables join on the device (no copy up)
            width = max(self._table.shape[1], table.shape[1])
            self._table = torch.cat([F.pad(self._table, (0, width - self._table.shape[1])),
                                     F.pad(table, (0, width - table.shape[1]))])
        if not self.seqs:
            self.seqs, self.logits = new, logits
            self._choice = torch.zeros(0, dtype=torch.long, device=self.device)
            self._state, self._temps, self._banned, self._rows = state, temps, banned, rows
            self._only = None if rows is None else self._only_of(new)
            return
        old = len(self.seqs)
        self._state = torch.cat([self._state, state])
        self._temps = torch.cat([self._temps, temps])
        if banned is not None or self._banned is not None:
            self._banned = torch.cat([
                self._banned if self._banned is not None else torch.zeros(
                    (old, self.vocab), dtype=torch.bool, device=self.device),
                banned if banned is not None else torch.zeros(
                    (len(new), self.vocab), dtype=torch.bool, device=self.device)])
        if rows is not None:
            assert self._rows is not None
            self._rows = torch.cat([self._rows, rows])
        self.logits = logits  # only the newcomers still need their first token
        self.seqs = self.seqs + new
        if rows is not None:
            self._only = self._only_of(self.seqs)

    def _only_of(self, seqs: list[_Sequence]) -> int | None:
        slots = set(self._slots([s.adapter for s in seqs]))
        return slots.pop() if len(slots) == 1 else None

    # --- decoding ----------------------------------------------------------------------------
    def _sample(self, start: int = 0) -> list[GenerationResult]:
        """Pick the next token of sequences `start:` from their logits; retire finished ones.

        Every running sequence holds one sampled token not yet fed to the model (`_choice`):
        `step` feeds them all, newcomers get theirs here right after their prefill.
        """
        assert self.logits is not None
        seqs = self.seqs[start:]
        logits = self.logits  # the pending logits of sequences start:
        if any(s.request.temperature != 1.0 for s in seqs):
            logits = logits / self._temps[start:]
        if self._banned is not None:
            logits = logits.masked_fill(self._banned[start:], float("-inf"))
        logp = F.log_softmax(logits, dim=-1)
        state = self._state[start:]
        nucleus = None
        if self._top_p is not None and any(s.request.top_p < 1.0 for s in seqs):
            # sample inside the nucleus; log-probs stay untruncated
            nucleus = top_p_mask(logp, self._top_p[start:].to(logp.dtype))
        choice = sample_keyed(logp, state[:, 0], state[:, 1], nucleus)
        self._state[start:, 1] += 1  # one more token sampled
        chosen = logp.gather(1, choice.unsqueeze(1)).squeeze(1)
        self._choice = choice if start == 0 else torch.cat([self._choice[:start], choice])
        self.logits = None
        # one device-to-host copy per step (token ids < 2**24 are exact in float32)
        picked = torch.stack([choice.to(chosen.dtype), chosen]).cpu().tolist()
        return self._finish(start, picked[0], picked[1])

    def _finish(self, start: int, tokens_host: list[float],
                logps_host: list[float]) -> list[GenerationResult]:
        """Append the sampled tokens (host copies) of sequences `start:`; retire finished ones."""
        finished = []
        for i, (s, tok_f, logp) in enumerate(zip(self.seqs[start:], tokens_host, logps_host,
                                                 strict=True), start):
            r = s.request
            if r.max_new_tokens <= 0:
                finished.append(i)
                continue
            tok = int(tok_f)
            s.tokens.append(tok)
            s.logprobs.append(logp)
            if len(s.tokens) >= r.max_new_tokens or (r.stop_tokens and tok in r.stop_tokens) \
                    or (r.stop and self._stopped_by_string(s)):
                finished.append(i)
        results = [self._result(self.seqs[i]) for i in finished]
        if finished:
            gone = set(finished)
            self._retire([i for i in range(len(self.seqs)) if i not in gone])
        return results

    def _result(self, s: _Sequence) -> GenerationResult:
        r = s.request
        return GenerationResult(r.sample_id, s.tokens, s.logprobs, r.version,
                                admitted_at=s.admitted_at, finished_at=time.time())

    def _release(self, seqs: list[_Sequence]) -> None:
        self._batch_version += 1  # the budget `_budget_with` carries on from changed
        for s in seqs:
            key = s.share_key
            self._running_keys[key] -= 1
            if not self._running_keys[key]:
                del self._running_keys[key]
            # the chain's last block first: the prefix cache then evicts leaves before the
            # prefixes other requests may still extend
            for block in reversed(s.blocks):
                self.allocator.release(block)
            s.blocks = []

    def _keep_prefix(self, s: _Sequence) -> None:
        """Hand the full blocks of a finished sequence (its prompt and the tokens fed back) to
        the prefix cache: the next turn of its conversation starts with them."""
        if self.prefix is None:
            return
        fed = list(s.request.prompt) + s.tokens[:-1]
        full = len(fed) // self.block_size
        self.prefix.insert(s.request.agent, block_hashes(s.namespace(), fed, self.block_size,
                                                         full), s.blocks[:full])

    def _retire(self, keep: list[int]) -> None:
        kept = set(keep)
        gone = [s for i, s in enumerate(self.seqs) if i not in kept]
        for s in gone:
            self._keep_prefix(s)
        self._release(gone)
        self._columns = None
        if not keep:
            self._table = None
            self.seqs, self.logits = [], None
            self._state, self._temps = self._state[:0], self._temps[:0]
            self._banned, self._rows, self._only = None, None, None
            self._top_p = None
            return
        idx = _host_to(self.device, keep)
        self.seqs = [self.seqs[i] for i in keep]
        self._choice = self._choice[idx]
        assert self._table is not None
        self._table = self._table[idx]
        self._state, self._temps = self._state[idx], self._temps[idx]
        if self._banned is not None:
            self._banned = (self._banned[idx]
                            if any(s.request.allowed_tokens is not None for s in self.seqs)
                            else None)
        if self._rows is not None:
            self._rows, self._only = self._rows[idx], self._only_of(self.seqs)
        if self._top_p is not None:
            self._top_p = (self._top_p[idx] if any(s.request.top_p < 1.0 for s in self.seqs)
                           else None)

    @torch.no_grad()
    def step(self) -> list[GenerationResult]:
        """One decode step for every running sequence; returns those that finished."""
        if not self.seqs:
            return []
        bs = self.block_size
        opened = False
        for s in self.seqs:  # the fed token's position (known on the host) may open a block
            if s.kv >= len(s.blocks) * bs:
                s.blocks.append(self.allocator.allocate())
                opened = True
        if opened or self._table is None:
            width = max(len(s.blocks) for s in self.seqs)
            self._table = _host_to(self.device, [s.blocks + [NULL_BLOCK] * (width - len(s.blocks))
                                                 for s in self.seqs])
            self._columns = None
        if self._columns is None:
            # only as many columns as the longest row needs (rows joined or left)
            width = max(len(s.blocks) for s in self.seqs)
            self._table = self._table[:, :width]
            self._columns = self._columns_of(self._table)
        if self._static_ok():
            try:
                return self._step_static()
            except RuntimeError as exc:
                # a model whose forward cannot be captured (a host sync, a host copy inside):
                # it decodes eagerly, said once, rather than failing the replica
                if self.decode_mode != "cuda_graph" or self._runner.captures:
                    raise
                log.warning("decode steps cannot be captured as CUDA graphs (%s); decoding "
                            "eagerly", exc)
                self.decode_mode = "eager"
        # the fed token's position: its slot is its column's, it sees the columns up to it
        pos = self._state[:, 2:3]
        self.kv.slots = self._columns.gather(1, pos)
        self.kv.columns = self._columns
        allowed = (self._column_range(self._columns.shape[1]) <= pos)[:, None, None, :]
        self.logits = self._decode_logits(self._rows, self._only, self._choice, pos,
                                          self._mask(allowed)).float()
        self._state[:, 2] += 1  # the next token's position (`pos` was read by the forward)
        return self._sample()

    def _decode_logits(self, rows: torch.Tensor | None, only: int | None, ids: torch.Tensor,
                       pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, V] next-token logits of one decode step (`ids` [B]: one token per row) or a
        prefill (`ids` [B, T], left-padded: the last position's), the keys and values written
        into the paged cache in place."""
        if not self._lean:
            out = self._forward(rows, only, input_ids=ids.unsqueeze(1) if ids.dim() == 1
                                else ids, attention_mask=mask, position_ids=pos,
                                use_cache=True, logits_to_keep=1,
                                **{self._cache_arg: self.kv})
            return out.logits[:, -1, :]
        if self._stack is None:
            return self._llama_forward(ids, pos, mask)
        self._stack.use_rows(rows, only)
        try:
            return self._llama_forward(ids, pos, mask)
        finally:
            self._stack.clear()

    def _llama_forward(self, ids: torch.Tensor, pos: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """A Llama decode step or prefill through the model's own modules (so LoRA layers and
        their stacked adapters still apply) and PyTorch's `scaled_dot_product_attention`,
        without the transformers wrappers around them: argument processing, mask building and
        output records cost more host time per step than a tiny model's whole compute. The
        same ops as `LlamaForCausalLM.forward` with an SDPA mask (tests compare the two)."""
        net = self._net.model
        prefill = ids.dim() == 2
        # a decode step's hidden states stay [B, hidden] (a linear on 2D inputs is one matmul,
        # without the reshapes around a 3D one; stacked adapters' batched matmuls take
        # [B, 1, hidden]); a prefill's are [B, T, hidden]; the heads [B, H, T, D]
        h = net.embed_tokens(ids if prefill or self._stack is None else ids.unsqueeze(1))
        b, t, dim = ids.shape[0], ids.shape[-1] if prefill else 1, self._head_dim
        table = self._rope_for(mask.shape[-1])
        if table is not None:  # [B, 1, T, D] each, broadcast over the heads
            rope = table[pos]  # [B, T, 2, D]
            cos, sin = rope[:, :, 0].unsqueeze(1), rope[:, :, 1].unsqueeze(1)
        else:
            cos, sin = net.rotary_emb(h, pos)
        for layer in self._layers:
            x = layer.input_norm(h)
            q = layer.q(x).view(b, t, -1, dim).transpose(1, 2)
            k = layer.k(x).view(b, t, -1, dim).transpose(1, 2)
            v = layer.v(x).view(b, t, -1, dim).transpose(1, 2)
            if table is not None:  # the queries and keys rotated together
                heads = q.shape[1]
                qk = torch.cat([q, k], 1)
                qk = qk * cos + qk.roll(dim // 2, -1) * sin
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = self.kv.update(k, v, layer.index)
            if prefill:  # each query head reads key/value head i // groups (transformers'
                if self._kv_groups > 1:  # `repeat_kv`)
                    k = k.repeat_interleave(self._kv_groups, 1)
                    v = v.repeat_interleave(self._kv_groups, 1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
                o = o.transpose(1, 2).reshape(b, t, -1)
            else:
                # grouped-query attention with one query token: the query heads of a
                # key/value head become its query rows (head i reads key/value head
                # i // groups, as transformers' `pack_gqa`): keys and values never repeated
                q = q.reshape(b, k.shape[1], -1, dim)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
                o = o.reshape(*h.shape[:-1], -1)
            h = h + layer.o(o)
            h = h + layer.mlp(layer.post_norm(h))
        if prefill:
            h = h[:, -1]  # left-padded: every row's last prompt token
        return self._head(self._final_norm(h)).reshape(b, -1)

    def _rope_for(self, positions: int) -> torch.Tensor | None:
        """[P, 2, D] the rotary cos and sign-folded sin of positions 0..P-1 (P >= `positions`),
        computed once by the model's own rotary module (grown by doubling): a step indexes it
        instead of recomputing them. The sin's first half is negated, so that `x * cos +
        x.roll(D/2) * sin` is transformers' `x * cos + rotate_half(x) * sin` to the bit. None
        for rotary kinds whose frequencies change with the sequence length (dynamic, longrope).
        """
        rotary = self._net.model.rotary_emb
        kind = getattr(rotary, "rope_type", "default")
        if "dynamic" in kind or "longrope" in kind:
            return None
        if self._rope is None or self._rope.shape[0] < positions:
            size = max(positions, 256, 0 if self._rope is None else 2 * self._rope.shape[0])
            like = torch.empty(0, dtype=self._dtype, device=self.device)
            cos, sin = rotary(like, torch.arange(size, device=self.device).unsqueeze(0))
            half = self._head_dim // 2
            sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
            self._rope = torch.stack([cos[0], sin[0]], 1)
        return self._rope

    # --- static-shape decode steps (captured on CUDA, optionally compiled on a CPU) ----------
    def _static_ok(self) -> bool:
        """Can this step run on static shapes? Not in `eager` mode, nor for rows with a token
        mask or nucleus sampling (they keep the eager step: masks and the nucleus cut change
        which ops run), nor on a shared base (the stacked adapters pick a path per batch on
        the host)."""
        if self.decode_mode == "eager" or self._stack is not None or self._banned is not None:
            return False
        return all(s.request.top_p >= 1.0 for s in self.seqs)

    def decode_tensors(self, choice: torch.Tensor, state: torch.Tensor, temps: torch.Tensor,
                       table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step as a pure function of device tensors of fixed shapes (what a CUDA
        graph captures and `torch.compile` compiles): feed `choice` [B] at each row's position,
        sample the next tokens. Returns (next tokens [B], their log-probs [B], the new state
        [B, 3]). A padding row (null block table, position 0) writes into the null block and
        reads only it."""
        pos = state[:, 2:3]
        self.kv.columns = self._columns_of(table)
        self.kv.slots = self.kv.columns.gather(1, pos)
        allowed = (self._column_range(self.kv.columns.shape[1]) <= pos)[:, None, None, :]
        logits = self._decode_logits(None, None, choice, pos, self._mask(allowed))
        logp = F.log_softmax(logits.float() / temps, dim=-1)
        nxt = sample_keyed(logp, state[:, 0], state[:, 1])
        chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1)
        # one more token sampled, the next position (a device constant: a host-to-device
        # copy cannot be captured)
        return nxt, chosen, state + self._advance

    def _step_static(self) -> list[GenerationResult]:
        """The decode step on a bucketed batch (rows padded to a power of two, the block table
        to a power of two of blocks): `DecodeRunner` runs it eagerly, compiled or replayed
        from the bucket's CUDA graph."""
        assert self._table is not None
        n = len(self.seqs)
        rows, width = _bucket(n), _bucket(self._table.shape[1])
        self._column_range(width * self.block_size)  # grown here, never inside a capture
        if self._lean:
            self._rope_for(width * self.block_size)
        nxt, chosen, state = self._runner.run(self, rows, width, self._choice, self._state,
                                              self._temps, self._table)
        self._choice, self._state = nxt, state
        picked = torch.stack([nxt.to(chosen.dtype), chosen]).cpu().tolist()
        return self._finish(0, picked[0], picked[1])

    def run_to_completion(self, requests: list[GenerationRequest],
                          min_admit: int | None = None) -> list[GenerationResult]:
        """Decode `requests` (admitted as room frees up) until all finish; in request order.

        Newcomers wait until `min_admit` of them fit (default an eighth of `max_seqs`), the
        batch is empty or the queue's rest fits: a prefill is a forward pass that decodes
        nothing, so one per finished sequence would cost a step each (launch-bound on a GPU)."""
        min_admit = max(1, self.max_seqs // 8) if min_admit is None else min_admit
        queue = list(requests)
        done: dict[str, GenerationResult] = {}
        while queue or self.seqs:
            take: list[GenerationRequest] = []
            while queue and self.fits(queue[0], take):
                take.append(queue.pop(0))
            if self.seqs and take and len(take) < min_admit and queue:
                queue[:0] = take  # too few for a prefill of their own yet
                take = []
            for res in self.admit(take) + self.step():
                done[res.sample_id] = res
        return [done[r.sample_id] for r in requests]


def generate(
    model: torch.nn.Module, requests: list[GenerationRequest], max_seqs: int | None = None,
    tokenizer: Any = None,
) -> list[GenerationResult]:
    """Decode `requests` to their own lengths with continuous batching (`ContinuousBatcher`);
    `tokenizer` (or a function returning it) matches stop strings."""
    if not requests:
        return []
    return ContinuousBatcher(model, max_seqs or len(requests),
                             tokenizer=tokenizer).run_to_completion(requests)


class HFEngine(ContinuousBatcher):
    """The `hf` backend on a replica: continuous batching plus in-place weight updates."""

    def load_weights(self, weights: dict[str, torch.Tensor], agent: str | None = None) -> None:
        """A new version: the model's changed tensors, or (shared base) `agent`'s adapter,
        loaded while other agents' sequences keep running on the base."""
        if self.adapters is not None:

            if agent not in self.adapters or self.adapters[agent] == BASE_ADAPTER:
                raise ValueError(f"agent {agent!r} has no adapter on this model to load into")
            if self.active_for(agent):
                raise RuntimeError(f"cannot load agent {agent!r}'s adapter while its "
                                   "sequences are running")
            load_adapter(self.model, self.adapters[agent], weights)
            self._stack.refresh(self.adapters[agent])
            if self.prefix is not None:  # its cached keys were computed by the old adapter
                self.prefix.flush(agent)
            return
        if self.active:
            raise RuntimeError("cannot load weights while sequences are running")
        if self.prefix is not None:  # keys computed by the old weights
            self.prefix.flush()
        # a version may carry only the tensors that changed (LoRA: the adapted layers)
        self.model.load_state_dict(weights, strict=False)

    # --- colocation: sleep while a trainer computes on this device, wake before rollout -----
    def _weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the model this engine computes with: parameters, buffers (rotary
        frequencies) and a shared base's stacked adapters."""
        seen: dict[int, torch.Tensor] = {}
        stacked = [t for _, a, b in self._stack.layers for t in (a, b)] if self._stack else []
        for t in [*self.model.parameters(), *self.model.buffers(), *stacked]:
            seen.setdefault(id(t), t)
        return list(seen.values())

    def memory(self) -> dict[str, int | bool]:
        """What this engine holds now, read off its tensors: the KV pool's bytes, and the
        bytes of its weights on the accelerator and in host memory."""
        on_device = on_host = 0
        for t in self._weight_tensors():
            n = t.numel() * t.element_size()
            if t.device.type == "cpu":
                on_host += n
            else:
                on_device += n
        kv = sum(int(k.numel() * k.element_size()) * 2 for k in self.kv.keys if k is not None)
        return {"asleep": self.asleep, "kv_pool_bytes": kv, "weights_device_bytes": on_device,
                "weights_host_bytes": on_host}

    def sleep(self) -> dict[str, int]:
        """Release the device for a colocated trainer (verl's and MARTI's `sleep`): the KV
        pool is freed (its blocks and the prefix cache with it) and, on a GPU, the weights
        move to pinned host memory and the allocator's cache is emptied. On a CPU the weights
        already are host memory and stay as they are: only the KV cache is freed. A load
        while asleep goes into the host copy. Returns the bytes released (`kv_bytes`) and
        moved to the host (`weight_bytes`)."""
        if self.active:
            raise RuntimeError(f"cannot sleep with {self.active} sequences running")
        if self.asleep:
            return {"kv_bytes": 0, "weight_bytes": 0}
        self.reset()  # prefix cache and per-batch state: every block back on the free list
        kv = self.kv.release()
        self._runner.graphs.clear()  # captured on the addresses about to be freed
        self._rope = None  # the rotary table: built again on the first step after waking
        self._runner.pool = ()
        moved = 0
        if self.device.type == "cuda":
            tensors = self._weight_tensors()
            hosts = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t.data, non_blocking=True)
                hosts.append(host)
                moved += t.numel() * t.element_size()
            torch.cuda.synchronize(self.device)
            for t, host in zip(tensors, hosts, strict=True):
                t.data = host
            self._choice, self._state = self._choice.cpu(), self._state.cpu()
            self._temps = self._temps.cpu()
            torch.cuda.empty_cache()
        self.asleep = True
        return {"kv_bytes": kv, "weight_bytes": moved}

    def wake(self) -> dict[str, int]:
        """Take the device back before a rollout: the weights (with any version loaded while
        asleep) back onto it, the KV pool allocated again at its former size. Returns the
        bytes moved (`weight_bytes`) and allocated (`kv_bytes`)."""
        if not self.asleep:
            return {"kv_bytes": 0, "weight_bytes": 0}
        moved = 0
        if self.device.type == "cuda":
            for t in self._weight_tensors():
                t.data = t.data.to(self.device, non_blocking=True)
                moved += t.numel() * t.element_size()
            self._choice, self._state = self._choice.to(self.device), self._state.to(self.device)
            self._temps = self._temps.to(self.device)
            torch.cuda.synchronize(self.device)
        kv = self.kv.restore()
        self.asleep = False
        return {"kv_bytes": kv, "weight_bytes": moved}

    def reset(self) -> None:
        """Drop the running batch (after a failure); the model stays loaded. The prefix cache
        goes too: a failed pass may have left blocks half written."""
        self._release(self.seqs)
        if self.prefix is not None:
            self.prefix.flush()
        self.seqs, self.logits = [], None
        self._table, self._columns = None, None
        self._banned, self._rows, self._only = None, None, None
        self._top_p = None
        self._choice = torch.zeros(0, dtype=torch.long, device=self.device)
        self._state = self._state[:0]
        self._temps = self._temps[:0]
