"""Continual learning behind `flexmarl serve`: a deliberately weak agent improves online.

    .venv/bin/python benchmarks/continual.py [RUN_DIR] [--weak listener] [--seconds 90]

RUN_DIR is a trained referential game (default: `flexmarl train examples/referential_game.yaml`
into a temporary folder, about a minute). The weak agent's weights are removed from a copy of
the run, so it is served from its initial (random) weights: success starts near chance (0.25).
The server runs in its own process with `--capture --learn WEAK` (shadow / training / canary,
default 5% canary share); clients run episodes of the graph (`POST /v1/episodes`, temperature
1) and send the episode's success as feedback (`POST /v1/feedback`). Prints:

1. the served success rate per time window and the versions that served it;
2. the version timeline from the events log (canaries, promotions, rollbacks, rejected
   candidates, online updates and KL stops);
3. a SIGKILL of the server under that load, a restart from the same folder and store, more
   load, and the audit: acknowledged episodes and feedback all stored, no row trained twice
   into the restored weights' lineage, the restarted server's shadow;
4. the recovery's phases: process start to serving again, restoring the training snapshot
   (from `--snapshot-url`, fsspec), handing back the rows claimed after it, the first episode
   answered and the first online update after the restart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def post(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None
                                 else None, method="POST" if body is not None else "GET",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def start(run: Path, db: Path, port: int, weak: str, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmarl", "serve", str(run), "--port", str(port), "--device",
         "cpu", "--capture", str(db), "--learn", weak, *extra], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while True:
        try:
            post(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: {proc.stdout.read()}") from None
            time.sleep(0.3)


class Load:
    """`n` clients running episodes and sending their success as feedback."""

    def __init__(self, url: str, weak_node: str, n: int, base_seed: int) -> None:
        self.url, self.node = url, weak_node
        self.t0 = time.time()
        self.log: list[tuple[float, int, float]] = []  # (t, weak node's version, success)
        self.acked_eps: list[str] = []
        self.acked_fb: list[str] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(base_seed + k * 10**6,))
                        for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        while not self.stop.is_set():
            seed += 1
            try:
                status, ep = post(f"{self.url}/episodes", {"seed": seed, "temperature": 1.0})
                if status != 200:
                    self.errors.append(f"{status}: {ep}")
                    continue
                self.acked_eps.append(ep["id"])
                ok = float(ep["success"])
                self.log.append((time.time() - self.t0, ep["nodes"][self.node]["version"], ok))
                status, _ = post(f"{self.url}/feedback", {"id": ep["id"], "reward": ok})
                if status == 200:
                    self.acked_fb.append(ep["id"])
            except OSError:
                if self.stop.is_set():
                    return
                time.sleep(0.05)  # the server is gone (SIGKILL): stop when told

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def weak_copy(run: Path, weak: str, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("serving", "trace.json"))
    shutil.rmtree(dest / "checkpoints" / "final" / weak, ignore_errors=True)
    for gen in (dest / "checkpoints").glob("gen-*"):
        shutil.rmtree(gen / "agents" / weak, ignore_errors=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=None)
    ap.add_argument("--weak", default="listener", choices=["listener", "speaker"])
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--after-restart", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--canary-share", default="0.05")
    ap.add_argument("--online-batch", default="32")
    ap.add_argument("--online-lr", default="0.0005")
    ap.add_argument("--canary-every", default="3")
    ap.add_argument("--snapshot-every", default="15")
    ap.add_argument("--online-algorithm", default="auto", choices=["auto", "grpo", "ppo"])
    ap.add_argument("--snapshot-url", default=None,
                    help="fsspec URL of the training snapshots (default: a file:// folder)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="continual-"))
    if args.run_dir is None:
        base = tmp / "trained"
        print(f"training examples/referential_game.yaml -> {base} ...", flush=True)
        subprocess.run([sys.executable, "-m", "flexmarl", "train",
                        "examples/referential_game.yaml", "--out", str(base)], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    else:
        base = Path(args.run_dir)
    run = weak_copy(base, args.weak, tmp / "weak")
    db = tmp / "served.sqlite"
    node = {"listener": "listen", "speaker": "speak"}[args.weak]
    extra = ["--canary-share", args.canary_share, "--online-batch", args.online_batch,
             "--online-lr", args.online_lr, "--canary-every", args.canary_every,
             "--online-algorithm", args.online_algorithm,
             "--heldout", "128", "--snapshot-every", args.snapshot_every, "--snapshot-url",
             args.snapshot_url or f"file://{tmp / 'snapshots'}"]
    url = f"http://127.0.0.1:{args.port}/v1"
    proc = start(run, db, args.port, args.weak, extra)
    t_start = time.time()
    load = Load(url, node, args.clients, 0)
    time.sleep(args.seconds)
    proc.send_signal(signal.SIGKILL)  # under load
    t_kill = time.time()
    proc.wait(30)
    load.close()
    first_life = list(load.log)
    proc = start(run, db, args.port, args.weak, extra)
    t_up = time.time()
    _, models = post(f"{url}/models")
    restarted = {m["id"]: (m["version"], m["source"]) for m in models["data"]}
    load2 = Load(url, node, args.clients, 10**9)
    time.sleep(args.after_restart)
    load2.close()
    proc.terminate()
    proc.wait(60)

    events = [json.loads(x) for x in (run / "serving" / "events.jsonl").read_text().splitlines()]
    print(f"\ncontinual learning: referential game, weak {args.weak} (initial weights), "
          f"{args.clients} clients, episodes at temperature 1 with feedback; canary share "
          f"{args.canary_share}, online batch {args.online_batch}, lr {args.online_lr}, "
          f"algorithm {args.online_algorithm}")
    print("\n| window (s) | episodes | served success | versions serving the "
          f"{args.weak} (episodes) |")
    print("|---|---|---|---|")
    w = args.window
    for k in range(int(-(-args.seconds // w))):
        rows = [r for r in first_life if k * w <= r[0] < (k + 1) * w]
        if not rows:
            continue
        vs = Counter(v for _, v, _ in rows)
        print(f"| {k * w:.0f}-{(k + 1) * w:.0f} | {len(rows)} | "
              f"{sum(r[2] for r in rows) / len(rows):.3f} | "
              f"{', '.join(f'v{v} ({n})' for v, n in sorted(vs.items()))} |")
    rows2 = load2.log
    if rows2:
        vs = Counter(v for _, v, _ in rows2)
        print(f"| after SIGKILL + restart, {args.after_restart:.0f} s | {len(rows2)} | "
              f"{sum(r[2] for r in rows2) / len(rows2):.3f} | "
              f"{', '.join(f'v{v} ({n})' for v, n in sorted(vs.items()))} |")

    print("\nversion timeline (events.jsonl; t from the first server start)")
    print("| t (s) | event | version | shadow | held-out canary / shadow | feedback canary / "
          "shadow (n) |")
    print("|---|---|---|---|---|---|")

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def fb(x: list | None) -> str:
        return "-" if not x else f"{x[0]:.3f} ({x[1]})"

    for e in events:
        if e["event"] not in ("canary_start", "promote", "rollback", "candidate_rejected",
                              "deployment_start", "training_resumed", "heartbeat_lost"):
            continue
        t = e["time"] - t_start
        if e["event"] == "deployment_start":
            print(f"| {t:.1f} | deployment_start | - | {e['shadows'].get(args.weak)} | - | - |")
            continue
        print(f"| {t:.1f} | {e['event']} | {e.get('version', '-')} | "
              f"{e.get('shadow_version', e.get('previous', '-'))} | "
              f"{f(e.get('canary_heldout', e.get('heldout')))} / "
              f"{f(e.get('shadow_heldout'))} | {fb(e.get('canary_feedback'))} / "
              f"{fb(e.get('shadow_feedback'))} |")
    kinds = Counter(e["event"] for e in events)
    steps = [e for e in events if e["event"] in ("train_step", "kl_stop")]
    lineage: list[tuple[int, str]] = []  # rows in the training weights as they stand
    for e in events:
        if e["event"] == "training_resumed":
            lineage = [(st, i) for st, i in lineage if st <= e["steps"]]
        elif e["event"] == "train_step":
            lineage += [(e["step"], i) for i in e["ids"]]
    trained = [i for e in steps for i in e["ids"]]
    off = [e["off_policy"] for e in steps]
    print(f"\nonline updates: {kinds['train_step']} applied, {kinds['kl_stop']} undone by the "
          f"KL bound; promotions {kinds['promote']}, rollbacks {kinds['rollback']}, rejected "
          f"candidates {kinds['candidate_rejected']}; off-policy rows {sum(off)} of "
          f"{len(trained)}; importance weight mean "
          f"{sum(e['is_weight_mean'] for e in steps) / max(len(steps), 1):.3f}, truncated "
          f"{sum(e['truncated'] for e in steps)}")

    con = sqlite3.connect(db)
    stored = {r[0] for r in con.execute("SELECT DISTINCT episode FROM interactions")}
    fed = {r[0] for r in con.execute("SELECT DISTINCT i.episode FROM feedback f JOIN "
                                     "interactions i ON i.id = f.response_id")}
    consumed = [r[0] for r in con.execute("SELECT response_id FROM consumed")]
    acked = set(load.acked_eps) | set(load2.acked_eps)
    acked_fb = set(load.acked_fb) | set(load2.acked_fb)
    print("\nSIGKILL under load, restarted from the same run folder and store")
    print("| check | value |")
    print("|---|---|")
    print(f"| acknowledged episodes / lost | {len(acked)} / {len(acked - stored)} |")
    print(f"| acknowledged feedback / lost | {len(acked_fb)} / {len(acked_fb - fed)} |")
    print(f"| rows in the trained lineage / distinct / consumed now | {len(lineage)} / "
          f"{len(set(i for _, i in lineage))} / {len(consumed)} |")
    print(f"| restarted server's {args.weak} | v{restarted[args.weak][0]} from "
          f"{restarted[args.weak][1]} |")
    print(f"| request errors (excluding the killed server's) | "
          f"{len(load.errors) + len(load2.errors)} |")
    resumed = [e for e in events if e["event"] == "training_resumed" and e["time"] >= t_kill]
    after = [e for e in events if e["event"] == "train_step" and e["time"] >= t_kill]
    first_ep = min((t for t, _, _ in load2.log), default=None)
    print(f"\nrecovery after SIGKILL (snapshots at {extra[-1]}; t from the SIGKILL)")
    print("| phase | time (s) | detail |")
    print("|---|---|---|")
    print(f"| process start, weights loaded, serving (/health answers) | {t_up - t_kill:.2f} | "
          "- |")
    if resumed:
        r = resumed[-1]
        print(f"| restore the training snapshot (parameters + optimizer) | {r['restore_s']:.3f} | "
              f"step {r['steps']}, policy version {r['policy_version']} |")
        print(f"| re-deliver rows claimed after the snapshot | {r['redeliver_s']:.3f} | "
              f"{r['redelivered']} rows handed back |")
    else:
        print("| restore the training snapshot | - | no snapshot and nothing to re-deliver |")
    if first_ep is not None:
        print(f"| rejoin: first episode answered after restart | "
              f"{load2.t0 + first_ep - t_kill:.2f} | - |")
    if after:
        print(f"| rejoin: first online update after restart | {after[0]['time'] - t_kill:.2f} | "
              f"step {after[0]['step']} |")
    print(f"\nrun folder: {run}")


if __name__ == "__main__":
    main()
