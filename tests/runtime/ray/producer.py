"""A payload producer actor for the store tests, importing only numpy and ray so its worker
process starts fast."""

from __future__ import annotations

import numpy as np
import ray


class Producer:
    """Stands in for a rollout replica: it creates the payloads (one block per generation
    batch of 64 rows), so it owns them."""

    def fill(self, table, agent: str, n: int, chunk: int = 64 * 160) -> list[str]:
        hexes = []
        for lo in range(0, n, chunk):
            rows = []
            for start in range(lo, min(n, lo + chunk), 64):
                idx = range(start, min(n, lo + chunk, start + 64))
                block = ray.put([np.full(1, -0.5 - i % 7, dtype=np.float32) for i in idx])
                hexes.append(block.hex())
                for j, i in enumerate(idx):
                    rows.append({
                        "sample_id": f"{i // 8:06d}_0_{i % 8}", "node": "speak",
                        "input_id": f"{i // 8:06d}", "turn": 0, "trajectory_id": i % 8,
                        "iteration": 0, "policy_version": 0, "version_vector": {agent: 0},
                        "data": {"prompt": [3, 4, 5], "response": [6],
                                 "allowed": None, "temperature": 1.0},
                        "refs": {"logprobs": (block, j)},
                    })
            ray.get(table.add_generated.remote(rows))
            ray.get(table.set_scored.remote([(r["sample_id"], 1.0, 0.5) for r in rows]))
        return hexes
