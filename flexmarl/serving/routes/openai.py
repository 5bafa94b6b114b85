"""The OpenAI-compatible endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(streamed as server-sent events or whole), each answer naming the agent version that made it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flexmarl.serving.agents import Version
from flexmarl.serving.protocol import (
    ApiError,
    Sampling,
    bad,
    chat_prompt,
    common,
    completion_prompt,
)
from flexmarl.serving.routes.common import body_of, service_of, tenant_of
from flexmarl.serving.service import Outcome, Piece, Service

router = APIRouter()


# --- response bodies -------------------------------------------------------------------------
def _meta(agent: str, version: Version) -> dict[str, Any]:
    return {"agent": agent, **version.describe()}


def _fingerprint(agent: str, version: Version) -> str:
    return f"{agent}-v{version.number}"


def _usage(s: Sampling, n: int) -> dict[str, int]:
    return {"prompt_tokens": len(s.prompt), "completion_tokens": n,
            "total_tokens": len(s.prompt) + n}


def _tok_str(s: Sampling, t: int) -> str:
    if s.token_ids_out or s.agent.tokenizer is None:
        return f"token_id:{t}"
    return s.agent.tokenizer.decode([t])


def _completion_logprobs(s: Sampling, tokens: list[int], logprobs: list[float],
                         offset: int, top: int) -> dict[str, Any]:
    strs = [_tok_str(s, t) for t in tokens]
    offsets, at = [], offset
    for t in strs:
        offsets.append(at)
        at += len(t)
    return {"tokens": strs, "token_logprobs": logprobs, "text_offset": offsets,
            "top_logprobs": [{t: lp} for t, lp in zip(strs, logprobs, strict=True)]
            if top > 0 else None}


def _chat_logprobs(s: Sampling, tokens: list[int], logprobs: list[float], top: int
                   ) -> dict[str, Any]:
    content = []
    for t, lp in zip(tokens, logprobs, strict=True):
        ts = _tok_str(s, t)
        entry = {"token": ts, "logprob": lp, "bytes": list(ts.encode())}
        content.append({**entry, "top_logprobs": [entry] if top > 0 else []})
    return {"content": content, "refusal": None}


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def _headers(agent: str, version: Version) -> dict[str, str]:
    return {"x-flexmarl-agent": agent, "x-flexmarl-version": str(version.number)}


def _first_version(first: Piece | Outcome, fallback: Version) -> Version:
    """The version decoding a stream (a canary or the shadow), known from its first event."""
    return first.version if first.version is not None else fallback


async def _first(gen: AsyncIterator[Piece | Outcome]) -> Piece | Outcome:
    """The first event (the request admitted and its first token out), so errors that happen
    before any output are real HTTP errors, and headers can carry the version."""
    return await gen.__anext__()


async def _outcome(first: Piece | Outcome, gen: AsyncIterator[Piece | Outcome]) -> Outcome:
    """A non-streamed answer: the generation's last event, its outcome."""
    out = first
    async for out in gen:  # noqa: B007
        pass
    assert isinstance(out, Outcome)
    return out


async def _stream(gen, first, make_chunk, finish_chunk, usage_chunk, s: Sampling
                  ) -> AsyncIterator[bytes]:
    try:
        event = first
        while True:
            if isinstance(event, Outcome):
                yield _sse(finish_chunk(event))
                if s.include_usage:
                    yield _sse(usage_chunk(event))
                yield _sse("[DONE]")
                return
            if event.text or event.tokens:
                yield _sse(make_chunk(event))
            try:
                event = await gen.__anext__()
            except ApiError as exc:
                yield _sse(exc.body())
                yield _sse("[DONE]")
                return
    finally:
        await gen.aclose()


def model_card(service: Service, name: str) -> dict:
    spec = service.run.agents[name]
    return {"id": name, "object": "model", "created": int(service.started),
            "owned_by": "flexmarl", "version": spec.version.number,
            "source": spec.version.source, "tokenizer": spec.tokenizer is not None,
            "chat": bool(spec.tokenizer is not None
                         and getattr(spec.tokenizer, "chat_template", None)),
            "max_model_len": spec.max_len, "vocab_size": spec.vocab}

@router.get("/v1/models")
async def models(request: Request) -> dict:
    service = service_of(request)
    return {"object": "list", "data": [model_card(service, n) for n in service.workers]}

@router.get("/v1/models/{name}")
async def model(name: str, request: Request) -> dict:
    service = service_of(request)
    if name not in service.workers:
        raise ApiError(404, f"model {name!r} is not served here", "model",
                       code="model_not_found")
    return model_card(service, name)

async def _addressed(request: Request) -> tuple[Any, dict, str, Any]:
    """(service, body, agent name, its spec) of an OpenAI-style request."""
    service = service_of(request)
    body = await body_of(request)
    name = service.agent(body)
    return service, body, name, service.run.agents[name]


async def _started(request: Request, s: Any, prefix: str, endpoint: str
                   ) -> tuple[str, int, Any, Any]:
    """Name the response, tag its tenant and start generating: (id, created, the generator,
    its first piece)."""
    cid, created = f"{prefix}-{s.request_id}", int(time.time())
    s.response_id, s.endpoint = cid, endpoint
    s.tenant = tenant_of(request)
    gen = service_of(request).generate(s)
    return cid, created, gen, await _first(gen)

@router.post("/v1/completions")
async def completions(request: Request):
    service, body, name, spec = await _addressed(request)
    prompt, as_ids = completion_prompt(body, spec)
    s = common(body, spec, prompt, service.limits)
    s.token_ids_out = as_ids and (spec.tokenizer is None or bool(
        body.get("return_tokens_as_token_ids")))
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= 20):
        raise bad("logprobs", "must be an integer in [0, 20]")
    s.logprobs = top is not None
    cid, created, gen, first = await _started(request, s, "cmpl", "completions")

    def choice(text: str, toks, lps, reason, offset=0) -> dict:
        c = {"index": 0, "text": text, "finish_reason": reason,
             "logprobs": _completion_logprobs(s, toks, lps, offset, top or 0)
             if s.logprobs else None}
        c["token_ids"] = toks
        return c

    if not s.stream:
        out = await _outcome(first, gen)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": name,
            "system_fingerprint": _fingerprint(name, out.version),
            "choices": [choice(out.text, out.tokens, out.logprobs, out.finish_reason)],
            "usage": _usage(s, len(out.tokens)), "flexmarl": _meta(name, out.version),
        }, headers=_headers(name, out.version))
    version = _first_version(first, service.workers[name].version)
    sent = {"chars": 0}

    def chunk(p: Piece) -> dict:
        c = choice(p.text, p.tokens, p.logprobs, None, sent["chars"])
        sent["chars"] += len(p.text)
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "system_fingerprint": _fingerprint(name, version), "choices": [c]}

    def finish(o: Outcome) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "system_fingerprint": _fingerprint(name, o.version),
                "choices": [choice("", [], [], o.finish_reason)],
                "flexmarl": _meta(name, o.version)}

    def usage(o: Outcome) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [], "usage": _usage(s, len(o.tokens))}

    return StreamingResponse(_stream(gen, first, chunk, finish, usage, s),
                             media_type="text/event-stream", headers=_headers(name, version))

@router.post("/v1/chat/completions")
async def chat(request: Request):
    service, body, name, spec = await _addressed(request)
    prompt = chat_prompt(body, spec)
    s = common(body, spec, prompt, service.limits)
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad("logprobs", "must be true or false")
    top = body.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise bad("top_logprobs", "must be an integer in [0, 20]")
    if top and not want:
        raise bad("top_logprobs", "needs logprobs: true")
    s.logprobs = bool(want)
    cid, created, gen, first = await _started(request, s, "chatcmpl", "chat.completions")
    if not s.stream:
        out = await _outcome(first, gen)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": name,
            "system_fingerprint": _fingerprint(name, out.version),
            "choices": [{"index": 0, "finish_reason": out.finish_reason,
                         "message": {"role": "assistant", "content": out.text},
                         "logprobs": _chat_logprobs(s, out.tokens, out.logprobs, top)
                         if s.logprobs else None}],
            "usage": _usage(s, len(out.tokens)), "flexmarl": _meta(name, out.version),
        }, headers=_headers(name, out.version))
    version = _first_version(first, service.workers[name].version)
    state = {"role": False}

    def base() -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": name, "system_fingerprint": _fingerprint(name, version)}

    def chunk(p: Piece) -> dict:
        delta: dict[str, Any] = {"content": p.text}
        if not state["role"]:
            delta["role"] = "assistant"
            state["role"] = True
        return {**base(), "choices": [{
            "index": 0, "delta": delta, "finish_reason": None,
            "logprobs": _chat_logprobs(s, p.tokens, p.logprobs, top) if s.logprobs
            else None}]}

    def finish(o: Outcome) -> dict:
        delta = {} if state["role"] else {"role": "assistant", "content": ""}
        return {**base(), "system_fingerprint": _fingerprint(name, o.version),
                "choices": [{"index": 0, "delta": delta, "finish_reason": o.finish_reason,
                             "logprobs": None}], "flexmarl": _meta(name, o.version)}

    def usage(o: Outcome) -> dict:
        return {**base(), "choices": [], "usage": _usage(s, len(o.tokens))}

    return StreamingResponse(_stream(gen, first, chunk, finish, usage, s),
                             media_type="text/event-stream", headers=_headers(name, version))

