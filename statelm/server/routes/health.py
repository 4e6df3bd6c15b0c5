"""Liveness of the server, answered without touching the engine."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

router = APIRouter(tags=["ops"])


class HealthStatus(BaseModel):
    """Body of GET /health."""

    status: Literal["ok", "draining", "degraded"]
    batch_invariance: dict[str, Any] | None = Field(
        None, description="The compute path the start-up self-check chose, whether it passed, and what it rejected"
    )
    state_dir: dict[str, Any] | None = Field(
        None,
        description="The state directory's condition (ok, full, read-only, missing, failing), its free and total "
        "bytes, and how many sessions' writes it still owes; a condition other than ok is reported here without "
        "failing the liveness check",
    )


@router.get(
    "/health",
    responses={503: {"model": HealthStatus, "description": "Draining before shutdown, or the engine cannot serve"}},
)
async def health(request: Request, response: Response) -> HealthStatus:
    """The server is up and its event loop is free; 503 while it drains or when the engine cannot recover. The state
    directory's condition is reported, not judged: a full disk refuses what cannot be saved, the rest is served."""
    invariance = request.app.state.invariance
    details = dict(invariance) if invariance is not None else None
    storage = request.app.state.sessions.manager.storage_report()
    if request.app.state.drain.draining:
        response.status_code = 503
        return HealthStatus(status="draining", batch_invariance=details, state_dir=storage)
    if request.app.state.engine.is_degraded():
        response.status_code = 503
        return HealthStatus(status="degraded", batch_invariance=details, state_dir=storage)
    return HealthStatus(status="ok", batch_invariance=details, state_dir=storage)
