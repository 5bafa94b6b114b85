"""Drift behind `flexmarl serve`: a bad deploy rolled back, and an environment that changes
mid-stream.

    .venv/bin/python benchmarks/drift.py [RUN_DIR] [--phase 15] [--window 200] [--drop 0.25]

RUN_DIR is a trained referential game (default: `flexmarl train examples/referential_game.yaml`
into a temporary folder, about a minute). The server runs in its own process with `--capture`
(the drift monitor on: `--drift-window`, `--drift-drop`); clients run episodes of the graph
(`POST /v1/episodes`, temperature 1) and send a reward as feedback. Three phases of `--phase`
seconds each, then a fourth:

1. steady: the reward is the episode's success;
2. a bad deploy: the operator hot-reloads the listener with freshly initialised weights
   (`POST /v1/admin/reload`); success falls, the monitor sees the drop and rolls the listener
   back to the version of its peak;
3. steady again;
4. the environment changes: from now on the clients' reward is 0 for every odd-seeded input
   (half the world's answers became wrong), whatever the policy; the monitor alerts, and
   there is no version to roll back to.

Prints the served success and the clients' reward per window with the versions serving, and
the drift alerts from the events log / `GET /v1/admin/drift`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.continual import post  # noqa: E402 - after the path


def random_listener(trained: Path, dest: Path) -> Path:
    """The trained listener's architecture with freshly initialised weights (a bad deploy)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1234)
    config = AutoConfig.from_pretrained(trained / "checkpoints" / "final" / "listener")
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    return dest


class Clients:
    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.t0 = time.time()
        self.changed_at: float | None = None  # the environment's change (t from t0)
        self.log: list[tuple[float, int, float, float]] = []  # t, listener v, success, reward
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k * 10**6,)) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        while not self.stop.is_set():
            seed += 1
            status, ep = post(f"{self.url}/episodes", {"seed": seed, "temperature": 1.0})
            if status != 200:
                continue
            t = time.time() - self.t0
            ok = float(ep["success"])
            reward = ok if self.changed_at is None or t < self.changed_at or seed % 2 == 0 \
                else 0.0
            self.log.append((t, ep["nodes"]["listen"]["version"], ok, reward))
            post(f"{self.url}/feedback", {"id": ep["id"], "reward": reward})

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=None)
    ap.add_argument("--phase", type=float, default=15.0)
    ap.add_argument("--window", type=int, default=200)
    ap.add_argument("--drop", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--bin", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8772)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="drift-"))
    if args.run_dir is None:
        base = tmp / "trained"
        print(f"training examples/referential_game.yaml -> {base} ...", flush=True)
        subprocess.run([sys.executable, "-m", "flexmarl", "train",
                        "examples/referential_game.yaml", "--out", str(base)], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    else:
        base = Path(args.run_dir)
    base = Path(shutil.copytree(base, tmp / "run", ignore=shutil.ignore_patterns("serving")))
    bad = random_listener(base, tmp / "bad-listener")
    db = tmp / "served.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmarl", "serve", str(base), "--port", str(args.port),
         "--device", "cpu", "--capture", str(db), "--deploy", "--heldout", "0",
         "--canary-min-feedback", "1000000", "--drift-window", str(args.window),
         "--drift-drop", str(args.drop)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    deadline = time.time() + 180
    while True:
        try:
            post(f"http://127.0.0.1:{args.port}/health")
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: {proc.stdout.read()}") from None
            time.sleep(0.3)
    clients = Clients(url, args.clients)
    marks: list[tuple[float, str]] = []
    try:
        time.sleep(args.phase)
        status, body = post(f"{url}/admin/reload", {"agent": "listener", "path": str(bad)})
        assert status == 200, body
        marks.append((time.time() - clients.t0,
                      f"bad deploy: listener v{body['agents']['listener']['version']}"))
        time.sleep(2 * args.phase)
        clients.changed_at = time.time() - clients.t0
        marks.append((clients.changed_at, "environment changes: odd-seeded inputs now score 0"))
        time.sleep(args.phase)
    finally:
        clients.close()
        _, drift = post(f"{url}/admin/drift")
        proc.terminate()
        proc.wait(60)
    t_start = clients.t0
    events = [json.loads(x) for x in (base / "serving" / "events.jsonl").read_text()
              .splitlines()]
    alerts = [e for e in events if e["event"] == "drift" and e["time"] >= t_start]

    print(f"\ndrift: referential game (trained), {args.clients} clients, episodes at "
          f"temperature 1; monitor window {args.window} rewards, drop {args.drop}")
    print("\n| window (s) | episodes | served success | clients' reward | listener versions "
          "(episodes) |")
    print("|---|---|---|---|---|")
    end = max((r[0] for r in clients.log), default=0.0)
    k = 0
    while k * args.bin <= end:
        rows = [r for r in clients.log if k * args.bin <= r[0] < (k + 1) * args.bin]
        if rows:
            vs = Counter(r[1] for r in rows)
            print(f"| {k * args.bin:.0f}-{(k + 1) * args.bin:.0f} | {len(rows)} | "
                  f"{sum(r[2] for r in rows) / len(rows):.3f} | "
                  f"{sum(r[3] for r in rows) / len(rows):.3f} | "
                  f"{', '.join(f'v{v} ({n})' for v, n in sorted(vs.items()))} |")
        k += 1
    print("\n| t (s) | what | key | rolling mean / peak (drop) | action |")
    print("|---|---|---|---|---|")
    rows_out = [(t, m, "-", "-", "-") for t, m in marks]
    for a in alerts:
        rb = ", ".join(f"{n} v{v['from']} -> v{v['to']}" for n, v in a["rolled_back"].items())
        rows_out.append((a["time"] - t_start, "drift alert", a["key"],
                         f"{a['mean']:.3f} / {a['peak']:.3f} ({a['drop']:.2f})",
                         f"rolled back {rb}" if rb else a["action"]))
    for t, m, key, val, act in sorted(rows_out):
        print(f"| {t:.1f} | {m} | {key} | {val} | {act} |")
    print(f"\nalerts: {drift.get('alerts')} (GET /v1/admin/drift); run folder: {base}")


if __name__ == "__main__":
    main()
