"""The `openai` backend: an agent served by any OpenAI-compatible `/v1/completions` endpoint.

For frozen agents and judges (weights cannot be published to an endpoint). Prompts travel as
token ids and tokens come back as `token_id:N` strings (vLLM's `return_tokens_as_token_ids`),
so no tokenizer has to agree between the two sides; the sampling seed is the request's noise
seed, so an endpoint running FlexMARL's `serve-model` samples exactly what a local replica
would. Connection failures, timeouts, HTTP 429 and 5xx are retried with exponential back-off;
anything else, and a malformed answer, is an `EndpointError` naming the agent and the field.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flexmarl.config.schema import BackendConfig
from flexmarl.policy.sampling import noise_seed_of
from flexmarl.types import GenerationRequest, GenerationResult

RETRY_STATUS = {429, 500, 502, 503, 504}


class EndpointError(RuntimeError):
    """The endpoint is down, too slow, refused the request or answered something malformed."""


def completion_body(request: GenerationRequest, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "logprobs": 1,
        "seed": noise_seed_of(request),
        "return_tokens_as_token_ids": True,
    }
    if request.stop_tokens:
        body["stop_token_ids"] = list(request.stop_tokens)
    if request.stop:  # the endpoint matches them (a frozen agent: its tokens are not trained)
        body["stop"] = list(request.stop)
    if request.top_p < 1:
        body["top_p"] = request.top_p
    if request.allowed_tokens is not None:
        body["allowed_token_ids"] = list(request.allowed_tokens)
    return body


def parse_completion(payload: Any, where: str) -> tuple[list[int], list[float]]:
    """Tokens and log-probs of choice 0, or an EndpointError naming the missing field."""
    def bad(field: str, why: str) -> EndpointError:
        return EndpointError(f"{where}: malformed response: {field} {why}")

    if not isinstance(payload, dict):
        raise bad("(body)", f"is {type(payload).__name__}, not an object")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad("choices", "is missing or empty")
    logprobs = choices[0].get("logprobs") if isinstance(choices[0], dict) else None
    if not isinstance(logprobs, dict):
        raise bad("choices[0].logprobs", "is missing (the endpoint must return log-probs)")
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise bad("choices[0].logprobs.tokens/token_logprobs", "are missing")
    if len(tokens) != len(values):
        raise bad("choices[0].logprobs", f"has {len(tokens)} tokens but {len(values)} log-probs")
    ids = []
    for i, tok in enumerate(tokens):
        if isinstance(tok, int):
            ids.append(tok)
        elif isinstance(tok, str) and tok.startswith("token_id:") and tok[9:].lstrip("-").isdigit():
            ids.append(int(tok[9:]))
        else:
            raise bad(f"choices[0].logprobs.tokens[{i}]", f"is {tok!r}, not 'token_id:N' "
                      "(serve with return_tokens_as_token_ids)")
    try:
        lps = [float(v) for v in values]
    except (TypeError, ValueError):
        raise bad("choices[0].logprobs.token_logprobs", "holds non-numbers") from None
    return ids, lps


class OpenAIBackend:
    """One agent's client; requests run concurrently (up to `max_concurrency`) in threads."""

    def __init__(self, agent: str, cfg: BackendConfig) -> None:
        if not cfg.url:
            raise ValueError(f"agents.{agent}.backend.url is required")
        self.agent = agent
        self.cfg = cfg
        self.url = cfg.url.rstrip("/") + "/v1/completions"
        self.model = cfg.model or agent
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix=f"openai-{agent}")
        self.attempts = 0  # total HTTP attempts, retries included (for tests and metrics)

    def _post(self, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        where = f"agent {self.agent!r}: endpoint {self.url}"
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            self.attempts += 1
            req = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                if exc.code in RETRY_STATUS:
                    last = f"HTTP {exc.code}: {detail}"
                    continue
                raise EndpointError(f"{where} refused the request: HTTP {exc.code}: {detail}") \
                    from None
            except TimeoutError:
                last = f"no answer within timeout_s={self.cfg.timeout_s}"
                continue
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"cannot connect ({reason})"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise EndpointError(f"{where}: malformed response: body is not JSON: "
                                    f"{raw[:120]!r}") from None
        raise EndpointError(f"{where} is unavailable after {self.cfg.max_retries + 1} attempts: "
                            f"{last}")

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        started = time.time()
        payload = await loop.run_in_executor(
            self._pool, self._post, completion_body(request, self.model))
        tokens, logprobs = parse_completion(payload, f"agent {self.agent!r}: endpoint {self.url}")
        if len(tokens) > request.max_new_tokens:
            raise EndpointError(f"agent {self.agent!r}: endpoint {self.url} returned "
                                f"{len(tokens)} tokens, more than max_tokens="
                                f"{request.max_new_tokens}")
        return GenerationResult(request.sample_id, tokens, logprobs, request.version,
                                admitted_at=started, finished_at=time.time())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
