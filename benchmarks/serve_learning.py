"""Serving latency with and without online learning: none, inside the server (`--learn`), in
its own process (`flexmarl serve-learn`), and as a Ray actor (`serve-learn --ray`).

    .venv/bin/python benchmarks/serve_learning.py [RUN_DIR] [--seconds 15] [--cycles 2]

Without RUN_DIR it builds the toy run (flexmarl/serving/toy.py). For each mode a fresh
`flexmarl serve --capture --deploy` starts (with `--learn listener` in the in-process mode,
plus a `serve-learn` process in the separate ones, timed from when it trains: for the Ray
actor, once its private local cluster and actor are up); 4 client threads run episodes and send
their success as feedback (what feeds learning), and a probe sends sequential one-token
completions to the listener and records each round trip. Modes run in turn, `--cycles`
times (A B C A B C), so the machine's load falls on all alike; prints p50/p99 of the probe
and the updates the learner made meanwhile. Every process gets 1 torch thread.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.continual import post  # noqa: E402 - after the path
from benchmarks.serve import quantile  # noqa: E402
from flexmarl.serving.toy import make_toy_run  # noqa: E402

MODES = ("no learning", "in the server (--learn)", "own process (serve-learn)",
         "Ray actor (serve-learn --ray)")
LEARN = ["--online-batch", "16", "--canary-every", "4", "--online-lr", "0.001"]


def run_mode(mode: str, base: Path, tmp: Path, port: int, seconds: float) -> tuple[list[float],
                                                                                  int]:
    run = Path(shutil.copytree(base, tmp / f"run-{time.monotonic_ns()}"))
    db = run / "served.sqlite"
    cmd = [sys.executable, "-m", "flexmarl", "serve", str(run), "--port", str(port), "--device",
           "cpu", "--capture", str(db), "--deploy", "--threads", "1", "--heldout", "16",
           "--canary-min-feedback", "8"]
    if mode == MODES[1]:
        cmd += ["--learn", "listener", *LEARN]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)]
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            post(f"{url}/health")
            break
        except OSError:
            if time.time() > deadline:
                raise SystemExit("server did not come up") from None
            time.sleep(0.3)
    if mode in MODES[2:]:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "flexmarl", "serve-learn", str(run), "--capture", str(db),
             "--agent", "listener", "--server", url, "--threads", "1", *LEARN,
             *(["--ray"] if mode == MODES[3] else [])], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(trainer)
        assert trainer.stdout is not None
        for line in trainer.stdout:  # timing starts once the trainer runs (Ray: its actor)
            if "online trainer of" in line:
                break
        else:
            raise SystemExit(f"serve-learn ended before training ({mode})")
        threading.Thread(target=trainer.stdout.read, daemon=True).start()  # keep it drained
    stop = threading.Event()

    def load(k: int) -> None:
        j = 0
        while not stop.is_set():
            j += 1
            status, ep = post(f"{url}/v1/episodes", {"seed": k * 10**6 + j, "temperature": 1.0})
            if status == 200:
                post(f"{url}/v1/feedback", {"id": ep["id"], "reward": float(ep["success"])})

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times = []
    t_end = time.time() + seconds
    k = 0
    try:
        while time.time() < t_end:
            k += 1
            body = json.dumps({"model": "listener", "prompt": [5, 9, 40], "max_tokens": 1,
                               "seed": k})
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        conn.close()
        for p in reversed(procs):
            # Ctrl-C: serve-learn --ray stops its actor and the Ray cluster it started
            p.send_signal(signal.SIGINT if p is not procs[0] else signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(60)
    updates = 0
    for name in ("events.jsonl", "trainer-listener.jsonl"):
        f = run / "serving" / name
        if f.is_file():
            updates += sum(json.loads(x)["event"] == "train_step"
                           for x in f.read_text().splitlines())
    return times, updates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=None)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--port", type=int, default=8774)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve-learning-"))
    base = Path(args.run_dir) if args.run_dir else make_toy_run(tmp / "toy")
    got: dict[str, tuple[list[float], int]] = {m: ([], 0) for m in MODES}
    for _ in range(args.cycles):
        for m in MODES:
            times, updates = run_mode(m, base, tmp, args.port, args.seconds)
            got[m] = (got[m][0] + times, got[m][1] + updates)
    print(f"\nserving latency under learning: one-token completions to the listener, sequential, "
          f"while 4 clients run episodes with feedback; {args.cycles} x {args.seconds:.0f} s "
          "per mode, modes in turn")
    print("\n| online learning | probe requests | p50 (ms) | p99 (ms) | online updates |")
    print("|---|---|---|---|---|")
    for m in MODES:
        v = [x * 1e3 for x in got[m][0]]
        print(f"| {m} | {len(v)} | {quantile(v, 0.5):.2f} | {quantile(v, 0.99):.2f} | "
              f"{got[m][1]} |")


if __name__ == "__main__":
    main()
