"""A paged KV cache for one replica's running batch: fixed-size blocks, a block table per sequence.

The keys and values of every layer live in one pool of `block_size`-token blocks; a sequence owns
the blocks its block table lists, in order, so its logical token j sits in slot
`table[j // block_size] * block_size + j % block_size`. Admitting a sequence allocates blocks and
retiring one frees them: neither copies the cache. Memory held follows the tokens actually
cached (rounded up to a block), not the longest sequence times the batch.

Attention goes through PyTorch's own `scaled_dot_product_attention` (or the model's configured
attention) with an explicit mask over the gathered blocks of each row: `update` writes the new
keys/values into their slots and returns each row's blocks gathered in logical order, the
shape a transformers attention layer expects from its cache. Block 0 is a null block: padding
writes there and unused table entries point there, always masked out.

The pool grows in chunks (doubling) up to its limit, so a small run on a CPU never reserves
gigabytes; `preallocate` reserves it all at once (on a GPU, sized from
`rollout.kv_memory_fraction`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NULL_BLOCK = 0


class BlockAllocator:
    """Free list and reference counts of the pool's blocks (block 0 is the null block)."""

    def __init__(self, max_blocks: int, first_chunk: int = 16):
        if max_blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (one is the null block)")
        self.max_blocks = max_blocks  # may be raised later (the replica's KV budget)
        self.capacity = min(max_blocks, max(2, first_chunk))  # blocks the pool holds now
        self.refs = [0] * self.capacity
        self.refs[NULL_BLOCK] = 1  # never handed out
        self.free = list(range(self.capacity - 1, 0, -1))  # pop() hands out the lowest first
        # frees blocks held only by a prefix cache when the pool is at its limit (`PrefixCache`)
        self.reclaim: Callable[[int], int] | None = None
        # told when a block goes down to one holder or up from one (the prefix cache keeps its
        # evictable blocks, those only it holds, in a list of their own: eviction is O(1))
        self.on_sole: Callable[[int], None] | None = None
        self.on_shared: Callable[[int], None] | None = None

    @property
    def used(self) -> int:
        """Blocks held by sequences (the null block excluded)."""
        return self.capacity - 1 - len(self.free)

    def grow(self, at_least: int) -> None:
        """Double the capacity (at least to `at_least` blocks), up to `max_blocks`; past it only
        by what is needed: admission control keeps the batch within the budget, except for the
        one request an empty batch always takes, however long."""
        new = min(max(self.capacity * 2, at_least), max(self.max_blocks, at_least))
        self.refs.extend([0] * (new - self.capacity))
        self.free[:0] = list(range(new - 1, self.capacity - 1, -1))
        self.capacity = new

    def allocate(self) -> int:
        # blocks only a prefix cache holds are reused before the pool grows: the cache fills
        # the room running sequences left, never makes the pool larger
        if not self.free and (self.reclaim is None or not self.reclaim(1)):
            self.grow(self.capacity + 1)
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence reads `block` (a shared prefix)."""
        assert self.refs[block] > 0, f"block {block} is free"
        self.refs[block] += 1
        if self.refs[block] == 2 and self.on_shared is not None:
            self.on_shared(block)

    def release(self, block: int) -> None:
        assert block != NULL_BLOCK and self.refs[block] > 0, f"block {block} released twice"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)
        elif self.refs[block] == 1 and self.on_sole is not None:
            self.on_sole(block)


@dataclass
class KVStats:
    """What the pool holds: for logs and the benchmark (bytes per held token vs a padded cache)."""

    block_size: int
    blocks_in_use: int
    blocks_capacity: int
    held_tokens: int
    bytes_per_token: int  # K and V of one token, all layers
    pool_bytes: int
    cached_blocks: int = 0  # blocks only the prefix cache holds (not in use, evictable)

    @property
    def fraction_in_use(self) -> float:
        return self.blocks_in_use / max(1, self.blocks_capacity - 1)

    @property
    def bytes_per_held_token(self) -> float:
        """KV bytes the blocks in use take per token they hold (>= bytes_per_token: the last
        block of each sequence is partly empty)."""
        held = self.blocks_in_use * self.block_size * self.bytes_per_token
        return held / max(1, self.held_tokens)


def shared_prompt_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens a request sharing its prompt with another (a GRPO group) does not hold on
    its own: the full blocks before its last prompt token, which it always prefills itself."""
    return (prompt_len - 1) // block_size * block_size


class PagedKVCache:
    """The cache object handed to a transformers model (`cache=` / `past_key_values=`).

    Before each forward the engine sets `slots` ([B, T] flat slot of each input token) and
    `columns` ([B, C] flat slot of each gathered key column, C a multiple of the block size);
    each attention layer then calls `update`, which writes and gathers.
    """

    is_compileable = False

    def __init__(self, allocator: BlockAllocator, block_size: int, n_layers: int,
                 device: torch.device, preallocate: bool = False):
        self.allocator = allocator
        self.block_size = block_size
        self.n_layers = n_layers
        self.device = device
        self.preallocate = preallocate
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # [slots, H, D] per layer
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.slots: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None
        self.token_bytes = 0
        # per layer, the (shape, dtype) of the pool `release` freed (None: it had none)
        self._shapes: list[tuple[tuple[int, ...], torch.dtype] | None] = []

    def _pool(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool, grown to the allocator's capacity (a copy only when it grows)."""
        rows = (self.allocator.max_blocks if self.preallocate else self.allocator.capacity) \
            * self.block_size
        keys, values = self.keys[layer], self.values[layer]
        heads, dim = like.shape[1], like.shape[3]
        if keys is None or values is None:
            keys = like.new_zeros((rows, heads, dim))
            values = like.new_zeros((rows, heads, dim))
            self.token_bytes = 2 * heads * dim * like.element_size() * self.n_layers
        elif keys.shape[0] < rows:
            extra = like.new_zeros((rows - keys.shape[0], heads, dim))
            keys, values = torch.cat([keys, extra]), torch.cat([values, extra])
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def ensure_capacity(self) -> int:
        """Grow every layer's pool to the allocator's capacity now (a captured decode step
        runs no Python to grow it); returns the first pool's address (0: none yet)."""
        for layer, keys in enumerate(self.keys):
            if keys is not None:
                self._pool(layer, keys.unsqueeze(2))
        first = self.keys[0]
        return 0 if first is None else int(first.data_ptr())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' keys/values ([B, H, T, D]) into their slots; return each row's
        gathered columns ([B, H, C, D]), masked by the engine's attention mask."""
        assert self.slots is not None and self.columns is not None, "slots not set"
        keys, values = self._pool(layer_idx, key_states)
        flat = self.slots.reshape(-1)
        b, h, t, d = key_states.shape
        keys.index_copy_(0, flat, key_states.transpose(1, 2).reshape(b * t, h, d))
        values.index_copy_(0, flat, value_states.transpose(1, 2).reshape(b * t, h, d))
        # one index_select per pool over the flattened columns (advanced indexing with a 2D
        # index costs more host time for the same gather)
        cols = self.columns.reshape(-1)
        shape = (b, self.columns.shape[1], h, d)
        return (keys.index_select(0, cols).view(shape).transpose(1, 2),
                values.index_select(0, cols).view(shape).transpose(1, 2))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks `src` onto `dst` in every layer (copy on write of a shared block)."""
        offsets = torch.arange(self.block_size, device=src.device)
        s = (src.unsqueeze(1) * self.block_size + offsets).reshape(-1)
        d = (dst.unsqueeze(1) * self.block_size + offsets).reshape(-1)
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is not None and values is not None:
                keys.index_copy_(0, d, keys[s])
                values.index_copy_(0, d, values[s])

    def release(self) -> int:
        """Free every layer's pool (a colocated replica going to sleep; no block may be in
        use): its tensors are dropped, their shapes kept for `restore`. Returns the bytes freed."""
        freed = 0
        self._shapes = []
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is None or values is None:
                self._shapes.append(None)
                continue
            freed += int(keys.numel() * keys.element_size()) * 2
            self._shapes.append((tuple(keys.shape), keys.dtype))
        self.keys = [None] * self.n_layers
        self.values = [None] * self.n_layers
        self.slots = self.columns = None
        return freed

    def restore(self) -> int:
        """Allocate again the pools `release` freed, at their former size (zeros: no block
        holds anything after a sleep). Returns the bytes allocated."""
        allocated = 0
        for layer, shape in enumerate(self._shapes):
            if shape is None:
                continue
            dims, dtype = shape
            keys = torch.zeros(dims, dtype=dtype, device=self.device)
            self.keys[layer], self.values[layer] = keys, torch.zeros_like(keys)
            allocated += 2 * keys.numel() * keys.element_size()
        self._shapes = []
        return allocated

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.columns is None else int(self.columns.shape[1])

    def stats(self, held_tokens: int) -> KVStats:
        return KVStats(self.block_size, self.allocator.used, self.allocator.capacity,
                       held_tokens, self.token_bytes,
                       sum(int(k.numel() * k.element_size()) * 2 for k in self.keys
                           if k is not None))


Namespace = tuple[str, str | None, int]  # (agent, adapter, weight version)


def block_hashes(namespace: Namespace, tokens: list[int], block_size: int,
                 n_blocks: int) -> list[bytes]:
    """The chained hash of each of the first `n_blocks` full blocks of `tokens`: block i's hash
    covers the namespace and every token up to the end of block i (as vLLM and SGLang hash), so
    equal hashes mean equal prefixes and therefore equal keys and values at equal weights.
    BLAKE2b (128 bits): a collision would silently reuse wrong keys, so no 64-bit hash."""
    out: list[bytes] = []
    parent = hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest()
    for i in range(n_blocks):
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Full KV blocks kept after their sequences leave, found again by the hash of their prefix.

    A later request whose prompt starts with a cached prefix (the next turn of a multi-turn
    agent, whose prompt is the conversation so far; another sample of a group admitted later)
    shares those blocks and prefills only the rest. The cache holds one reference on each block
    it keeps; a block only the cache holds is evicted least recently used first whenever the
    pool has no free block (`BlockAllocator.reclaim`, before the pool grows: the cache only
    fills room running sequences left), the chain's last blocks before its first ones. Keys
    carry the agent, adapter and weight version, and `flush` drops an agent's blocks when new
    weights load: keys computed under old weights are never read by the new ones.

    The blocks only the cache holds are kept apart (`idle`, in the order their last reader
    left, the allocator telling the cache), so eviction takes the oldest at once instead of
    scanning a cache mostly read by running sequences.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: dict[bytes, int] = {}  # hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> hash
        self.idle: OrderedDict[bytes, None] = OrderedDict()  # only the cache holds: LRU first
        self.agent_of: dict[bytes, str] = {}
        self.hits = 0  # blocks reused (prefill tokens saved = hits * block_size)
        self.lookups = 0  # full prompt blocks looked up
        allocator.reclaim = self.evict
        allocator.on_sole, allocator.on_shared = self._sole, self._shared

    def _sole(self, block: int) -> None:
        h = self.hash_of.get(block)
        if h is not None:
            self.idle[h] = None  # its last reader left: evictable, the most recent

    def _shared(self, block: int) -> None:
        h = self.hash_of.get(block)
        if h is not None:
            self.idle.pop(h, None)

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix among `hashes`, each shared once more
        (the caller now holds them: not evictable until it lets them go)."""
        found: list[int] = []
        for h in hashes:
            block = self.blocks.get(h)
            if block is None:
                break
            found.append(block)
            self.allocator.share(block)
        self.lookups += len(hashes)
        self.hits += len(found)
        return found

    def insert(self, agent: str, hashes: list[bytes], blocks: list[int]) -> None:
        """Keep `blocks` (full, in prefix order, hashed `hashes`); a prefix already cached in
        other blocks keeps those (the caller's copies go back with the caller)."""
        for h, block in zip(hashes, blocks, strict=False):
            if h not in self.blocks:
                self.blocks[h] = block
                self.hash_of[block] = h
                self.agent_of[h] = agent
                self.allocator.share(block)  # the caller still holds it: not idle

    def evict(self, wanted: int) -> int:
        """Hand back up to `wanted` blocks that only the cache holds, least recently used
        first; returns how many went back to the free list."""
        n = 0
        while n < wanted and self.idle:
            self._drop(next(iter(self.idle)))
            n += 1
        return n

    def flush(self, agent: str | None = None) -> None:
        """Drop the blocks of `agent` (None: of every agent): its weights changed."""
        for h in [h for h in self.blocks if agent is None or self.agent_of[h] == agent]:
            self._drop(h)

    def _drop(self, h: bytes) -> None:
        block = self.blocks.pop(h)
        del self.agent_of[h], self.hash_of[block]
        self.idle.pop(h, None)
        self.allocator.release(block)
