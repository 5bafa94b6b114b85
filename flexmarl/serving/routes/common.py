"""What every route shares: the served run (`app.state.service`) and a size-limited JSON body."""

from __future__ import annotations

import json

from fastapi import Request

from flexmarl.serving.protocol import ApiError, bad
from flexmarl.serving.service import Service


def service_of(request: Request) -> Service:
    """The app's `Service` (a FastAPI dependency)."""
    return request.app.state.service


def tenant_of(request: Request) -> str | None:
    """The tenant the request's key named (None without --tenants)."""
    return getattr(request.state, "tenant", None)


def too_large(service: Service) -> ApiError:
    return ApiError(413, f"request body is over this server's limit of "
                         f"{service.limits.max_body_bytes} bytes (--max-body-bytes)",
                    code="request_too_large")


async def body_of(request: Request) -> dict:
    """The request's JSON object, read no further than the server's body limit."""
    service = service_of(request)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > service.limits.max_body_bytes:
            raise too_large(service)
    try:
        body = json.loads(data or b"null")
    except ValueError as exc:
        raise ApiError(400, f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad("(body)", "must be a JSON object")
    return body
