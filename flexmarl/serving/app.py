"""The HTTP side: a FastAPI application over one `AgentWorker` per agent, served by uvicorn.

Routes (all under the API key when one is set, except /health):
  GET  /health                      liveness, versions
  GET  /v1/models, /v1/models/{id}  the served agents
  POST /v1/chat/completions         messages through the agent's chat template
  POST /v1/completions              text or token ids
  POST /v1/episodes                 one episode of the run's graph with the served agents
  POST /v1/feedback                 a reward for a captured response (with --capture)
  POST /v1/admin/reload             load new weights for one or all agents, without a restart
  GET  /v1/admin/versions           each agent's served version and the versions still running
  GET  /v1/admin/deployment         shadow / canary / training per agent, heartbeats, events
  POST /v1/admin/canary             deploy weights (or the training policy) as an agent's canary
  POST /v1/admin/canary/decide      score the canary now: promote or roll back
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flexmarl.serving.agents import (
    ServedRun,
    ServeError,
    Version,
    explicit_source,
    resolve_source,
)
from flexmarl.serving.capture import Capture, FeedbackError
from flexmarl.serving.deploy import DeployConfig, Deployment
from flexmarl.serving.protocol import (
    ApiError,
    Limits,
    Sampling,
    TextStream,
    bad,
    chat_prompt,
    common,
    completion_prompt,
    token_text,
)
from flexmarl.serving.worker import AgentWorker, Job, ServeRequest

GREEDY_TEMPERATURE = 1e-4  # temperature 0 is served as (numerically) greedy decoding


@dataclass
class Piece:
    text: str
    tokens: list[int]
    logprobs: list[float]
    version: Version | None = None


@dataclass
class Outcome:
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    version: Version


class Service:
    """The served run: agents, their workers, limits, and reload."""

    def __init__(self, run: ServedRun, limits: Limits | None = None,
                 api_key: str | None = None, max_batch_seqs: int | None = None,
                 capture: Capture | None = None, deploy: DeployConfig | None = None) -> None:
        from flexmarl.policy.device import kv_token_budget

        self.run = run
        self.limits = limits or Limits()
        self.api_key = api_key
        self.capture = capture
        self.workers: dict[str, AgentWorker] = {}
        rcfg = run.cfg.rollout
        for name, spec in run.agents.items():
            budget = kv_token_budget(rcfg.max_batch_tokens, spec.model,
                                     rcfg.kv_memory_fraction / max(len(run.agents), 1))
            self.workers[name] = AgentWorker(name, spec.model, spec.version,
                                             max_batch_seqs or rcfg.max_batch_seqs, budget)
        self.started = time.time()
        self._reload_lock = asyncio.Lock()
        self.deployment = Deployment(self, deploy) if deploy is not None else None

    def close(self) -> None:
        if self.deployment is not None:
            self.deployment.close()
        for w in self.workers.values():
            w.stop()
        if self.capture is not None:
            self.capture.close()

    @property
    def pending(self) -> int:
        return sum(w.pending for w in self.workers.values())

    def agent(self, body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", f"required: the agent to ask (one of {', '.join(self.workers)})")
        if model not in self.workers:
            raise ApiError(404, f"model {model!r} is not served here (agents: "
                                f"{', '.join(self.workers)})", "model", code="model_not_found")
        return model

    # --- generation ----------------------------------------------------------------------------
    async def _raw(self, s: Sampling, deltas: bool) -> AsyncGenerator[tuple, None]:
        if self.pending >= self.limits.max_pending:
            raise ApiError(429, f"server busy: {self.pending} requests in flight (limit "
                                f"{self.limits.max_pending}, --max-pending); retry later",
                           kind="rate_limit_error", code="busy")
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple] = asyncio.Queue()
        spec = s.agent
        stops = list(s.stop_token_ids)
        if spec.tokenizer is not None and not s.token_ids_out:
            eos = spec.tokenizer.eos_token_id
            if isinstance(eos, int) and eos not in stops:
                stops.append(eos)
        request = ServeRequest(
            sample_id=s.request_id, agent=spec.name, version=0, prompt=s.prompt,
            max_new_tokens=s.max_tokens, allowed_tokens=s.allowed_token_ids, stop_tokens=stops,
            temperature=max(s.temperature, GREEDY_TEMPERATURE),
            noise_seed=(s.seed & ((1 << 63) - 1)) if s.seed is not None
            else uuid.uuid4().int & ((1 << 63) - 1),
            top_p=s.top_p)
        worker = self.workers[spec.name]
        if not worker.alive and not worker._stopped:
            worker = self.failover(spec.name)
        worker.submit(Job(request, lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
                          deltas=deltas))
        finished = False
        try:
            while True:
                item = await inbox.get()
                # a busy server coalesces the steps queued meanwhile: one chunk, not many
                while item[0] == "tokens" and not inbox.empty():
                    nxt = inbox.get_nowait()
                    if nxt[0] != "tokens":
                        yield item
                        item = nxt
                        break
                    item = ("tokens", item[1] + nxt[1], item[2] + nxt[2], nxt[3])
                if item[0] != "tokens":
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away, or a stop string ended it
                worker.cancel(request.sample_id)

    async def generate(self, s: Sampling) -> AsyncIterator[Piece | Outcome]:
        """Pieces of new text as they are decoded (streams and stop strings), then the Outcome."""
        deltas = s.stream or bool(s.stop)
        spec = s.agent
        text = TextStream(spec.tokenizer, s.stop) if not s.token_ids_out else None
        tokens: list[int] = []
        logprobs: list[float] = []
        stopped = False
        gen = self._raw(s, deltas)
        try:
            async for item in gen:
                if item[0] == "error":
                    raise ApiError(500, item[1], kind="server_error")
                if item[0] == "tokens":
                    if stopped:
                        continue
                    _, toks, lps, _version = item
                    tokens += toks
                    logprobs += lps
                    if text is not None:
                        piece = text.push(toks)
                        if text.stopped:
                            stopped = True
                            await gen.aclose()  # cancels the rest of the decoding
                    else:
                        piece = (" " if len(tokens) > len(toks) else "") + token_text(toks)
                    yield Piece(piece, toks, lps, _version)
                    if stopped:
                        break
                    continue
                _, result, version = item
                if not deltas:
                    tokens, logprobs = list(result.tokens), list(result.logprobs)
                break
        finally:
            await gen.aclose()
        if stopped:
            reason = "stop"
            version = self.workers[spec.name].version if _version is None else _version
        else:
            reason = ("stop" if tokens and tokens[-1] in (s.stop_token_ids + (
                [spec.tokenizer.eos_token_id] if spec.tokenizer is not None
                and not s.token_ids_out else [])) else "length")
        if text is not None:
            if deltas:
                rest = text.flush()
                if rest:
                    yield Piece(rest, [], [])
                full = text.text
            else:
                assert spec.tokenizer is not None  # a text stream implies a tokenizer
                full = spec.tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            full = token_text(tokens)
        if self.capture is not None and s.response_id is not None:
            # durable before the response (or a stream's last chunk) is sent
            await asyncio.to_thread(self.capture.record, s.response_id, spec.name,
                                    version.describe(), s.endpoint, s.prompt, tokens, logprobs,
                                    full, reason, max(s.temperature, GREEDY_TEMPERATURE),
                                    s.top_p, s.allowed_token_ids, s.episode)
        yield Outcome(full, tokens, logprobs, reason, version)

    def failover(self, name: str) -> AgentWorker:
        """Replace an agent's dead engine thread with a fresh one over the same versions (the
        shadow, and the canary with its share); the dead one's jobs were already answered with
        an error. Logged in the deployment's events."""
        old = self.workers[name]
        if old.alive:
            return old
        spec = self.run.agents[name]
        new = AgentWorker(name, spec.model, spec.version, old.max_seqs, old.max_tokens)
        dep = self.deployment.agents.get(name) if self.deployment is not None else None
        if dep is not None and dep.canary is not None:
            new.set_canary(dep.canary.model, dep.canary.version, old.canary_share)
        new.admitted = dict(old.admitted)
        self.workers[name] = new
        if dep is not None and self.deployment is not None:
            dep.worker = new
            self.deployment.events.log("failover", name, component="engine", error=old.error,
                                       version=spec.version.number)
        else:
            print(f"failover: agent {name!r}: engine thread lost ({old.error}); replaced",
                  flush=True)
        return new

    # --- reload ----------------------------------------------------------------------------------
    async def reload(self, agent: str | None = None, path: str | None = None,
                     force: bool = False) -> dict[str, Any]:
        names = [agent] if agent else list(self.workers)
        if path and not agent:
            raise bad("path", "name the agent the weights are for (agent)")
        out: dict[str, Any] = {}
        async with self._reload_lock:
            for name in names:
                spec = self.run.agents[name]
                source = (explicit_source(path) if path
                          else resolve_source(self.run.run_dir, name, spec.cfg))
                if not force and not path and source.fingerprint == spec.fingerprint:
                    out[name] = {"reloaded": False, **spec.version.describe()}
                    continue
                if source.file is None and not force:
                    out[name] = {"reloaded": False, **spec.version.describe()}
                    continue
                model = await asyncio.to_thread(spec.next_model, source)
                version = Version(spec.next_number(), source.label, source.policy_version,
                                  time.time())
                spec.model, spec.version, spec.fingerprint = model, version, source.fingerprint
                self.workers[name].swap(model, version)
                out[name] = {"reloaded": True, **version.describe()}
        return out

    async def watch(self, every_s: float) -> None:
        """Reload any agent whose newest weights in the run folder changed (polling)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reload()
            except Exception as exc:  # noqa: BLE001 - a half-written file: try again next time
                print(f"reload skipped: {type(exc).__name__}: {exc}", flush=True)


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


# --- the application ---------------------------------------------------------------------------
def create_app(service: Service, watch_s: float | None = None) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        tasks = [asyncio.create_task(service.watch(watch_s))] if watch_s else []
        if service.deployment is not None:
            tasks.append(asyncio.create_task(service.deployment.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    app = FastAPI(title="flexmarl serve", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ServeError)
    async def _serve_error(_request: Request, exc: ServeError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if service.api_key and path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), service.api_key.encode()):
                return JSONResponse(ApiError(401, "missing or wrong API key (send "
                                                  "Authorization: Bearer <key>)",
                                             kind="authentication_error",
                                             code="invalid_api_key").body(), status_code=401)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > service.limits.max_body_bytes:
            return JSONResponse(_too_large(service).body(), status_code=413)
        return await call_next(request)

    async def body_of(request: Request) -> dict:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > service.limits.max_body_bytes:
                raise _too_large(service)
        try:
            body = json.loads(data or b"null")
        except ValueError as exc:
            raise ApiError(400, f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise bad("(body)", "must be a JSON object")
        return body

    @app.get("/health")
    async def health() -> dict:
        out: dict[str, Any] = {
            "status": "ok", "pending": service.pending,
            "agents": {n: s.version.number for n, s in service.run.agents.items()}}
        if service.deployment is not None:
            beats = service.deployment.heartbeats()
            out["heartbeats"] = beats
            if not all(b["ok"] for b in beats.values()):
                out["status"] = "degraded"
        return out

    def model_card(name: str) -> dict:
        spec = service.run.agents[name]
        return {"id": name, "object": "model", "created": int(service.started),
                "owned_by": "flexmarl", "version": spec.version.number,
                "source": spec.version.source, "tokenizer": spec.tokenizer is not None,
                "chat": bool(spec.tokenizer is not None
                             and getattr(spec.tokenizer, "chat_template", None)),
                "max_model_len": spec.max_len, "vocab_size": spec.vocab}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in service.workers]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name not in service.workers:
            raise ApiError(404, f"model {name!r} is not served here", "model",
                           code="model_not_found")
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        name = service.agent(body)
        spec = service.run.agents[name]
        prompt, as_ids = completion_prompt(body, spec)
        s = common(body, spec, prompt, service.limits)
        s.token_ids_out = as_ids and (spec.tokenizer is None or bool(
            body.get("return_tokens_as_token_ids")))
        top = body.get("logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        s.logprobs = top is not None
        cid, created = f"cmpl-{s.request_id}", int(time.time())
        s.response_id, s.endpoint = cid, "completions"
        gen = service.generate(s)
        first = await _first(gen)

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

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        name = service.agent(body)
        spec = service.run.agents[name]
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
        cid, created = f"chatcmpl-{s.request_id}", int(time.time())
        s.response_id, s.endpoint = cid, "chat.completions"
        gen = service.generate(s)
        first = await _first(gen)
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

    @app.post("/v1/episodes")
    async def episodes(request: Request) -> JSONResponse:
        from flexmarl.serving.episodes import run_episode

        body = await body_of(request)
        return JSONResponse(await run_episode(service, body))

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict:
        body = await body_of(request)
        if service.capture is None:
            raise ApiError(400, "feedback needs captured interactions: start the server with "
                                "--capture DB", code="no_capture")
        rid, reward, comment = body.get("id"), body.get("reward"), body.get("comment")
        if not isinstance(rid, str) or not rid:
            raise bad("id", "required: the id of a response this server returned")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not (
                -1e6 <= reward <= 1e6):
            raise bad("reward", f"must be a finite number, got {reward!r}")
        if comment is not None and not isinstance(comment, str):
            raise bad("comment", "must be a string")
        try:
            await asyncio.to_thread(service.capture.feedback, rid, float(reward), comment)
        except FeedbackError as exc:
            raise ApiError(exc.status, str(exc), "id") from None
        return {"id": rid, "object": "feedback", "reward": float(reward)}

    @app.post("/v1/admin/reload")
    async def reload(request: Request) -> dict:
        body = await body_of(request)
        agent = body.get("agent")
        if agent is not None and agent not in service.workers:
            raise ApiError(404, f"agent {agent!r} is not served here", "agent")
        path = body.get("path")
        if path is not None and not isinstance(path, str):
            raise bad("path", "must be a path string")
        return {"agents": await service.reload(agent, path, bool(body.get("force", False)))}

    def deployment(agent: Any) -> Any:
        if service.deployment is None:
            raise ApiError(400, "canaries need the deployment: start the server with --capture "
                                "(and --learn AGENT for online training)", code="no_deployment")
        if not isinstance(agent, str) or agent not in service.deployment.agents:
            raise ApiError(404 if isinstance(agent, str) else 400,
                           f"agent: {agent!r} is not served here (agents: "
                           f"{', '.join(service.workers)})", "agent")
        return service.deployment.agents[agent]

    @app.get("/v1/admin/deployment")
    async def deployment_state() -> dict:
        if service.deployment is None:
            return {"enabled": False}
        d = service.deployment
        return {"enabled": True, "agents": {n: a.describe() for n, a in d.agents.items()},
                "heartbeats": d.heartbeats(), "events": d.events.recent[-50:]}

    @app.post("/v1/admin/canary")
    async def canary(request: Request) -> dict:
        body = await body_of(request)
        dep = deployment(body.get("agent"))
        path, share = body.get("path"), body.get("share")
        if path is not None and not isinstance(path, str):
            raise bad("path", "must be a path string")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise bad("share", f"must be a number in (0, 1], got {share!r}")
        if path is None and dep.learner is None:
            raise bad("path", f"required: agent {dep.name!r} is not trained online (--learn), "
                              "so name the canary's weights")

        def run() -> dict:
            with dep.lock:
                if path is not None:
                    source = explicit_source(path)
                    return dep.start_canary(dep.spec.next_model(source), source.label,
                                            source.policy_version, gate=False, share=share)
                lr = dep.learner
                return dep.start_canary(lr.snapshot_model(dep.spec.model),
                                        f"online-step-{lr.steps}", lr.trainer.version,
                                        gate=bool(body.get("gate", False)), share=share)

        return {"event": await asyncio.to_thread(run)}

    @app.post("/v1/admin/canary/decide")
    async def decide(request: Request) -> dict:
        body = await body_of(request)
        dep = deployment(body.get("agent"))
        if dep.canary is None:
            raise ApiError(409, f"agent {dep.name!r} has no canary", "agent", code="no_canary")

        def run() -> dict | None:
            with dep.lock:
                return dep.decide(force=True)

        return {"event": await asyncio.to_thread(run)}

    @app.get("/v1/admin/versions")
    async def versions() -> dict:
        return {"agents": {n: {**s.version.describe(),
                               "running": service.workers[n].versions_running()}
                           for n, s in service.run.agents.items()}}

    return app


def _too_large(service: Service) -> ApiError:
    return ApiError(413, f"request body is over this server's limit of "
                         f"{service.limits.max_body_bytes} bytes (--max-body-bytes)",
                    code="request_too_large")


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, device: str = "auto", limits: Limits | None = None,
          watch_s: float | None = None, agents: list[str] | None = None,
          max_batch_seqs: int | None = None, capture: str | Path | None = None,
          torch_threads: int | None = None, deploy: DeployConfig | None = None) -> None:
    import uvicorn

    from flexmarl.serving.agents import load_run

    run = load_run(run_dir, device, agents)
    if run.device == "cpu":
        import torch

        # intra-op threads spinning between steps starve the HTTP thread of a CPU
        torch.set_num_threads(torch_threads or run.cfg.runtime.torch_threads)
    service = Service(run, limits, api_key, max_batch_seqs,
                      Capture(capture) if capture is not None else None, deploy)
    app = create_app(service, watch_s)
    names = ", ".join(f"{n} (v{s.version.number}: {s.version.source})"
                      for n, s in run.agents.items())
    print(f"serving {run_dir} on http://{host}:{port}/v1 on {run.device}: {names}", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: listening on {host} without --api-key", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        service.close()
