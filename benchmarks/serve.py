"""Load test of `flexmarl serve` on loopback with the real `openai` client.

    .venv/bin/python benchmarks/serve.py [RUN_DIR] [--requests 2000] [--concurrency 64]

Without RUN_DIR it builds the toy run (flexmarl/serving/toy.py: a tiny random Llama with a
byte-level BPE tokenizer, and the referential game's token-level speaker). The server runs in
its own process (`flexmarl serve`), the client in this one. Prints:

1. streamed chat completions, `--concurrency` at a time: throughput (requests/s, generated
   tokens/s), latency p50/p99, time to first token p50/p99, errors;
2. message round trips (issue 19's message-latency table: 1,000 sequential requests with a
   minimal response, one token from the token-level agent): p50/p99 round trip, and the
   latency per generated token of a longer answer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def start_server(run_dir: Path, port: int, max_batch_seqs: int) -> subprocess.Popen:
    import openai

    proc = subprocess.Popen([sys.executable, "-m", "flexmarl", "serve", str(run_dir), "--port",
                             str(port), "--max-batch-seqs", str(max_batch_seqs),
                             "--max-pending", "100000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    deadline = time.time() + 300
    while True:
        try:
            client.models.list()
            return proc
        except openai.APIConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: {proc.stdout.read()}") from None
            time.sleep(0.3)


async def load_test(url: str, agent: str, n: int, concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    latencies, ttfts, tokens, errors = [], [], [], []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model=agent, messages=[{"role": "user", "content": f"Hello number {i}!"}],
                    max_tokens=max_tokens, seed=i, stream=True,
                    stream_options={"include_usage": True})
                used = 0
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(repr(exc))
                return
            end = time.perf_counter()
            latencies.append(end - t0)
            ttfts.append((first or end) - t0)
            tokens.append(used)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall": wall, "lat": latencies, "ttft": ttfts, "tokens": tokens, "errors": errors}


def round_trips(url: str, agent: str, n: int) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        client.completions.create(model=agent, prompt=[1, 3, 2, 6], max_tokens=1, seed=i)
        out.append(time.perf_counter() - t0)
    return out


def per_token(url: str, agent: str, n: int, max_tokens: int) -> float:
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    per = []
    for i in range(n):
        t0 = time.perf_counter()
        out = client.completions.create(model=agent, prompt="One two", max_tokens=max_tokens,
                                        seed=i)
        per.append((time.perf_counter() - t0) / max(out.usage.completion_tokens, 1))
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default=None)
    ap.add_argument("--agent", default="listener", help="the chat agent to load-test")
    ap.add_argument("--token-agent", default="speaker", help="the agent of the round trips")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--round-trips", type=int, default=1000)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    if args.run_dir is None:
        from flexmarl.serving.toy import make_toy_run

        run_dir = make_toy_run(tmp.name)
    else:
        run_dir = Path(args.run_dir)
    url = f"http://127.0.0.1:{args.port}/v1"
    proc = start_server(run_dir, args.port, max(args.concurrency, 1))
    try:
        asyncio.run(load_test(url, args.agent, min(args.concurrency, 16), args.concurrency,
                              args.max_tokens))  # warm-up
        res = asyncio.run(load_test(url, args.agent, args.requests, args.concurrency,
                                    args.max_tokens))
        rts = round_trips(url, args.token_agent, args.round_trips)
        tok_s = per_token(url, args.agent, 20, 32)
    finally:
        proc.terminate()
        proc.wait(30)
        tmp.cleanup()
    ok = len(res["lat"])
    gen = sum(res["tokens"])
    ms = 1000.0
    print(f"\nflexmarl serve on loopback ({run_dir}): {args.requests} streamed chat requests "
          f"to {args.agent!r}, {args.concurrency} concurrent, max_tokens {args.max_tokens}")
    print("| metric | value | target |")
    print("|---|---|---|")
    print(f"| requests ok / errors | {ok} / {len(res['errors'])} | 0 errors |")
    print(f"| throughput | {ok / res['wall']:.1f} req/s, {gen / res['wall']:.0f} tokens/s | - |")
    print(f"| latency p50 / p99 | {quantile(res['lat'], .5) * ms:.1f} / "
          f"{quantile(res['lat'], .99) * ms:.1f} ms | - |")
    print(f"| time to first token p50 / p99 | {quantile(res['ttft'], .5) * ms:.1f} / "
          f"{quantile(res['ttft'], .99) * ms:.1f} ms | - |")
    print(f"| message round trip p50 / p99 ({args.round_trips} sequential, 1 token from "
          f"{args.token_agent!r}) | {quantile(rts, .5) * ms:.2f} / {quantile(rts, .99) * ms:.2f} "
          f"ms | p50 < 1 ms (peers 8.7-23.4 ms) |")
    print(f"| latency per generated token (32-token answers, alone) | {tok_s * ms:.2f} ms | - |")
    if res["errors"]:
        print("first errors:", res["errors"][:3])


if __name__ == "__main__":
    main()
