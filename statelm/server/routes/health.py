"""Liveness of the server, answered without touching the engine."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health() -> dict[str, str]:
    """The server is up and its event loop is free."""
    return {"status": "ok"}
