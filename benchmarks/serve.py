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

    .venv/bin/python benchmarks/serve.py --compression [TRAINED_RUN_DIR]

instead publishes weights to a running server in another process (issue 19 item 6): plain
safetensors (float32), FP16, zstd, FP16 + zstd (`flexmarl/serving/compress.py`): bytes, the
writer's time, the server's reload time (read, decompress, load) and the largest error, for a
21M-parameter Llama and, given a trained run, its trained listener.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
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


def compression(trained: Path | None, port: int) -> None:
    """Publish weights to a running `flexmarl serve` through files: with and without FP16/zstd."""
    from safetensors.torch import load_file, save_file

    from flexmarl.serving import compress
    from flexmarl.serving.toy import make_toy_run, save_llama

    tmp = Path(tempfile.mkdtemp(prefix="compress-"))
    run_dir = make_toy_run(tmp)
    big = tmp / "listener-model"
    save_llama(big, 320, seed=0, hidden=512, layers=8)  # the served listener: 21M parameters
    subjects = [("Llama 512x8 (random init)", load_file(str(big / "model.safetensors")), True)]
    if trained is not None:
        f = trained / "checkpoints" / "final" / "listener" / "model.safetensors"
        subjects.append((f"trained listener ({trained.name})", load_file(str(f)), False))
    url = f"http://127.0.0.1:{port}/v1"
    proc = start_server(run_dir, port, 8)
    variants = [("safetensors fp32 (none)", None), ("fp16", (True, None)),
                ("zstd-3", (False, 3)), ("fp16 + zstd-3", (True, 3))]
    rows = []
    try:
        for name, tensors, served in subjects:
            params = sum(v.numel() for v in tensors.values())
            for label, how in variants:
                # a changed copy each time, so every publish is new weights
                pub = {k: v + 1e-3 * (len(rows) + 1) if v.is_floating_point() else v
                       for k, v in tensors.items()}
                path = tmp / f"pub{len(rows)}" / ("model.safetensors" if how is None
                                                 else "model.fmw")
                path.parent.mkdir()
                t0 = time.perf_counter()
                if how is None:
                    save_file(pub, str(path))
                    size = path.stat().st_size
                else:
                    size = compress.write(path, pub, fp16=how[0], zstd_level=how[1])
                write_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                blob = path.read_bytes()
                back = load_file(str(path)) if how is None else compress.unpack(blob)
                read_s = time.perf_counter() - t0
                err = max(float((back[k].float() - pub[k].float()).abs().max()) for k in pub)
                reload_s = float("nan")
                if served:
                    import urllib.request

                    req = urllib.request.Request(
                        f"{url}/admin/reload", method="POST",
                        data=json.dumps({"agent": "listener", "path": str(path)}).encode(),
                        headers={"content-type": "application/json"})
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(req, timeout=600) as resp:
                        assert json.loads(resp.read())["agents"]["listener"]["reloaded"]
                    reload_s = time.perf_counter() - t0
                rows.append((name, params, label, size, write_s, read_s, reload_s, err))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nweight publication across processes (writer: this process; reader: the server, "
          "POST /v1/admin/reload with the file)")
    print("| weights | variant | bytes | vs fp32 | write ms | read+decode ms (here) | "
          "server reload ms | max abs error |")
    print("|---|---|---|---|---|---|---|---|")
    base: dict[str, int] = {}
    for name, params, label, size, w, r, rl, err in rows:
        base.setdefault(name, size)
        print(f"| {name}, {params / 1e6:.2f}M params | {label} | {size:,} | "
              f"{size / base[name]:.1%} | {w * 1000:.0f} | {r * 1000:.0f} | "
              f"{'-' if rl != rl else f'{rl * 1000:.0f}'} | {err:.2e} |")


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
    ap.add_argument("--compression", action="store_true",
                    help="only the weight-publication figures (RUN_DIR: a trained run)")
    args = ap.parse_args()
    if args.compression:
        compression(Path(args.run_dir) if args.run_dir else None, args.port)
        return

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
