"""The operator's endpoints under `/v1/admin`: reload weights, read versions and the
deployment (shadow / canary / training), start a canary, decide it now."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from flexmarl.serving.agents import explicit_source
from flexmarl.serving.protocol import ApiError, bad
from flexmarl.serving.routes.common import body_of, service_of
from flexmarl.serving.service import Service
from flexmarl.serving.team import TeamCanaryConfig

router = APIRouter()


@router.post("/v1/admin/reload")
async def reload(request: Request) -> dict:
    service = service_of(request)
    body = await body_of(request)
    agent = body.get("agent")
    if agent is not None and agent not in service.workers:
        raise ApiError(404, f"agent {agent!r} is not served here", "agent")
    path = body.get("path")
    if path is not None and not isinstance(path, str):
        raise bad("path", "must be a path string")
    return {"agents": await service.reload(agent, path, bool(body.get("force", False)))}

def deployment(service: Service, agent: Any) -> Any:
    if service.deployment is None:
        raise ApiError(400, "canaries need the deployment: start the server with --capture "
                            "(and --learn AGENT for online training)", code="no_deployment")
    if not isinstance(agent, str) or agent not in service.deployment.agents:
        raise ApiError(404 if isinstance(agent, str) else 400,
                       f"agent: {agent!r} is not served here (agents: "
                       f"{', '.join(service.workers)})", "agent")
    return service.deployment.agents[agent]

@router.get("/v1/admin/deployment")
async def deployment_state(request: Request) -> dict:
    service = service_of(request)
    if service.deployment is None:
        return {"enabled": False}
    d = service.deployment
    return {"enabled": True, "agents": {n: a.describe() for n, a in d.agents.items()},
            "heartbeats": d.heartbeats(), "events": d.events.recent[-50:]}

@router.post("/v1/admin/canary")
async def canary(request: Request) -> dict:
    service = service_of(request)
    body = await body_of(request)
    dep = deployment(service, body.get("agent"))
    if service.team_canary is not None:
        raise ApiError(409, "a team canary is in flight: decide it first "
                            "(POST /v1/admin/team-canary/decide)", code="team_canary_busy")
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

@router.post("/v1/admin/canary/decide")
async def decide(request: Request) -> dict:
    service = service_of(request)
    body = await body_of(request)
    dep = deployment(service, body.get("agent"))
    if dep.canary is None:
        raise ApiError(409, f"agent {dep.name!r} has no canary", "agent", code="no_canary")

    def run() -> dict | None:
        with dep.lock:
            return dep.decide(force=True)

    return {"event": await asyncio.to_thread(run)}

@router.get("/v1/admin/versions")
async def versions(request: Request) -> dict:
    service = service_of(request)
    return {"agents": {n: {**s.version.describe(),
                           "running": service.workers[n].versions_running()}
                       for n, s in service.run.agents.items()}}


@router.get("/v1/admin/drift")
async def drift(request: Request) -> dict:
    service = service_of(request)
    if service.drift is None:
        return {"enabled": False}
    return {"enabled": True, **service.drift.describe()}


@router.post("/v1/admin/team-canary")
async def team_canary(request: Request) -> dict:
    """Start a team canary: {"agents": {agent: weights path}, "share", "min_episodes",
    "max_episodes", "confidence", "margin", "score": "task" | "feedback"}."""
    service = service_of(request)
    body = await body_of(request)
    agents = body.get("agents")
    if not isinstance(agents, dict) or not agents or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in agents.items()):
        raise bad("agents", "required: {agent: weights path} for one or more agents")
    fields = {k: body[k] for k in ("share", "min_episodes", "max_episodes", "confidence",
                                   "margin", "score") if k in body}
    try:
        cfg = TeamCanaryConfig(**fields).check()
    except (TypeError, ValueError) as exc:
        raise bad(str(exc).split(":")[0], str(exc)) from None
    return {"event": await asyncio.to_thread(service.start_team_canary, agents, cfg)}

@router.get("/v1/admin/team-canary")
async def team_canary_state(request: Request) -> dict:
    tc = service_of(request).team_canary
    if tc is None:
        return {"active": False}
    return {"active": True, "versions": {n: v.number for n, v in tc.versions.items()},
            "share": tc.cfg.share, "score": tc.cfg.score, **tc.statistics()}

@router.post("/v1/admin/team-canary/decide")
async def team_canary_decide(request: Request) -> dict:
    service = service_of(request)
    if service.team_canary is None:
        raise ApiError(409, "no team canary in flight", code="no_team_canary")
    return {"event": await asyncio.to_thread(service.decide_team, True)}
