"""Peak resident memory of each rank while a sharded slot builds its agent: the full model on
every rank, then sharded (`meta_init=False`, the old path), against the meta-device init
(`meta_init=True`: rank 0 alone builds the full weights, ranks 1..K-1 allocate their shard
only). The two paths run in alternating rounds, each K a real gloo group of spawned processes.

A rank's figure is its peak RSS (`ru_maxrss`) after the trainer is built, less its RSS just
before (torch, transformers and the process group already loaded), so the table shows what
building the agent added at its highest point; `shard MB` is the float32 parameter shard the
rank keeps.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from flexmarl.bench.sharded import VOCAB, agent_config
from flexmarl.runtime.local.slot_ranks import end_rank
from flexmarl.training.sharded import ShardedAgentTrainer

MB = 2**20


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, out: str, hidden: int, layers: int, meta_init: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    dist.barrier()
    before = _rss_bytes()
    tr = ShardedAgentTrainer("a", agent_config(hidden, layers), VOCAB, 64, run_seed=0,
                             device="cpu", meta_init=meta_init)
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    row = {"K": world, "rank": rank, "meta_init": meta_init, "rss_before": before,
           "peak_rss": peak, "added_peak": max(0, peak - before), "rss_after": _rss_bytes(),
           "shard_bytes": tr.local_nbytes()["params"],
           "n_params": sum(p.numel() for p in tr.model.parameters())}
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(row))
    end_rank(exit_process=True)


def measure(ks: list[int], hidden: int, layers: int, rounds: int) -> list[dict[str, Any]]:
    """One row per (K, path, rank): the median over `rounds` alternating rounds."""
    runs: dict[tuple[int, bool, int], list[dict[str, Any]]] = {}
    for _round in range(rounds):
        for k in ks:
            for meta_init in (False, True):
                with tempfile.TemporaryDirectory() as d:
                    mp.spawn(_rank, args=(k, d, hidden, layers, meta_init), nprocs=k)
                    for r in range(k):
                        row = json.loads(Path(f"{d}/rank{r}.json").read_text())
                        runs.setdefault((k, meta_init, r), []).append(row)
    out = []
    for (_k, _meta, _r), rows in sorted(runs.items()):
        row = dict(rows[0])
        for key in ("rss_before", "peak_rss", "added_peak", "rss_after"):
            row[key] = statistics.median(x[key] for x in rows)
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'K':>2} {'rank':>4} {'init':>10} {'shard MB':>9} {'RSS before MB':>13} "
            f"{'peak RSS MB':>11} {'added at peak MB':>16} {'RSS after MB':>12}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['K']:>2} {r['rank']:>4} {'meta' if r['meta_init'] else 'full':>10} "
            f"{r['shard_bytes'] / MB:>9.1f} {r['rss_before'] / MB:>13.1f} "
            f"{r['peak_rss'] / MB:>11.1f} {r['added_peak'] / MB:>16.1f} "
            f"{r['rss_after'] / MB:>12.1f}")
    return "\n".join(lines)
