"""Host-side cost of a decode step, engine vs `model.generate`: CPU proxies of GPU costs.

On a GPU a small model's decode step is bound by the host: Python, one kernel launch per aten
op, and every device->host read (which waits for the GPU to drain, so the host cannot run ahead
and queue the next step). On a CPU with a tiny model (compute negligible) the same three show:
- aten ops dispatched (a `TorchDispatchMode` counts them; view/metadata ops excluded: each
  counted op is about one kernel launch on a GPU);
- device->host reads: `item`/`int`/`bool`/`float` of a tensor (`_local_scalar_dense`),
  `nonzero`, boolean indexing, `.cpu()`, `.tolist()`, `.numpy()` (each a sync on a GPU);
- host->device copies issued by FlexMARL's own code (`.to(device)`, `torch.tensor(...,
  device=)`: a blocking `.to(cuda)` from pageable memory synchronises the stream too);
- host time per step: wall time (`perf_counter`), or with `use_cpu_clock()` this process's
  CPU time, which other processes on a shared CPU disturb far less (with one torch thread).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flexmarl.config.schema import ModelConfig
from flexmarl.policy.model import build_model
from flexmarl.policy.smollm import SmolLMUnavailable, load_tokenizer
from flexmarl.rollout.engine import HFEngine
from flexmarl.types import GenerationRequest

_SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select",
             "aten._unique2", "aten.unique_dim", "aten.unique_consecutive"}
_FREE_OPS = {"aten.detach", "aten.lift_fresh", "aten.empty", "aten.empty_strided",
             "aten._local_scalar_dense"}
_PKG = str(Path(__file__).resolve().parent.parent)  # flexmarl/
CLOCK: Callable[[], float] = time.perf_counter


def use_cpu_clock() -> None:
    """Time with this process's CPU time (a CPU-only run on a shared machine)."""
    global CLOCK
    CLOCK = time.process_time


@dataclass
class Counts:
    ops: int = 0
    syncs: int = 0
    h2d: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_sync: Counter = field(default_factory=Counter)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        c = self.counts
        if name in _SYNC_OPS:
            c.syncs += 1
            c.by_sync[name] += 1
        elif name == "aten.index" and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                          for t in (args[1] if len(args) > 1 else [])):
            c.syncs += 1  # boolean indexing: a nonzero inside
            c.by_sync["aten.index(bool)"] += 1
        if not getattr(func, "is_view", False) and name not in _FREE_OPS:
            c.ops += 1
            c.by_op[name] += 1
        return func(*args, **(kwargs or {}))


def _ours(depth: int = 2) -> bool:
    """Was the caller FlexMARL code (not torch's or transformers')?"""
    return sys._getframe(depth).f_code.co_filename.startswith(_PKG)


@contextmanager
def count_host_costs() -> Iterator[Counts]:
    """Count aten ops, device->host reads and FlexMARL's host->device copies inside the block."""
    counts = Counts()
    # .cpu() results (held, so their memory is not reused while counting): reading them or
    # their views again is free
    fresh: set[int] = set()
    held: list[torch.Tensor] = []
    orig = {n: getattr(torch.Tensor, n) for n in ("cpu", "tolist", "numpy", "to")}
    orig_tensor, orig_as_tensor = torch.tensor, torch.as_tensor

    def read(kind: str) -> Callable:
        def f(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if self.untyped_storage().data_ptr() not in fresh:
                counts.syncs += 1
                counts.by_sync[f".{kind}()"] += 1
            out = orig[kind](self, *a, **k)
            if kind == "cpu" and isinstance(out, torch.Tensor):
                fresh.add(out.untyped_storage().data_ptr())
                held.append(out)
            return out
        return f

    def to(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        moves = "device" in k or any(isinstance(x, (str, torch.device)) for x in a)
        if moves and _ours():
            counts.h2d += 1
        return orig["to"](self, *a, **k)

    def factory(f: Callable) -> Callable:
        def g(*a: Any, **k: Any) -> Any:
            if k.get("device") is not None and _ours():
                counts.h2d += 1
            return f(*a, **k)
        return g

    for kind in ("cpu", "tolist", "numpy"):
        setattr(torch.Tensor, kind, read(kind))
    torch.Tensor.to = to  # type: ignore[method-assign,assignment]
    torch.tensor, torch.as_tensor = factory(orig_tensor), factory(orig_as_tensor)
    try:
        with _Dispatch(counts):
            yield counts
    finally:
        for n, f in orig.items():
            setattr(torch.Tensor, n, f)
        torch.tensor, torch.as_tensor = orig_tensor, orig_as_tensor


# --- the two decoders on the same batch ------------------------------------------------------
def _model(hidden: int, layers: int, vocab: int, inter: int | None = None) -> Any:

    cfg = ModelConfig(hidden_size=hidden, intermediate_size=inter or 2 * hidden,
                      num_layers=layers, num_heads=max(1, hidden // 64) if hidden >= 64 else 4)
    return build_model("bench", cfg, vocab, 4096, 0)


def requests(n: int, vocab: int, lo: int, prompt: tuple[int, int] = (8, 33), seed: int = 0,
             spread: int = 8) -> list[Any]:
    """Long-tailed requests: output lengths log-normal in [lo, spread*lo], both ends present."""

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(lo * 1.6), 0.7, size=n)), lo,
                      spread * lo).astype(int)
    lengths[0], lengths[1] = lo, spread * lo
    return [GenerationRequest(f"r{i}", "bench", 0,
                              rng.integers(3, vocab, int(rng.integers(*prompt))).tolist(),
                              int(m), seed=seed) for i, m in enumerate(lengths)]


def generate_static(model: Any, reqs: list[Any], max_seqs: int) -> int:
    """`model.generate` in static batches of `max_seqs` (each decodes to its longest); returns
    the decode steps run."""
    steps = 0
    dev = next(model.parameters()).device
    for b in range(0, len(reqs), max_seqs):
        batch = reqs[b:b + max_seqs]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.as_tensor(r.prompt)
            attn[i, width - len(r.prompt):] = 1
        longest = max(r.max_new_tokens for r in batch)
        model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                       top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)
        steps += longest
    return steps


def engine_run(model: Any, reqs: list[Any], max_seqs: int, engine_cls: Any = None) -> int:
    """The continuous-batching engine on `reqs`; returns the decode steps run."""

    engine = (engine_cls or HFEngine)(model, max_seqs, 1 << 30)
    steps = 0
    orig = engine.step

    def step() -> list:
        nonlocal steps
        steps += 1 if engine.seqs else 0
        return orig()

    engine.step = step  # type: ignore[method-assign]
    res = engine.run_to_completion(reqs)
    assert [len(r.tokens) for r in res] == [r.max_new_tokens for r in reqs]
    return steps


def alternating(names: list[str], rounds: int,
                measure: Callable[[str], float]) -> dict[str, list[float]]:
    """`measure(name)` for every name, `rounds` times, in alternating order (forward, then
    backward): side by side on a noisy machine (every benchmark of this package's)."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(measure(name))
    return times


def _sync(model: Any) -> None:
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode_step_costs(model: Any, batch: int, vocab: int, steps: int = 16, rounds: int = 3,
                      engines: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Steady decode steps of `batch` sequences (prompts of 16 tokens): per step host us, aten
    ops, device->host reads, host->device copies; `generate`'s as the difference of an N+steps
    and an N-token run, so its prefill cancels out."""

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, vocab, 16).tolist() for _ in range(batch)]
    dev = next(model.parameters()).device
    ids = torch.as_tensor(prompts).to(dev)
    attn = torch.ones_like(ids)

    def gen(n: int) -> None:
        model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n,
                       do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)

    def eng(n: int, cls: Any = HFEngine) -> Any:
        e = cls(model, batch, 1 << 30)
        e.admit([GenerationRequest(f"s{i}", "bench", 0, p, 1 << 20)
                 for i, p in enumerate(prompts)])
        e.step()
        for _ in range(n):
            e.step()
        return e

    engines = engines or {"engine": HFEngine}
    runs: dict[str, Callable[[int], Any]] = {
        name: functools.partial(lambda n, c: eng(n, c), c=cls) for name, cls in engines.items()}
    runs["generate"] = gen
    base = {name: (0 if name in engines else 4) for name in runs}
    counts = {}
    for name, fn in runs.items():  # counts: deterministic, one run each
        with count_host_costs() as lo:
            fn(base[name])
        with count_host_costs() as hi:
            fn(base[name] + steps)
        counts[name] = (lo, hi)
    def per_step(name: str) -> float:  # the longer run's extra time, per extra step
        _sync(model)
        t0 = CLOCK()
        runs[name](base[name])
        _sync(model)
        t1 = CLOCK()
        runs[name](base[name] + steps)
        _sync(model)
        return ((CLOCK() - t1) - (t1 - t0)) / steps

    times = alternating(list(runs), rounds, per_step)
    out: dict[str, dict[str, Any]] = {}
    for name, (lo, hi) in counts.items():
        out[name] = {"host_us": 1e6 * statistics.median(times[name]),
                     "ops": (hi.ops - lo.ops) / steps, "syncs": (hi.syncs - lo.syncs) / steps,
                     "h2d": (hi.h2d - lo.h2d) / steps,
                     "by_sync": {k: (hi.by_sync[k] - lo.by_sync[k]) / steps
                                 for k in hi.by_sync if hi.by_sync[k] != lo.by_sync[k]}}
    return out


def long_tail_costs(model: Any, reqs: list[Any], max_seqs: int, rounds: int = 3,
                    engines: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """The whole long-tailed batch through each decoder: useful tok/s (median of `rounds`,
    alternating), and per decode step the aten ops, device->host reads, host->device copies
    (prefills and retirements included)."""

    useful = sum(r.max_new_tokens for r in reqs)
    runs: dict[str, Callable[[], int]] = {
        name: functools.partial(engine_run, model, reqs, max_seqs, cls)
        for name, cls in (engines or {"engine": HFEngine}).items()}
    runs["generate"] = lambda: generate_static(model, reqs, max_seqs)
    out: dict[str, dict[str, float]] = {}
    for name, fn in runs.items():
        with count_host_costs() as c:
            steps = fn()
        out[name] = {"steps": steps, "ops": c.ops / steps, "syncs": c.syncs / steps,
                     "h2d": c.h2d / steps}
    def whole(name: str) -> float:
        _sync(model)
        t0 = CLOCK()
        runs[name]()
        _sync(model)
        return CLOCK() - t0

    times = alternating(list(runs), rounds, whole)
    for name in runs:
        if times[name]:  # rounds=0: counts only
            out[name]["s"] = statistics.median(times[name])
            out[name]["tok_s"] = useful / out[name]["s"]
    return out


def print_step_table(title: str, costs: dict[str, dict[str, Any]]) -> None:
    print(title)
    print(f"{'':<12}{'host us/step':>14}{'aten ops/step':>15}{'D2H syncs/step':>16}"
          f"{'H2D/step':>10}")
    for who, c in costs.items():
        print(f"{who:<12}{c['host_us']:>14.0f}{c['ops']:>15.1f}{c['syncs']:>16.2f}"
              f"{c['h2d']:>10.2f}")
    for who, c in costs.items():
        if c.get("by_sync"):
            print(f"  {who} reads/step: " + ", ".join(f"{k} {v:.2f}"
                                                      for k, v in c["by_sync"].items()))


def print_tail_table(title: str, costs: dict[str, dict[str, float]]) -> None:
    print(title)
    if "s" not in costs["generate"]:  # counts only
        print(f"{'':<12}{'steps':>7}{'ops/step':>10}{'syncs/step':>12}{'H2D/step':>10}")
        for who, c in costs.items():
            print(f"{who:<12}{c['steps']:>7.0f}{c['ops']:>10.1f}{c['syncs']:>12.2f}"
                  f"{c['h2d']:>10.2f}")
        return
    print(f"{'':<12}{'steps':>7}{'s':>8}{'useful tok/s':>14}{'ops/step':>10}{'syncs/step':>12}"
          f"{'H2D/step':>10}")
    for who, c in costs.items():
        print(f"{who:<12}{c['steps']:>7.0f}{c['s']:>8.2f}{c['tok_s']:>14.0f}{c['ops']:>10.1f}"
              f"{c['syncs']:>12.2f}{c['h2d']:>10.2f}")
    g = costs["generate"]["tok_s"]
    for who, c in costs.items():
        if who != "generate":
            print(f"{who} / generate: {c['tok_s'] / g:.2f}x")


def grouped_requests(groups: int, group_size: int, vocab: int, prompt_len: int = 256,
                     lo: int = 4, hi: int = 60, seed: int = 0) -> list[Any]:
    """GRPO's case: `groups` prompts of `prompt_len` tokens, each sampled `group_size` times
    (own sample ids, hence own noise streams), output lengths long-tailed in [lo, hi]."""

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(lo * 2.5), 0.8, size=groups * group_size)),
                      lo, hi).astype(int)
    lengths[0], lengths[1] = lo, hi
    out = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        out += [GenerationRequest(f"g{g}_s{k}", "bench", 0, prompt,
                                  int(lengths[g * group_size + k]), seed=seed)
                for k in range(group_size)]
    return out


def kv_footprint(model: Any, reqs: list[Any], max_seqs: int) -> dict[str, float]:
    """KV bytes per held token, averaged over the decode steps of `reqs` through the paged
    engine, against a padded cache (every row as wide as the batch's longest row, as a
    left-padded dynamic cache holds it)."""

    engine = HFEngine(model, max_seqs, 1 << 30)
    queue = list(reqs)
    paged, padded, fraction = [], [], []
    while queue or engine.seqs:
        take: list[Any] = []
        while queue and engine.fits(queue[0], take):
            take.append(queue.pop(0))
        engine.admit(take)
        if engine.seqs:
            st = engine.kv_stats()
            if st.held_tokens:
                paged.append(st.bytes_per_held_token)
                width = max(s.kv for s in engine.seqs)
                padded.append(len(engine.seqs) * width * st.bytes_per_token / st.held_tokens)
                fraction.append(st.fraction_in_use)
        engine.step()
    return {"paged": statistics.mean(paged), "padded": statistics.mean(padded),
            "exact": float(engine.kv.token_bytes), "fraction": statistics.mean(fraction)}


def print_kv_table(title: str, kv: dict[str, float]) -> None:
    print(title)
    print(f"  KV bytes per held token: paged {kv['paged']:.0f}, padded cache {kv['padded']:.0f}, "
          f"one token's K+V {kv['exact']:.0f}; pool fraction in use {kv['fraction']:.2f}")


CHAT_TOPICS = ["the sea", "a lighthouse keeper", "prime numbers", "autumn leaves", "a robot chef",
               "the moon landing", "honey bees", "a rainy city", "chess openings", "volcanoes",
               "a lost key", "the speed of light", "origami", "desert nights", "a jazz trio",
               "glaciers"]
CHAT_ASKS = ["Write a short poem about {}.", "Explain {} to a child in two sentences.",
             "Give me three facts about {}.", "Tell a one-line joke about {}."]


def smollm_requests(n: int, lo: int = 4, hi: int = 64, seed: int = 0,
                    device: str | torch.device = "cpu") -> tuple[Any, list[Any]] | None:
    """Case (c): SmolLM2-135M-Instruct and `n` chat prompts through its real tokenizer's chat
    template, output lengths long-tailed in [lo, hi]; None when the model package is not
    installed (`flexmarl.policy.smollm.INSTALL`)."""

    try:
        tok = load_tokenizer()
        model = build_model("bench", ModelConfig(kind="smollm2"), len(tok), 2048, 0, device)
    except SmolLMUnavailable:
        return None
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(lo * 2.5), 0.8, size=n)), lo, hi).astype(int)
    lengths[0], lengths[min(1, n - 1)] = lo, hi
    reqs = []
    for i in range(n):
        ask = CHAT_ASKS[i % len(CHAT_ASKS)].format(CHAT_TOPICS[(i // 4) % len(CHAT_TOPICS)])
        ids = tok.apply_chat_template([{"role": "user", "content": ask}],
                                      add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        reqs.append(GenerationRequest(f"c{i}", "bench", 0, [int(t) for t in ids],
                                      int(lengths[i]), seed=seed))
    return model, reqs
