"""Agent-to-agent hand-off latency: 10 agents, 1,000 round trips, p50/p99, with and without a
one-token model call, through the in-process message bus (`flexmarl.graph.messages.py`)
and, next to it, through HTTP to `flexmarl serve` in another process.

    .venv/bin/python benchmarks/handoff.py [--round-trips 1000] [--agents 10] [--obs 256]
                                           [--ray]

First rows: the hand-off path of a running graph, `GraphExecutor(handoff="bus")` (what
`POST /v1/episodes` runs): a three-node graph per round trip (agent i's node hands its output
to agent i+1's node, whose output is handed back to a second node of agent i), timed from the
end of the first node's call to the start of the last one's: two bus messages, the executor's
own work, and the middle node's call (none, or one token from the model).

The toy run (flexmarl/serving/toy.py) supplies the model: the one-token call is the
referential game's token-level speaker through the serving engine (`Service.generate`, the
same continuous-batching engine the HTTP routes use). Each round trip: agent i sends agent
(i+1) mod N a message carrying an observation (`--obs` float32 values, sent as FP16) and a
few fields; the receiver (optionally) calls the model for one token, and replies. The modes
alternate in blocks of 100 so the machine's load falls on all alike. HTTP rows: the same
round trip as one request over a kept-alive loopback connection: `GET /health` (no model) and
`POST /v1/completions` with one token (the model call). Also prints the payload's bytes raw
(msgpack, float32), encoded (FP16, zstd when it pays), and the codec's time.

`--ray` adds a row on a private local Ray cluster: each agent an async actor, agent i's actor
sends agent i+1's the encoded message through an actor call and decodes its reply (no model
call), timed in agent i's actor. This is the transport between processes; inside a running
graph on the Ray runtime the episodes (and so their hand-offs) stay in the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve import quantile  # noqa: E402 - after the path
from flexmarl.graph.chat import PromptRenderer  # noqa: E402
from flexmarl.graph.executor import GraphExecutor, NodeCall  # noqa: E402
from flexmarl.graph.meg import MEG, EpisodeContext, NodePrompt  # noqa: E402
from flexmarl.graph.messages import MessageBus, decode, encode  # noqa: E402
from flexmarl.serving.agents import load_run  # noqa: E402
from flexmarl.serving.protocol import Sampling  # noqa: E402
from flexmarl.serving.service import Service  # noqa: E402
from flexmarl.serving.toy import make_toy_run  # noqa: E402

PROMPT = [1, 3, 2, 8]


async def one_token(service: Service, seed: int) -> int:
    spec = service.run.agents["speaker"]
    s = Sampling(agent=spec, prompt=list(PROMPT), max_tokens=1, temperature=1.0, top_p=1.0,
                 seed=seed, token_ids_out=True)
    out = None
    async for out in service.generate(s):  # noqa: B007 - the last item is the outcome
        pass
    assert out is not None
    return out.tokens[0]  # type: ignore[union-attr]


async def bus_block(service: Service, n_agents: int, trips: int, model: bool, obs: np.ndarray,
                    start: int) -> list[float]:
    names = [f"agent{i}" for i in range(n_agents)]
    bus = MessageBus(names)

    async def serve_agent(name: str) -> None:
        while True:
            env, msg = await bus.receive(name)
            token = await one_token(service, msg["step"]) if model else None
            bus.send(name, env.sender, {"step": msg["step"], "token": token}, reply_to=env.id)

    tasks = [asyncio.create_task(serve_agent(n)) for n in names]
    out = []
    try:
        for k in range(start, start + trips):
            i = k % n_agents
            msg = {"step": k, "from": names[i], "obs": obs, "note": "hand-off"}
            t0 = time.perf_counter()
            reply = await bus.request(names[i], names[(i + 1) % n_agents], msg)
            out.append(time.perf_counter() - t0)
            assert reply["step"] == k
    finally:
        for t in tasks:
            t.cancel()
    return out


def chain_graph(sender: str, receiver: str) -> MEG:
    """A round trip inside a running graph: `sender` hands its output to `receiver`, whose
    answer is handed back to `sender` (three nodes, two hand-offs)."""
    g = MEG()
    g.node("send", agent=sender, prompt=lambda ctx: NodePrompt(list(PROMPT), 1))
    g.node("answer", agent=receiver, inputs=["send"],
           prompt=lambda ctx: NodePrompt(list(PROMPT[:3]) + ctx.output("send"), 1))
    g.node("back", agent=sender, inputs=["answer"],
           prompt=lambda ctx: NodePrompt(ctx.output("answer"), 1))
    return g


async def graph_block(service: Service, n_agents: int, trips: int, model: bool, start: int
                      ) -> list[float]:
    """Round trips through the graph executor's bus hand-offs (`GraphExecutor(handoff="bus")`,
    what `POST /v1/episodes` runs): from the end of `send`'s call to the start of `back`'s,
    with `answer` calling the model for one token or not."""
    names = [f"agent{i}" for i in range(n_agents)]
    executors = [GraphExecutor(chain_graph(names[i], names[(i + 1) % n_agents]),
                               PromptRenderer({}, 16), names, handoff="bus")
                 for i in range(n_agents)]
    out = []
    for k in range(start, start + trips):
        marks: dict[str, float] = {}

        async def call(node: NodeCall, k: int = k, marks: dict[str, float] = marks
                       ) -> list[int]:
            if node.name == "back":
                marks["back"] = time.perf_counter()
            if node.name == "answer" and model:
                return [await one_token(service, k)]
            if node.name == "send":
                marks["send"] = time.perf_counter()
            return [k % 8 + 8]

        ctx = EpisodeContext(input_id=str(k), trajectory_id=0, data={})
        ran = await executors[k % n_agents].run(ctx, call)
        assert all(ran.values())
        out.append(marks["back"] - marks["send"])
    assert sum(e.messages for e in executors) == 2 * trips
    return out


class RayAgent:
    """One agent of the Ray rows: an async Ray actor whose messages cross processes as the
    bus's wire bytes (`encode` / `decode`) in Ray actor calls."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def pid(self) -> int:
        import os  # only for this diagnostic

        return os.getpid()

    async def handle(self, data: bytes) -> bytes:
        msg = decode(data)
        return encode({"step": msg["step"], "from": self.name})

    async def round_trips(self, peer: object, obs: np.ndarray, start: int, trips: int
                          ) -> list[float]:
        out = []
        for k in range(start, start + trips):
            t0 = time.perf_counter()
            data = encode({"step": k, "from": self.name, "obs": obs, "note": "hand-off"})
            reply = decode(await peer.handle.remote(data))  # type: ignore[attr-defined]
            out.append(time.perf_counter() - t0)
            assert reply["step"] == k
        return out


def ray_block(actors: list, obs: np.ndarray, trips: int, start: int) -> list[float]:
    """`trips` round trips, agent i's actor to agent i+1's and back, timed in agent i."""
    import ray

    n = len(actors)
    out: list[float] = []
    for k in range(start, start + trips):
        i = k % n
        out += ray.get(actors[i].round_trips.remote(actors[(i + 1) % n], obs, k, 1))
    return out


def http_block(conn: http.client.HTTPConnection, trips: int, model: bool, start: int
               ) -> list[float]:
    out = []
    for k in range(start, start + trips):
        t0 = time.perf_counter()
        if model:
            body = json.dumps({"model": "speaker", "prompt": PROMPT, "max_tokens": 1,
                               "seed": k, "temperature": 1.0})
            conn.request("POST", "/v1/completions", body,
                         {"content-type": "application/json"})
        else:
            conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=1000)
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--obs", type=int, default=256)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--port", type=int, default=8773)
    ap.add_argument("--ray", action="store_true",
                    help="add a row of round trips between agents as Ray actors (a private "
                         "local cluster)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    run = make_toy_run(Path(tempfile.mkdtemp(prefix="handoff-")))
    service = Service(load_run(run, "cpu"))
    # Ray first: its start must not leave the kept-alive HTTP connection idle too long
    session, actors = None, []
    if args.ray:
        import ray

        from flexmarl.runtime.ray.session import RaySession

        session = RaySession(None, num_cpus=max(2, args.agents))
        session.start()
        remote = ray.remote(num_cpus=0.1)(RayAgent)
        actors = [remote.remote(f"agent{i}") for i in range(args.agents)]  # type: ignore[attr-defined]
        ray.get([a.handle.remote(encode({"step": 0})) for a in actors])
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl", "serve", str(run), "--port",
                             str(args.port), "--device", "cpu", "--threads", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=60)
    deadline = time.time() + 180
    while True:
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
            break
        except OSError:
            conn.close()
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: {proc.stdout.read()}") from None
            time.sleep(0.3)
    obs = np.random.default_rng(0).standard_normal(args.obs).astype(np.float32)
    modes = ["graph", "graph+model", "bus", "bus+model", "http", "http+model"]
    if args.ray:
        modes.append("ray")
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for m in modes:  # warm-up: first calls build caches, connections, kernels
            if m == "ray":
                ray_block(actors, obs, 20, 0)
            elif m.startswith("graph"):
                asyncio.run(graph_block(service, args.agents, 20, m.endswith("model"), 0))
            elif m.startswith("bus"):
                asyncio.run(bus_block(service, args.agents, 20, m.endswith("model"), obs, 0))
            else:
                http_block(conn, 20, m.endswith("model"), 0)
        done = 0
        while done < args.round_trips:
            n = min(args.block, args.round_trips - done)
            for m in modes:
                if m == "ray":
                    times[m] += ray_block(actors, obs, n, 10**6 + done)
                elif m.startswith("graph"):
                    times[m] += asyncio.run(graph_block(service, args.agents, n,
                                                        m.endswith("model"), 10**6 + done))
                elif m.startswith("bus"):
                    times[m] += asyncio.run(bus_block(service, args.agents, n,
                                                      m.endswith("model"), obs, 10**6 + done))
                else:
                    times[m] += http_block(conn, n, m.endswith("model"), 10**6 + done)
            done += n
    finally:
        conn.close()
        proc.terminate()
        proc.wait(60)
        service.close()
        if session is not None:
            session.stop()

    msg = {"step": 1, "from": "agent0", "obs": obs, "note": "hand-off"}
    raw = msgpack.packb({**msg, "obs": obs.tolist()}, use_bin_type=True)
    t0 = time.perf_counter()
    for _ in range(1000):
        wire = encode(msg)
    enc_us = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(1000):
        decode(wire)
    dec_us = (time.perf_counter() - t0) * 1e3
    big = {**msg, "obs": np.zeros(64 * 1024, np.float32)}
    big_wire = encode(big)

    print(f"\nagent-to-agent round trips: {args.agents} agents, {args.round_trips} round trips "
          f"per row, payload: an observation of {args.obs} float32 values + 3 fields; "
          "one-token call: the toy speaker through the serving engine (CPU, 1 torch thread)")
    print("\n| path | model call | p50 (ms) | p99 (ms) | mean (ms) |")
    print("|---|---|---|---|---|")
    graph_label = "hand-offs inside a running graph (GraphExecutor, bus; token payload)"
    labels = {"graph": (graph_label, "no"), "graph+model": (graph_label, "one token"),
              "bus": ("in-process message bus (msgpack + FP16, zstd when it pays)", "no"),
              "bus+model": ("in-process message bus (msgpack + FP16, zstd when it pays)",
                            "one token"),
              "http": ("HTTP to `flexmarl serve`, kept-alive loopback (GET /health)", "no"),
              "http+model": ("HTTP to `flexmarl serve` (POST /v1/completions)", "one token"),
              "ray": ("Ray actors, one per agent (bus codec in actor calls, one node)", "no")}
    for m in modes:
        v = [x * 1e3 for x in times[m]]
        print(f"| {labels[m][0]} | {labels[m][1]} | {quantile(v, 0.5):.3f} | "
              f"{quantile(v, 0.99):.3f} | {statistics.mean(v):.3f} |")
    print(f"\npayload: {len(raw)} bytes as plain msgpack (the values as a list of floats), "
          f"{len(wire)} bytes encoded "
          f"(FP16 array{', zstd' if wire[0] else ''}); encode {enc_us:.1f} us, decode "
          f"{dec_us:.1f} us per message. A 64K-value zero observation: {len(big_wire)} bytes "
          f"encoded (zstd) from {64 * 1024 * 4} bytes of float32.")


if __name__ == "__main__":
    main()
