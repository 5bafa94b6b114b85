"""`flexmarl serve-model PATH --port N`: a checkpoint behind an OpenAI-compatible endpoint.

`POST /v1/completions` takes token-id prompts and returns per-token log-probs (tokens as
`token_id:N`), with the vLLM extensions `allowed_token_ids` and `stop_token_ids`; `GET
/v1/models` and `GET /health` answer too. Concurrent requests share one continuous batch (the
same engine the rollout replicas run), so a frozen judge served this way batches like a replica.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from flexmarl.policy.sampling import GenerationRequest, GenerationResult
from flexmarl.rollout.engine import HFEngine


class BadRequest(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class BatchingServer:
    """Feeds requests from HTTP threads into one engine thread's continuous batch."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.inbox: queue.Queue[tuple[GenerationRequest, Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future:
        fut: Future = Future()
        self.inbox.put((request, fut))
        return fut

    def _loop(self) -> None:
        waiting: list[tuple[GenerationRequest, Future]] = []
        running: dict[str, Future] = {}
        engine = self.engine
        while True:
            if not waiting and not engine.active:
                waiting.append(self.inbox.get())
            while True:
                try:
                    waiting.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            take: list[GenerationRequest] = []
            while waiting and engine.fits(waiting[0][0], take):
                req, fut = waiting.pop(0)
                take.append(req)
                running[req.sample_id] = fut
            try:
                done = engine.admit(take) + engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                for fut in running.values():
                    fut.set_exception(exc)
                running.clear()
                engine.reset()
                continue
            for result in done:
                running.pop(result.sample_id).set_result(result)


def parse_request(body: Any, vocab: int, max_len: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise BadRequest("(body)", "must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        raise BadRequest("prompt", "this server takes token ids (a list of ints), not text")
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(t, int) and 0 <= t < vocab for t in prompt):
        raise BadRequest("prompt", f"must be a non-empty list of token ids in [0, {vocab})")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise BadRequest("max_tokens", "must be a non-negative integer")
    if len(prompt) + max_tokens > max_len:
        raise BadRequest("max_tokens", f"prompt + max_tokens exceeds the model's {max_len} "
                                       "positions")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise BadRequest("temperature", "must be > 0 (greedy decoding is not served)")
    if body.get("n", 1) != 1:
        raise BadRequest("n", "only n=1 is served")
    allowed = body.get("allowed_token_ids")
    if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(
            isinstance(t, int) and 0 <= t < vocab for t in allowed)):
        raise BadRequest("allowed_token_ids", f"must be a non-empty list of ids in [0, {vocab})")
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) for t in stops):
        raise BadRequest("stop_token_ids", "must be a list of ints")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise BadRequest("seed", "must be an integer")
    return GenerationRequest(
        sample_id=uuid.uuid4().hex, agent="served", version=0, prompt=prompt,
        max_new_tokens=max_tokens, allowed_tokens=allowed, stop_tokens=stops,
        temperature=float(temperature),
        noise_seed=seed if seed is not None else uuid.uuid4().int & ((1 << 63) - 1),
    )


def completion_response(model: str, result: GenerationResult, req: GenerationRequest) -> dict:
    stopped = bool(result.tokens) and result.tokens[-1] in req.stop_tokens
    return {
        "id": f"cmpl-{req.sample_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "text": " ".join(str(t) for t in result.tokens),
            "finish_reason": "stop" if stopped else "length",
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in result.tokens],
                "token_logprobs": result.logprobs,
            },
        }],
        "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(result.tokens),
                  "total_tokens": len(req.prompt) + len(result.tokens)},
    }


def make_server(path: str, host: str, port: int, max_batch_seqs: int = 32,
                max_batch_tokens: int = 65536) -> ThreadingHTTPServer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    name = Path(path).name
    vocab = model.config.vocab_size
    max_len = model.config.max_position_embeddings
    batcher = BatchingServer(HFEngine(model, max_batch_seqs, max_batch_tokens))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default
            pass

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, param: str | None = None) -> None:
            self._send(code, {"error": {"message": message, "type": "invalid_request_error",
                                        "param": param}})

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                self._error(404, f"no route {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"null")
                req = parse_request(body, vocab, max_len)
            except BadRequest as exc:
                self._error(400, str(exc), exc.param)
                return
            except ValueError as exc:
                self._error(400, f"body is not JSON: {exc}")
                return
            try:
                result = batcher.submit(req).result()
            except Exception as exc:  # noqa: BLE001
                self._error(500, f"generation failed: {exc}")
                return
            self._send(200, completion_response(name, result, req))

    return ThreadingHTTPServer((host, port), Handler)


def serve(path: str, host: str, port: int, max_batch_seqs: int = 32) -> None:
    server = make_server(path, host, port, max_batch_seqs)
    print(f"serving {path} on http://{host}:{server.server_address[1]}/v1/completions",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
