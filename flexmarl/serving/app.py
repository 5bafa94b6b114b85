"""The HTTP side of `flexmarl serve`: a FastAPI application over the served run (`service.py`),
its routes in `routes/`, served by uvicorn.

Routes (all under the API key when one is set, or a tenant's key with --tenants, except
/health; /v1/admin/* only for admin tenants):
  GET  /health                      liveness, versions
  GET  /v1/models, /v1/models/{id}  the served agents                          routes/openai.py
  POST /v1/chat/completions         messages through the agent's chat template
  POST /v1/completions              text or token ids
  POST /v1/episodes                 one episode of the run's graph             routes/episodes.py
  POST /v1/feedback                 a reward for a captured response (with --capture)
  POST /v1/admin/reload             load new weights for one or all agents     routes/admin.py
  GET  /v1/admin/versions           each agent's served version and the versions still running
  GET  /v1/admin/drift              rolling reward per agent and team, peaks, drift alerts
  POST /v1/admin/team-canary        a version vector as one canary, scored on whole episodes
  GET  /v1/admin/team-canary        its counts, means and confidence interval
  POST /v1/admin/team-canary/decide apply the promotion rule now
  GET  /v1/admin/deployment         shadow / canary / training per agent, heartbeats, events
  POST /v1/admin/canary             deploy weights (or the training policy) as an agent's canary
  POST /v1/admin/canary/decide      score the canary now: promote or roll back
"""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from flexmarl.serving.agents import ServedRun, ServeError, load_run
from flexmarl.serving.capture import Capture
from flexmarl.serving.deploy import DeployConfig
from flexmarl.serving.drift import DriftConfig
from flexmarl.serving.protocol import ApiError, Limits
from flexmarl.serving.routes import admin, episodes, openai
from flexmarl.serving.routes.common import too_large
from flexmarl.serving.service import Service
from flexmarl.serving.tenants import RateLimited, Tenants


def _denied(status: int, message: str, kind: str, code: str,
            headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind=kind, code=code).body(),
                        status_code=status, headers=headers)


def _admission(service: Service, request: Request, given: str, path: str
               ) -> JSONResponse | None:
    """None when the key may make this request (its tenant noted on `request.state`), else
    the refusal: 401 (no such key), 403 (admin route, not an admin tenant), 429 (tenant's
    limit). Refused requests reach no route, so nothing of them is recorded."""
    if service.tenants is None:
        assert service.api_key  # the caller checked one of the two is set
        if hmac.compare_digest(given.encode(), service.api_key.encode()):
            return None
        return _denied(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                       "authentication_error", "invalid_api_key")
    tenant = service.tenants.identify(given)
    if tenant is None:
        return _denied(401, "missing or wrong API key: no tenant has this key (send "
                            "Authorization: Bearer <key>)", "authentication_error",
                       "invalid_api_key")
    if path.startswith("/v1/admin") and not tenant.admin:
        return _denied(403, f"tenant {tenant.name!r} may not call {path} (admin: true in the "
                            "tenants file)", "permission_error", "not_admin")
    try:
        service.tenants.admit(tenant)
    except RateLimited as exc:
        return _denied(429, str(exc), "rate_limit_error", "rate_limited",
                       {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))})
    request.state.tenant = tenant.name
    return None


def create_app(service: Service, watch_s: float | None = None) -> FastAPI:
    """The application over `service`; `watch_s`: reload new checkpoints every so often."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
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
    for module in (openai, episodes, admin):
        app.include_router(module.router)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ServeError)
    async def _serve_error(_request: Request, exc: ServeError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Any:
        path = request.url.path
        if (service.api_key or service.tenants is not None) and path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            denied = _admission(service, request, given, path)
            if denied is not None:
                return denied
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > service.limits.max_body_bytes:
            return JSONResponse(too_large(service).body(), status_code=413)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        out: dict[str, Any] = {
            "status": "ok", "pending": service.pending,
            "agents": {n: s.version.number for n, s in service.run.agents.items()}}
        if service.drift is not None:
            out["drift_alerts"] = len(service.drift.alerts)
        if service.deployment is not None:
            beats = service.deployment.heartbeats()
            out["heartbeats"] = beats
            if not all(b["ok"] for b in beats.values()):
                out["status"] = "degraded"
        return out

    return app


def serve(run_dir: str | Path | ServedRun, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, device: str = "auto", limits: Limits | None = None,
          watch_s: float | None = None, agents: list[str] | None = None,
          max_batch_seqs: int | None = None, capture: str | Path | None = None,
          torch_threads: int | None = None, deploy: DeployConfig | None = None,
          tenants: Tenants | None = None, drift: DriftConfig | None = None) -> None:
    """Serve a run folder's agents (or an already loaded `ServedRun`, such as
    `load_model_folder`'s) until interrupted."""
    import uvicorn  # optional: uvicorn (the serve extra)

    run = run_dir if isinstance(run_dir, ServedRun) else load_run(run_dir, device, agents)
    if run.device == "cpu":

        # intra-op threads spinning between steps starve the HTTP thread of a CPU
        torch.set_num_threads(torch_threads or run.cfg.runtime.torch_threads)
    service = Service(run, limits, api_key, max_batch_seqs,
                      Capture(capture) if capture is not None else None, deploy, tenants,
                      drift)
    app = create_app(service, watch_s)
    names = ", ".join(f"{n} (v{s.version.number}: {s.version.source})"
                      for n, s in run.agents.items())
    print(f"serving {run.run_dir} on http://{host}:{port}/v1 on {run.device}: {names}",
          flush=True)
    if tenants is not None:
        print(f"tenants: {', '.join(tenants.by_name)} ({tenants.source})", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key and tenants is None:
        print(f"warning: listening on {host} without --api-key", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        service.close()
