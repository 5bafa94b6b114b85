"""How long each training-slot command holds the slot, as the driver sees it (sent to
answered), and what crossed the pipes: `python benchmarks/slot_hold.py [CONFIG]
[--iterations N] [--set k=v]`.

Prints per command kind (the slot protocol's: `bind` is a swap, `get_state` / `keep_restart`
a step's restart point) its count per iteration and the median and p90 milliseconds from the
driver's send to its answer over the iterations after the first, then the bytes per iteration
the driver received from each pool (pickled replies, as they crossed the pipe).
"""

import argparse
import pickle
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/longtail_experts.yaml")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.set, f"train.iterations={args.iterations}"])
    held: dict[str, list[float]] = defaultdict(list)
    received: dict[str, int] = defaultdict(int)
    counting = [False]

    def on_runtime(runtime: Any) -> None:
        pool = runtime.train
        run = pool._run

        async def timed(slot: int, command: str, payload: Any) -> Any:
            t0 = time.perf_counter()
            result = await run(slot, command, payload)
            if counting[0]:
                held[command].append(time.perf_counter() - t0)
            return result

        pool._run = timed
        for w in runtime.rollout_workers + runtime.train_workers:
            dispatch = w._dispatch

            def counted(msg: tuple, dispatch: Any = dispatch, pool_name: str = w.pool) -> None:
                if counting[0]:
                    received[pool_name] += len(pickle.dumps(msg, protocol=5))
                dispatch(msg)

            w._dispatch = counted

    def mark(_: dict) -> None:
        counting[0] = True  # from the end of the first iteration on

    out = Path(tempfile.mkdtemp(prefix="flexmarl-slot-hold-"))
    train(cfg, out, on_iteration=mark, on_runtime=on_runtime)
    n = max(1, args.iterations - 1)
    print(f"{args.config}, {' '.join(args.set) or 'as shipped'}: {n} iterations after the first")
    print(f"{'command':<16}{'per it':>8}{'median ms':>11}{'p90 ms':>9}")
    for command, secs in sorted(held.items(), key=lambda kv: -sum(kv[1])):
        ms = sorted(s * 1e3 for s in secs)
        print(f"{command:<16}{len(ms) / n:>8.1f}{statistics.median(ms):>11.2f}"
              f"{ms[int(0.9 * (len(ms) - 1))]:>9.2f}")
    print("bytes received by the driver per iteration: " + ", ".join(
        f"{pool} {b / n / 1e6:.2f} MB" for pool, b in sorted(received.items())))


if __name__ == "__main__":
    main()
