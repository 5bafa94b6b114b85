"""Training-slot metrics per iteration record: time waiting for a slot.

The runtime's train pool keeps cumulative per-agent counters (`TrainPool.slot_counters`); this
source turns them into the amount since the previous record, under fixed names:
`agent/<a>/slot_wait_s` and
the pool total `pool/train/slot_wait_s`. (With the async pipeline iterations overlap, so "since
the previous record" is the honest unit.) Swaps and swap seconds come from the trace's swap
spans in the iteration's window (`pool/train/swaps`, `pool/train/swap_s`, `agent/<a>/swaps`,
written by the orchestrator).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexmarl.api.runtime import TrainPool

KEYS = ("slot_wait_s",)


class SlotStatsSource:
    def __init__(self, pool: TrainPool, agents: list[str]) -> None:
        self.pool = pool
        self.agents = list(agents)
        self.last: dict[str, dict[str, float]] = {}

    @classmethod
    def for_pool(cls, pool: TrainPool, agents: list[str]) -> SlotStatsSource | None:
        return cls(pool, agents) if pool.slot_counters() is not None else None

    def collect(self) -> dict[str, float]:
        current = {a: dict(v) for a, v in (self.pool.slot_counters() or {}).items()}
        out: dict[str, float] = {}
        totals = dict.fromkeys(KEYS, 0.0)
        for agent in sorted(set(self.agents) | set(current)):
            now, before = current.get(agent, {}), self.last.get(agent, {})
            for key in KEYS:
                delta = float(now.get(key, 0.0)) - float(before.get(key, 0.0))
                out[f"agent/{agent}/{key}"] = delta
                totals[key] += delta
        for key, value in totals.items():
            out[f"pool/train/{key}"] = value
        self.last = current
        return out
