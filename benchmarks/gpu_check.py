"""The GPU check: one command, figures printed side by side, nothing downloaded.

    python benchmarks/gpu_check.py            # on a GPU machine (about 4 minutes on one H200)
    python benchmarks/gpu_check.py --small    # the same code paths on the CPU, tiny shapes

Models are random-initialised Llama-shaped ones (the default: 24 layers, hidden 1024, about
0.37B parameters, vocabulary 32000), so only torch, transformers, numpy, safetensors, pydantic,
pyyaml, rich and msgpack are needed. It prints:
1. rollout tokens/s of FlexMARL's continuous-batching engine against `model.generate` (static
   batches) on the same long-tailed requests (output lengths varying 8x); then the engine
   benchmark's cases (a) overhead-bound model, batch 64, outputs 4..64, (b) 256-token
   prompts shared by groups of 8 (prefix sharing) and (c) SmolLM2-135M with its real tokenizer
   on chat prompts (skipped when not installed), with KV bytes per held token (`cases`); and a
   Llama-shaped random model of about 1.1B parameters at batch 64 and 256: tokens/s against
   `generate` and against the memory-bandwidth limit (weights read once per decode step, at
   the copy bandwidth measured on the device) (`llama`);
2. trainer tokens/s against a plain PyTorch loop (same rows, same autocast, same AdamW), a
   long-tailed micro-batch whole against split by length (`split`: which
   `model.split_call_tokens` suits the device), and the K=1 FSDP trainer (a sharded slot's
   code path on a one-rank mesh) against the one-device trainer (`fsdp`);
3. swap MB/s of a full training state device <-> pinned host, and publication MB/s trainer ->
   replica (the wire form a worker pipe carries, loaded into the replica's model), then
   between processes: `runtime.publication` pipe against collective (NCCL with more GPUs than
   replicas, else gloo), 1 and 2 replicas;
4. a short multi-agent run (relay chain) in sync and async on the device: s/iteration, their
   ratio, NVML utilisation of the pools and the success rate at the start and at the end;
5. `rollout/logprob_diff_mean` (rollout vs trainer log-probs of the same weights) in fp32/bf16.
With $OUT set, the figures are also written to $OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flexmarl.bench.training import _batches, _plain_iteration  # noqa: E402
from flexmarl.config.schema import AgentConfig, ModelConfig, load_config  # noqa: E402
from flexmarl.policy.model import build_model  # noqa: E402
from flexmarl.rollout.engine import HFEngine  # noqa: E402
from flexmarl.training import state as st  # noqa: E402
from flexmarl.training.trainer import AgentTrainer, Sample, length_split  # noqa: E402
from flexmarl.types import GenerationRequest  # noqa: E402

MB = 1024 * 1024
RESULTS: dict[str, Any] = {}
PROFILE = False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_cfg(small: bool, dtype: str = "auto", layers: int = 24) -> ModelConfig:
    if small:
        return ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           dtype=dtype)
    return ModelConfig(hidden_size=1024, intermediate_size=2816, num_layers=layers,
                       num_heads=16, dtype=dtype)


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


# --- 1. rollout: engine vs generate ---------------------------------------------------------
def long_tailed_requests(n: int, vocab: int, small: bool, seed: int = 0
                         ) -> list[GenerationRequest]:
    """Prompts of 32-128 tokens; output lengths log-normal, clipped to [L, 8L]."""
    rng = np.random.default_rng(seed)
    lo = 8 if small else 64
    lengths = np.clip(np.exp(rng.normal(np.log(lo * 1.6), 0.7, size=n)), lo, 8 * lo).astype(int)
    lengths[0], lengths[1] = lo, 8 * lo  # the full 8x spread is in the batch
    out = []
    for i, m in enumerate(lengths):
        plen = int(rng.integers(8 if small else 32, 33 if small else 129))
        out.append(GenerationRequest(f"r{i}", "bench", 0, rng.integers(3, vocab, plen).tolist(),
                                     int(m), seed=seed))
    return out


def bench_rollout(device: torch.device, small: bool, vocab: int) -> None:
    section("rollout: continuous-batching engine vs model.generate (same requests)")
    from flexmarl.policy.device import compute_dtype

    dtype = compute_dtype("auto", device)
    # 12 layers: a decode step of a small model is launch-bound, as for any HF-eager engine;
    # fewer layers keep the (long) static-batch baseline within the check's time
    model = build_model("bench", model_cfg(small, layers=12), vocab, 2048, 0, device, dtype)
    n, max_seqs = (24, 8) if small else (192, 32)
    requests = long_tailed_requests(n, vocab, small)
    useful = sum(r.max_new_tokens for r in requests)
    lens = [r.max_new_tokens for r in requests]

    def engine_run() -> float:
        engine = HFEngine(model, max_seqs, 1 << 30)
        sync(device)
        t0 = time.perf_counter()
        res = engine.run_to_completion(requests)
        sync(device)
        assert [len(r.tokens) for r in res] == lens
        return time.perf_counter() - t0

    def generate_run() -> float:
        """Static batches of `max_seqs` in request order; each decodes to its longest."""
        sync(device)
        t0 = time.perf_counter()
        for b in range(0, len(requests), max_seqs):
            batch = requests[b:b + max_seqs]
            width = max(len(r.prompt) for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                attn[i, width - len(r.prompt):] = 1
            longest = max(r.max_new_tokens for r in batch)
            model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                           max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                           top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    full = requests
    requests = [GenerationRequest(r.sample_id, r.agent, 0, r.prompt, 8) for r in full[:8]]
    lens = [8] * 8
    engine_run(), generate_run()  # warm-up on 8 short requests (kernels, allocator)
    requests, lens = full, [r.max_new_tokens for r in full]
    times: dict[str, list[float]] = {"engine": [engine_run()], "generate": [generate_run()]}
    if PROFILE:  # where an engine step's time goes (the next GPU session's first question)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                         else [])
        requests, lens = full[:64], [r.max_new_tokens for r in full[:64]]
        with profile(activities=acts) as prof:
            engine_run()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    e, g = min(times["engine"]), min(times["generate"])
    # what a step costs the host, counted (CPU proxies of launch and sync costs; see
    # flexmarl/bench/engine_overhead.py): aten ops ~ kernel launches, device->host reads
    # (each a sync), blocking host->device copies issued by FlexMARL
    from flexmarl.bench.engine_overhead import (
        decode_step_costs,
        long_tail_costs,
        print_step_table,
        print_tail_table,
    )

    step = decode_step_costs(model, max_seqs, vocab, steps=8, rounds=1)
    print_step_table(f"decode step, {max_seqs} sequences (host us: one round, difference of "
                     "two runs)", step)
    sub = full[:max(16, n // 3)]
    tail = long_tail_costs(model, sub, max_seqs, rounds=0)
    print_tail_table(f"per decode step over {len(sub)} of the requests (prefills, "
                     "retirements included)", tail)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {dtype}, "
          f"{n} requests, outputs {min(lens)}..{max(lens)} tokens (mean {np.mean(lens):.0f}), "
          f"{max_seqs} sequences at a time")
    print(f"{'':<22}{'s':>8}{'useful tok/s':>14}")
    print(f"{'flexmarl engine':<22}{e:>8.2f}{useful / e:>14.0f}")
    print(f"{'model.generate':<22}{g:>8.2f}{useful / g:>14.0f}")
    print(f"engine / generate: {g / e:.2f}x  (target >= 2x)")
    RESULTS["rollout"] = {"engine_tps": useful / e, "generate_tps": useful / g,
                          "speedup": g / e, "requests": n, "max_seqs": max_seqs,
                          "decode_step": {k: {m: v for m, v in c.items() if m != "by_sync"}
                                          for k, c in step.items()},
                          "per_step": tail}


def bench_rollout_cases(device: torch.device, small: bool) -> None:
    """The engine benchmark's cases on this device (benchmarks/engine_overhead.py): (a) an
    overhead-bound model, batch 64, outputs 4..64; (b) 256-token prompts shared by groups of 8.
    One timed round each, after a warm-up run, alternating engine and generate."""
    section("rollout cases (a) overhead-bound, (b) shared prompts: engine vs model.generate")
    from flexmarl.bench.engine_overhead import (
        _model,
        grouped_requests,
        kv_footprint,
        long_tail_costs,
        print_kv_table,
        print_tail_table,
        requests,
        smollm_requests,
    )

    out = {}
    n_a, groups = (16, 2) if small else (64, 8)
    cases = {
        "a": (_model(32, 1, 512), requests(n_a, 512, 4, spread=16)),
        "b": (_model(256, 4, 2048), grouped_requests(groups, 8, 2048,
                                                     prompt_len=32 if small else 256)),
    }
    smol = smollm_requests(8 if small else 64, hi=16 if small else 64)
    if smol is None:
        print("(c) skipped: SmolLM2 is not installed (flexmarl/policy/smollm.py: INSTALL)")
    else:
        cases["c"] = smol
    for case, (model, reqs) in cases.items():
        model = model.to(device)
        long_tail_costs(model, reqs[:8], 64, rounds=1)  # warm-up
        costs = long_tail_costs(model, reqs, 64, rounds=1)
        print_tail_table(f"({case}) {len(reqs)} requests, batch 64", costs)
        kv = kv_footprint(model, reqs, 64)
        print_kv_table(f"({case}) KV memory", kv)
        out[case] = {"speedup": costs["engine"]["tok_s"] / costs["generate"]["tok_s"],
                     "engine_tps": costs["engine"]["tok_s"], "kv": kv}
    RESULTS["rollout_cases"] = out


def copy_bandwidth(device: torch.device, mb: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the memory-bandwidth limit
    a decode step that reads every weight once is held against."""
    src = torch.empty(mb * MB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def bench_llama(device: torch.device, small: bool) -> None:
    """A Llama-shaped random model (TinyLlama's 1.1B shape: hidden 2048, 22 layers, GQA 32/4
    heads, vocabulary 32000; tiny on a CPU) at batch 64 and 256 on long-tailed requests: the
    engine's tokens/s against `generate` (goal >= 3x) and against the bandwidth limit
    (batch x bandwidth / weight bytes: goal >= 30% at batch 64)."""
    section("Llama-shaped random model: engine vs generate vs the memory-bandwidth limit")
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexmarl.bench.engine_overhead import long_tail_costs
    from flexmarl.policy.device import compute_dtype

    dtype = compute_dtype("auto", device)
    if small:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                          max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, 64 if small else 2048)
    print(f"model: {weight_bytes / dtype.itemsize / 1e9:.2f}B params, {dtype}; measured copy "
          f"bandwidth {bw / 1e9:.0f} GB/s")
    from flexmarl.rollout.engine import HFEngine

    # the eager default and, on a GPU, the CUDA-graph decode steps it does not default to until
    # this check has run them (rollout/engine.py, `decode`)
    engines: dict[str, Any] = {"engine": HFEngine}
    graph_engines: list[Any] = []

    def graph_engine(*args: Any, **kwargs: Any) -> Any:
        engine = HFEngine(*args, decode="cuda_graph", **kwargs)
        graph_engines.append(engine)
        return engine

    if device.type == "cuda":
        engines["engine_graph"] = graph_engine
    out: dict[Any, Any] = {}
    for batch in ((8, 16) if small else (64, 256)):
        reqs = long_tailed_requests(batch, cfg.vocab_size, True, seed=batch)
        long_tail_costs(model, reqs[:4], batch, rounds=1, engines=engines)  # warm-up
        costs = long_tail_costs(model, reqs, batch, rounds=1, engines=engines)
        limit = batch * bw / weight_bytes
        g = costs["generate"]["tok_s"]
        out[batch] = {"generate_tps": g, "limit_tps": limit}
        for name in engines:
            e = costs[name]["tok_s"]
            print(f"batch {batch:>4} {name:<12}: {e:>9.0f} tok/s, generate {g:>9.0f} tok/s, "
                  f"{e / g:.2f}x (goal >= 3x); bandwidth limit {limit:>9.0f} tok/s, at "
                  f"{100 * e / limit:.1f}% of it (goal >= 30% at batch 64)")
            out[batch][name] = {"tps": e, "speedup": e / g, "fraction_of_limit": e / limit}
        # the engine_graph row must time CUDA graphs: an engine that fell back to eager decode
        # (capture failed) or never took a static step would time eager under that name
        fell_back = [e for e in graph_engines
                     if e.decode_mode != "cuda_graph" or e._runner.captures == 0]
        if fell_back:
            raise RuntimeError(f"batch {batch}: {len(fell_back)} of {len(graph_engines)} "
                               "CUDA-graph engines decoded eagerly (no graph captured); the "
                               "engine_graph figures above are not CUDA-graph figures")
        graph_engines.clear()
    RESULTS["llama"] = {"params": weight_bytes / dtype.itemsize, "bandwidth": bw, **out}


# --- training sections' shared parts --------------------------------------------------------
def _train_case(small: bool, vocab: int
                ) -> tuple[AgentConfig, tuple[int, int, int, int], list[list[Sample]]]:
    """The agent config and rows every training section compares trainers on:
    (n_micro, rows, prompt, response) and the micro-batches."""
    cfg = AgentConfig.model_validate({"model": model_cfg(small).model_dump(),
                                      "algorithm": {"name": "grpo"},
                                      "optim": {"lr": 1e-5, "max_grad_norm": 1.0}})
    rows, prompt, response = (8, 16, 16) if small else (16, 128, 384)
    n_micro = 2 if small else 4
    return cfg, (n_micro, rows, prompt, response), _batches(vocab, n_micro, rows, prompt,
                                                            response)


def _trainer_step(trainer: AgentTrainer, batches: list[list[Sample]], version: int) -> None:
    """One iteration: every micro-batch (as rows of `version`), then the step."""
    for b in batches:
        trainer.accumulate([Sample(s.sample_id, s.prompt, s.response, s.old_logprobs,
                                   s.advantage, s.allowed, s.temperature, version) for s in b])
    trainer.step()


def _alternated(device: torch.device, steps: dict[str, Callable[[int], None]],
                rounds: int) -> dict[str, float]:
    """Median seconds of each `steps[name](round)`: round 0 warms up, then `rounds` rounds in
    alternating order (side by side on a noisy machine)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for who in (names if r % 2 == 0 else names[::-1]):
            sync(device)
            t0 = time.perf_counter()
            steps[who](r)
            sync(device)
            if r > 0:
                times[who].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


# --- 2. trainer vs plain loop ---------------------------------------------------------------
def bench_trainer(device: torch.device, small: bool, vocab: int) -> AgentTrainer:
    section("training: AgentTrainer vs a plain PyTorch loop (same rows, autocast, AdamW)")
    cfg, (n_micro, rows, prompt, response), batches = _train_case(small, vocab)
    trainer = AgentTrainer("bench", cfg, vocab, 1024, run_seed=0, total_steps=100,
                           device=str(device))
    model = build_model("bench", cfg.model, vocab, 1024, 0, device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    tokens = sum(len(s.prompt) + len(s.response) for b in batches for s in b)
    times = _alternated(device, {
        "flexmarl": functools.partial(_trainer_step, trainer, batches),
        "plain": lambda _r, m=model, o=opt: _plain_iteration(  # bound: deleted below
            m, params, o, batches, 1.0, device, trainer.compute_dtype)}, 2 if small else 4)
    f, p = times["flexmarl"], times["plain"]
    print(f"{n_micro} micro-batches x {rows} rows x {prompt}+{response} tokens, "
          f"compute {trainer.compute_dtype}, fp32 master weights")
    print(f"{'':<22}{'s/step':>8}{'tok/s':>10}")
    print(f"{'flexmarl trainer':<22}{f:>8.3f}{tokens / f:>10.0f}")
    print(f"{'plain loop':<22}{p:>8.3f}{tokens / p:>10.0f}")
    print(f"trainer overhead: {100 * (f / p - 1):+.1f}%  (target <= +10%)")
    if device.type == "cuda":
        print(f"peak memory: {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")
    RESULTS["training"] = {"flexmarl_tps": tokens / f, "plain_tps": tokens / p,
                           "overhead": f / p - 1}
    del model, opt
    gc.collect()
    return trainer


# --- 2a. a long-tailed micro-batch, whole against split by length ---------------------------
def bench_split(device: torch.device, small: bool, vocab: int) -> None:
    """`model.split_call_tokens` on this device: one micro-batch of long-tailed rows (output
    lengths log-normal, sigma 1, capped at 8x the mean) through the trainer whole (0), with the
    default (None: 1024 on a GPU) and with a few other costs per call, alternating."""
    section("training: a long-tailed micro-batch whole vs split by length (split_call_tokens)")
    rows, prompt, mean = (16, 16, 16) if small else (16, 128, 128)
    rng = np.random.default_rng(0)
    lengths = np.minimum(8 * mean, np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, rows)))
    batch = [Sample(f"0-{i}_0_0", rng.integers(3, vocab, size=prompt).tolist(),
                    rng.integers(3, vocab, size=int(n)).tolist(), [-1.0] * int(n),
                    float(rng.normal()), None, 1.0, 0) for i, n in enumerate(lengths)]
    padded = rows * max(len(s.prompt) + len(s.response) for s in batch)
    real = sum(len(s.prompt) + len(s.response) for s in batch)
    choices: list[int | None] = [0, None, 64, 256, 4096]
    trainers = {}
    for split in choices:
        raw = {"model": {**model_cfg(small).model_dump(), "split_call_tokens": split},
               "algorithm": {"name": "grpo"}, "optim": {"lr": 1e-5}}
        trainers[str(split)] = AgentTrainer("bench", AgentConfig.model_validate(raw), vocab,
                                            2048, run_seed=0, device=str(device))

    def accumulate(trainer: AgentTrainer, _r: int) -> None:
        trainer.accumulate(batch)
        trainer._clear_step()  # the same version's rows again next round
    times = _alternated(device, {k: functools.partial(accumulate, t)
                                 for k, t in trainers.items()}, 2 if small else 5)
    print(f"{rows} rows, prompt {prompt}, outputs {int(lengths.min())}..{int(lengths.max())} "
          f"tokens: {padded} padded, {real} real tokens")
    print(f"{'split_call_tokens':<20}{'runs':>6}{'ms':>10}{'vs whole':>10}")
    for key, trainer in trainers.items():
        n = len(length_split([len(s.prompt) + len(s.response) for s in batch],
                             trainer.split_call_tokens))
        label = f"{key} ({trainer.split_call_tokens})" if key == "None" else key
        print(f"{label:<20}{n:>6}{1e3 * times[key]:>10.1f}{times[key] / times['0']:>10.2f}")
    RESULTS["split"] = {"padded": padded, "real": real,
                        "ms": {k: 1e3 * v for k, v in times.items()}}
    del trainers
    gc.collect()


# --- 2b. the K=1 FSDP trainer (a sharded slot of one rank) vs the one-device trainer --------
def bench_fsdp(device: torch.device, small: bool, vocab: int) -> None:
    """The sharded slot's code path on one device: `ShardedAgentTrainer` (FSDP2 `fully_shard`
    per block on a one-rank mesh, NCCL on a GPU, gloo on the CPU) against `AgentTrainer` on the
    same rows, steps alternated. A one-GPU machine cannot check K >= 2 with NCCL; this is
    FSDP's own overhead (hooks, DTensor parameters, the optimizer over shards)."""
    section("training: K=1 FSDP trainer (one-rank mesh) vs the one-device trainer")
    import torch.distributed as dist  # this section alone starts a process group

    from flexmarl.training.sharded import ShardedAgentTrainer

    cfg, (n_micro, rows, prompt, response), batches = _train_case(small, vocab)
    store = tempfile.mkdtemp(prefix="flexmarl-fsdp-")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        trainers = {
            "fsdp": ShardedAgentTrainer("bench", cfg, vocab, 1024, run_seed=0, total_steps=100,
                                        device=str(device)),
            "plain": AgentTrainer("bench", cfg, vocab, 1024, run_seed=0, total_steps=100,
                                  device=str(device))}
        tokens = sum(len(s.prompt) + len(s.response) for b in batches for s in b)
        rounds = 2 if small else 4
        times = _alternated(device, {
            who: functools.partial(_trainer_step, trainers[who], batches)
            for who in ("fsdp", "plain")}, rounds)
        # the same rows and seed: the two trainers' weights stay equal (summation order aside)
        full = trainers["fsdp"].full_weights()
        plain_w = trainers["plain"].full_weights()
        worst = max((full[k].float().cpu() - plain_w[k].float().cpu()).abs().max().item()
                    for k in plain_w)
    finally:
        dist.destroy_process_group()
    f, p = times["fsdp"], times["plain"]
    print(f"{n_micro} micro-batches x {rows} rows x {prompt}+{response} tokens, {backend}, "
          f"{rounds} rounds alternated")
    print(f"{'':<22}{'s/step':>8}{'tok/s':>10}")
    print(f"{'K=1 FSDP trainer':<22}{f:>8.3f}{tokens / f:>10.0f}")
    print(f"{'one-device trainer':<22}{p:>8.3f}{tokens / p:>10.0f}")
    print(f"FSDP overhead: {100 * (f / p - 1):+.1f}%  (target <= +10%); "
          f"max |weight difference| after {rounds + 1} steps: {worst:.1e}")
    RESULTS["fsdp"] = {"fsdp_s": f, "plain_s": p, "overhead": f / p - 1, "max_diff": worst}


# --- 3. swap and publication ----------------------------------------------------------------
def bench_transfers(device: torch.device, small: bool, vocab: int, trainer: AgentTrainer
                    ) -> None:
    section("transfers: training-state swap and weight publication")
    pin = device.type == "cuda"
    captured = st.capture(trainer)
    nbytes = captured.nbytes
    res: dict[str, float] = {"state_mb": nbytes / MB}
    for _ in range(2):  # the second round is measured (first touches allocator and pins)
        sync(device)
        t0 = time.perf_counter()
        host = st.move(captured, st.Host(pin=pin))
        sync(device)
        t1 = time.perf_counter()
        back = st.move(host, st.Device(str(device)))
        sync(device)
        t2 = time.perf_counter()
        del back
    st.restore(trainer, host.load())
    sync(device)
    t3 = time.perf_counter()
    st.restore(trainer, host.load())
    sync(device)
    t4 = time.perf_counter()
    res["d2h_mbs"] = nbytes / MB / (t1 - t0)
    res["h2d_mbs"] = nbytes / MB / (t2 - t1)
    res["restore_mbs"] = nbytes / MB / (t4 - t3)
    print(f"training state (weights, AdamW moments, grads): {nbytes / MB:.0f} MB")
    print(f"swap out device -> {'pinned ' if pin else ''}host: {res['d2h_mbs']:.0f} MB/s; "
          f"swap in host -> device: {res['h2d_mbs']:.0f} MB/s; "
          f"restore into the kept trainer: {res['restore_mbs']:.0f} MB/s")
    del captured, host
    gc.collect()
    from flexmarl.policy.device import compute_dtype
    from flexmarl.runtime.local.workers import from_numpy, publish_form

    replica = HFEngine(build_model("bench", model_cfg(small), vocab, 1024, 0, device,
                                   compute_dtype("auto", device)), 8, 1 << 20)
    pub: list[float] = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        weights = trainer.weights()  # device -> host, in the compute dtype
        wire = pickle.dumps(publish_form(weights, "bench", trainer.version), protocol=5)
        replica.load_weights(from_numpy(pickle.loads(wire)))
        sync(device)
        pub.append(time.perf_counter() - t0)
    pub_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    res["publish_mb"] = pub_bytes / MB
    res["publish_mbs"] = pub_bytes / MB / min(pub)
    print(f"publication trainer -> replica ({pub_bytes / MB:.0f} MB in "
          f"{next(iter(weights.values())).dtype}, through the pipe's wire form): "
          f"{res['publish_mbs']:.0f} MB/s")
    del replica
    gc.collect()
    # runtime.publication pipe vs collective between processes (flexmarl/bench/publication.py):
    # NCCL when there are more GPUs than replicas, else gloo through host memory
    from flexmarl.bench.publication import measure, table

    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    size = 10.0 if small else round(pub_bytes / MB)
    rows = measure([size], [1, 2], rounds=2 if small else 3, device=str(device), dtype=dtype)
    print(f"publication between processes, pipe vs collective ({dtype}, median of alternating "
          "rounds):")
    print(table(rows))
    RESULTS["publication"] = rows
    RESULTS["transfers"] = res


# --- 4. logprob mismatch --------------------------------------------------------------------
def bench_logprob_diff(device: torch.device, small: bool, vocab: int) -> None:
    section("rollout vs trainer log-probs of the same weights")
    out = {}
    for dtype in ("float32", "bfloat16"):
        if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            continue
        cfg = AgentConfig.model_validate({"model": model_cfg(small, dtype, 12).model_dump(),
                                          "algorithm": {"name": "grpo"}})
        trainer = AgentTrainer("lp", cfg, vocab, 1024, run_seed=0, total_steps=10,
                               device=str(device))
        replica = HFEngine(build_model("lp", cfg.model, vocab, 1024, 0, device,
                                       trainer.compute_dtype), 16, 1 << 20)
        replica.load_weights(trainer.weights())
        requests = long_tailed_requests(16, vocab, small=True, seed=1)
        results = replica.run_to_completion(requests)
        samples = [Sample(r.sample_id, q.prompt, r.tokens, r.logprobs, 1.0, None, 1.0, 0)
                   for q, r in zip(requests, results, strict=True)]
        trainer.accumulate(samples)
        metrics = trainer.step()
        out[dtype] = (metrics["logprob_diff_mean"], metrics["logprob_diff_max"])
        print(f"{dtype:<9} rollout/logprob_diff_mean {out[dtype][0]:.2e}   "
              f"max {out[dtype][1]:.2e}")
        del trainer, replica
        gc.collect()
    RESULTS["logprob_diff"] = out


# --- 5. multi-agent run, sync vs async ------------------------------------------------------
def bench_run(device: torch.device, iterations: int, run_dir: str | None) -> None:
    section("multi-agent run on the device: relay chain, sync vs async")
    from flexmarl.orchestrator.run import train

    rows = {}
    base = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="flexmarl-gpu-run-"))
    for mode in ("sync", "async"):
        cfg = load_config(str(ROOT / "examples/relay_chain.yaml"), [
            f"pipeline.mode={mode}", f"train.iterations={iterations}",
            f"runtime.devices={'cuda' if device.type == 'cuda' else 'cpu'}"])
        t0 = time.perf_counter()
        result = train(cfg, base / mode)
        wall = time.perf_counter() - t0
        recs = result.records
        steady = recs[1:] or recs
        k = max(1, len(recs) // 5)
        row = {
            "s_per_it": statistics.median(r["wall_s"] for r in steady),
            "wall_s": wall,
            "success_start": float(np.mean([r["task/success_rate"] for r in recs[:k]])),
            "success_end": float(np.mean([r["task/success_rate"] for r in recs[-k:]])),
            "rollout_busy": statistics.mean(r["pool/rollout/busy_frac"] for r in steady),
            "train_busy": statistics.mean(r["pool/train/busy_frac"] for r in steady),
            "gpu_util": {key.split("/")[1]: statistics.mean(r.get(key, 0.0) for r in steady)
                         for key in recs[-1] if key.endswith("gpu_util")},
            "logprob_diff_mean": statistics.mean(
                r.get("rollout/logprob_diff_mean", float("nan")) for r in steady),
            "placement": {p: [w.get("gpus") for w in result.placement[p]]
                          for p in ("rollout", "train")},
            "wall_per_iteration": [round(r["wall_s"], 3) for r in recs],
        }
        rows[mode] = row
    print(f"{iterations} iterations each; placement {rows['sync']['placement']}")
    print(f"{'mode':<6}{'s/it':>8}{'rollout busy':>14}{'train busy':>12}{'gpu util':>22}"
          f"{'success start->end':>22}{'lp diff':>10}")
    for mode, r in rows.items():
        util = " ".join(f"{p}={u:.2f}" for p, u in r["gpu_util"].items()) or "n/a"
        print(f"{mode:<6}{r['s_per_it']:>8.3f}{r['rollout_busy']:>14.2f}{r['train_busy']:>12.2f}"
              f"{util:>22}{r['success_start']:>11.3f} -> {r['success_end']:.3f}"
              f"{r['logprob_diff_mean']:>10.1e}")
    print(f"async/sync: {rows['async']['s_per_it'] / rows['sync']['s_per_it']:.3f}")
    for mode, r in rows.items():
        print(f"{mode} s per iteration: {r['wall_per_iteration']}  (whole run {r['wall_s']:.0f} s)")
    RESULTS["run"] = rows


def write_results(path: Path, key: str | None) -> None:
    """The figures so far to `path`; with `key`, merged under it into what is there."""
    results: dict[str, Any] = RESULTS
    if key:
        results = json.loads(path.read_text()) if path.exists() else {}
        results[key] = RESULTS
    path.write_text(json.dumps(results, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--only",
                        default="rollout,cases,llama,training,split,fsdp,transfers,logprob,run")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler table of the engine's run")
    parser.add_argument("--json", default=None,
                        help="where the figures go, rewritten after each section "
                             "(default $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--key", default=None,
                        help="merge the figures into --json under this key (several processes "
                             "writing one file)")
    parser.add_argument("--run-dir", default=None,
                        help="keep the multi-agent runs' folders (trace, metrics) here")
    args = parser.parse_args()
    json_path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json")
                              if os.environ.get("OUT") else None)
    global PROFILE
    PROFILE = args.profile
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"flexmarl gpu check: torch {torch.__version__}, device {name}, "
          f"{os.cpu_count()} CPU cores")
    RESULTS["device"] = name
    vocab = 256 if args.small else 32000
    t0 = time.perf_counter()
    steps = [("rollout", lambda: bench_rollout(device, args.small, vocab)),
             ("cases", lambda: bench_rollout_cases(device, args.small)),
             ("llama", lambda: bench_llama(device, args.small))]
    trainer_box: list[AgentTrainer] = []
    steps.append(("training", lambda: trainer_box.append(
        bench_trainer(device, args.small, vocab))))
    steps.append(("split", lambda: bench_split(device, args.small, vocab)))
    steps.append(("fsdp", lambda: bench_fsdp(device, args.small, vocab)))
    steps.append(("transfers", lambda: trainer_box and bench_transfers(
        device, args.small, vocab, trainer_box[0])))
    steps.append(("logprob", lambda: bench_logprob_diff(device, args.small, vocab)))
    steps.append(("run", lambda: bench_run(device, args.iterations, args.run_dir)))
    by_key = dict(steps)
    for key in [k for k in args.only.split(",") if k in by_key]:  # in the order given
        fn = by_key[key]
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next figure
            import traceback

            traceback.print_exc()
            RESULTS.setdefault("errors", {})[key] = repr(exc)
        print(f"[{key}: {time.perf_counter() - t:.0f} s]", flush=True)
        if key == "transfers":
            trainer_box.clear()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if json_path:  # after every section, so a run cut short keeps what it measured
            write_results(Path(json_path), args.key)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
