"""The run's graph and feedback: `/v1/episodes` (one episode with the served agents, walked
by training's own executor) and `/v1/feedback` (a reward for a captured response)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from flexmarl.serving.capture import FeedbackError
from flexmarl.serving.episodes import run_episode
from flexmarl.serving.protocol import ApiError, bad
from flexmarl.serving.routes.common import body_of, service_of, tenant_of

router = APIRouter()


@router.post("/v1/episodes")
async def episodes(request: Request) -> JSONResponse:
    service = service_of(request)
    body = await body_of(request)
    return JSONResponse(await run_episode(service, body, tenant_of(request)))

@router.post("/v1/feedback")
async def feedback(request: Request) -> dict:
    service = service_of(request)
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
        await asyncio.to_thread(service.capture.feedback, rid, float(reward), comment,
                                tenant_of(request))
    except FeedbackError as exc:
        raise ApiError(exc.status, str(exc), "id") from None
    team = service.team_canary
    if team is not None and rid in team.arm_of:  # a team canary scored on feedback
        team.observe(team.arm_of.pop(rid), float(reward))
        await asyncio.to_thread(service.decide_team)
    tenant = tenant_of(request)
    if service.drift is not None and (service.tenants is None
                                      or tenant in service.tenants.trainers):
        served = await asyncio.to_thread(service.capture.served, rid)
        await asyncio.to_thread(service.drift.observe, [(a, v) for a, v, _ in served],
                                float(reward), any(e == rid for _, _, e in served))
    return {"id": rid, "object": "feedback", "reward": float(reward)}

