"""Sharded (FSDP2) training of one agent at K = 1, 2, 4 ranks on the same model: per-rank bytes of
parameters, gradients and optimizer state, step time, swap time (capture this rank's shard ->
host wire form -> restore), publication time (bucketed all-gather of the full weights), and the
largest model whose training state fits a per-device budget at each K.

Each K is a real gloo group of spawned processes (NCCL on GPUs is the same code); the K's run in
alternating rounds so machine noise hits them alike. Activations are not in the budget figure.
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexmarl.config.schema import AgentConfig
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training.sharded import ShardedAgentTrainer
from flexmarl.training.state import swap_in, swap_out
from flexmarl.types import Sample

VOCAB = 64
MB = 2**20


def agent_config(hidden: int, layers: int) -> AgentConfig:
    return AgentConfig.model_validate({
        "model": {"hidden_size": hidden, "intermediate_size": 3 * hidden + 1,
                  "num_layers": layers, "num_heads": max(1, hidden // 64), "init_std": 0.02},
        "algorithm": {"name": "grpo"}, "optim": {"lr": 1e-4}})


def _samples(step: int, rows: int) -> list[Sample]:
    g = torch.Generator().manual_seed(step)
    return [Sample(f"{step}-{i}", torch.randint(3, VOCAB, (24,), generator=g).tolist(),
                   torch.randint(3, VOCAB, (16,), generator=g).tolist(), [-2.0] * 16,
                   float(i % 2) - 0.5, list(range(3, VOCAB)), 1.0, step, 0.0)
            for i in range(rows)]


def _rank(rank: int, world: int, store: str, out: str, hidden: int, layers: int, steps: int,
          rows: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    tr = ShardedAgentTrainer("a", agent_config(hidden, layers), VOCAB, 64, run_seed=0,
                             device="cpu")
    step_s = []
    grads = 0
    for k in range(steps):
        t0 = time.perf_counter()
        tr.accumulate(_samples(k, rows))
        grads = tr.local_nbytes()["grads"]  # held between backward and step
        tr.step()
        dist.barrier()
        step_s.append(time.perf_counter() - t0)
    nbytes = tr.local_nbytes()
    t0 = time.perf_counter()
    state = tr.capture_shard()
    form = swap_out(state, None, f"a-{rank}")
    tr.restore_shard(swap_in(form))
    dist.barrier()
    swap_s = time.perf_counter() - t0
    swap_bytes = state.nbytes
    t0 = time.perf_counter()
    weights = tr.weights()
    dist.barrier()
    publish_s = time.perf_counter() - t0
    row = {"K": world, "rank": rank, "params_bytes": nbytes["params"], "grads_bytes": grads,
           "optim_bytes": nbytes["optimizer"], "swap_bytes": swap_bytes,
           "step_s": statistics.median(step_s[1:] or step_s), "swap_s": swap_s,
           "publish_s": publish_s,
           "publish_mb": sum(v.numel() * v.element_size() for v in weights.values()) / MB,
           "n_params": sum(p.numel() for p in tr.model.parameters())}
    Path(f"{out}/K{world}-rank{rank}.json").write_text(json.dumps(row))
    end_rank(exit_process=True)  # as a slot's rank ends (no finalization: see end_rank)


def measure(ks: list[int], hidden: int, layers: int, steps: int, rows: int, rounds: int,
            budget_gb: float) -> list[dict[str, Any]]:
    """One row per K (the rank holding the most bytes; step/swap/publish: median over rounds)."""
    per_k: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    for _round in range(rounds):
        for k in ks:
            with tempfile.TemporaryDirectory() as d:
                mp.spawn(_rank, args=(k, f"{d}/store", d, hidden, layers, steps, rows),
                         nprocs=k)
                ranks = [json.loads(Path(f"{d}/K{k}-rank{i}.json").read_text())
                         for i in range(k)]
                # the largest rank (uneven shards) is the one the budget must fit
                worst = max(ranks, key=lambda x: x["params_bytes"] + x["grads_bytes"]
                            + x["optim_bytes"])
                per_k[k].append(worst)
    rows_out = []
    base = None
    for k in ks:
        runs = per_k[k]
        row = dict(runs[0])
        for key in ("step_s", "swap_s", "publish_s"):
            row[key] = statistics.median(x[key] for x in runs)
        state = row["params_bytes"] + row["grads_bytes"] + row["optim_bytes"]
        row["state_bytes"] = state
        if base is None:
            base = state
        row["state_vs_K1"] = state / base
        # measured bytes of training state per parameter on one rank -> the largest model
        # whose parameters, gradients and AdamW moments fit the budget on each device
        row["fits_params"] = int(budget_gb * 2**30 / (state / row["n_params"]))
        row["budget_gb"] = budget_gb
        rows_out.append(row)
    return rows_out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'K':>2} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'state/K1':>8} "
            f"{'swap MB':>8} {'step s':>7} {'swap s':>7} {'publish s':>9} {'pub MB/s':>8} "
            f"{'fits (params)':>14}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['K']:>2} {r['params_bytes'] / MB:>10.2f} {r['grads_bytes'] / MB:>9.2f} "
            f"{r['optim_bytes'] / MB:>9.2f} {r['state_vs_K1']:>8.3f} "
            f"{r['swap_bytes'] / MB:>8.2f} {r['step_s']:>7.3f} {r['swap_s']:>7.3f} "
            f"{r['publish_s']:>9.3f} {r['publish_mb'] / max(r['publish_s'], 1e-9):>8.1f} "
            f"{r['fits_params'] / 1e9:>12.2f} B")
    return "\n".join(lines)
