"""Liveness of the server, answered without touching the engine."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

router = APIRouter(tags=["ops"])


class HealthStatus(BaseModel):
    """Body of GET /health."""

    status: Literal["ok", "draining", "degraded"]


@router.get(
    "/health",
    responses={503: {"model": HealthStatus, "description": "Draining before shutdown, or the engine cannot serve"}},
)
async def health(request: Request, response: Response) -> HealthStatus:
    """The server is up and its event loop is free; 503 while it drains or when the engine cannot recover."""
    if request.app.state.drain.draining:
        response.status_code = 503
        return HealthStatus(status="draining")
    if request.app.state.engine.is_degraded():
        response.status_code = 503
        return HealthStatus(status="degraded")
    return HealthStatus(status="ok")
