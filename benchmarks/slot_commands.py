"""What each training-slot command costs the slot: the driver's round trip against the worker's
own span, per command, on one config's run (async unless --set pipeline.mode=sync).

`python benchmarks/slot_commands.py [CONFIG] [--iterations N] [--set k=v]` (default
examples/longtail_experts.yaml, 8 iterations; the local runtime) prints, per slot-protocol
command (bind = a swap, get_state or keep_restart = a restart point, ...), how many ran, the
median driver-side round trip (`LocalTrainPool._run`: the command and its payload through the
pipe, the worker's work, the result back), the median of the worker's span for it
(OUT/trace.json), the seconds per iteration the slot was held by each, and the megabytes per
iteration its results brought back to the driver (pickled, as the pipe carries them). The slot
is held for the whole round trip: where training is the bottleneck (one slot time-shared by
several agents) the gap between the two columns is time the next iteration's versions wait
for. Run it with another checkout on PYTHONPATH to compare code, close together in time (the
load is printed).
"""

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from flexmarl.config.schema import load_config
from flexmarl.orchestrator.run import train
from flexmarl.runtime.local.runtime import LocalTrainPool

# the trace's span label of each command (`TrainHost.SPAN_LABELS`)
LABELS = {"bind": "swap", "accumulate": "acc", "step": "step", "get_state": "state",
          "set_state": "restore", "weights": "weights", "save": "save",
          "keep_restart": "state", "restore_restart": "restore"}


def measure(config: str, overrides: list[str], out: Path) -> dict[str, dict[str, float]]:
    round_trips: dict[str, list[float]] = defaultdict(list)
    replies: dict[str, int] = defaultdict(int)  # bytes of the results, pickled as piped
    original = LocalTrainPool._run

    async def timed(self: LocalTrainPool, slot: int, command: str, payload: object) -> object:
        t0 = time.perf_counter()
        try:
            result = await original(self, slot, command, payload)
        finally:
            round_trips[command].append(time.perf_counter() - t0)
        replies[command] += len(pickle.dumps(result, protocol=5))
        return result

    cfg = load_config(config, overrides)
    LocalTrainPool._run = timed  # type: ignore[method-assign]  # the local slots' transport
    try:
        records = train(cfg, out).records
    finally:
        LocalTrainPool._run = original  # type: ignore[method-assign]
    # (read here rather than through telemetry's reader: the script also runs older checkouts)
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    pools = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and pools.get(e["pid"]) == "train" and e.get("tid") == 0:
            spans[e["name"].split(":")[0]].append(e["dur"] / 1e6)
    n = len(records)
    return {command: {"calls": len(times), "round_trip_ms": 1e3 * statistics.median(times),
                      "span_ms": 1e3 * statistics.median(spans[LABELS[command]])
                      if spans.get(LABELS.get(command, "")) else float("nan"),
                      "held_s_per_it": sum(times) / n,
                      "reply_mb_per_it": replies[command] / n / 1e6}
            for command, times in sorted(round_trips.items())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?", default="examples/longtail_experts.yaml")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flexmarl-slot-commands-") as tmp:
        figures = measure(args.config, [f"train.iterations={args.iterations}", *args.set],
                          Path(tmp))
    print(f"{'command':<12} {'calls':>6} {'round trip ms':>14} {'worker span ms':>15} "
          f"{'slot held s/it':>15} {'reply MB/it':>12}")
    for command, f in figures.items():
        print(f"{command:<12} {f['calls']:>6} {f['round_trip_ms']:>14.1f} {f['span_ms']:>15.1f} "
              f"{f['held_s_per_it']:>15.3f} {f['reply_mb_per_it']:>12.2f}")
    print(f"load average: {load:.1f} before, {os.getloadavg()[0]:.1f} after")
