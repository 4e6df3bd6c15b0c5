"""statelm's routes for sessions and snapshots (see docs/sessions.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, status

from statelm.api.session_protocol import (
    CreateSessionRequest,
    DeletedObject,
    ForkRequest,
    LoadSnapshotRequest,
    RollbackRequest,
    SessionHistory,
    SessionList,
    SessionObject,
    SnapshotList,
    SnapshotObject,
    SnapshotRequest,
    UpdateSessionRequest,
    UpdateSnapshotRequest,
)
from statelm.api.sessions import SessionService
from statelm.sessions.errors import ID_PATTERN

router = APIRouter(prefix="/v1", tags=["sessions"])
# The pattern is documented here and checked by the sessions layer, whose 400 has code `invalid_id`.
PathId = Annotated[str, Path(json_schema_extra={"pattern": ID_PATTERN.pattern})]


def session_service(request: Request) -> SessionService:
    """The session service of the running app."""
    return request.app.state.sessions


@router.post("/sessions", status_code=status.HTTP_201_CREATED)
async def create_session(request: Request, body: CreateSessionRequest | None = None) -> SessionObject:
    """Create a session."""
    return await session_service(request).create(body or CreateSessionRequest())


@router.get("/sessions")
async def list_sessions(request: Request) -> SessionList:
    """List sessions, least recently used first."""
    return await session_service(request).list()


@router.get("/sessions/{session_id}")
async def get_session(session_id: PathId, request: Request) -> SessionObject:
    """Show one session."""
    return await session_service(request).get(session_id)


@router.patch("/sessions/{session_id}")
async def update_session(session_id: PathId, body: UpdateSessionRequest, request: Request) -> SessionObject:
    """Replace a session's metadata (null clears it)."""
    return await session_service(request).update(session_id, body)


@router.delete("/sessions/{session_id}")
async def delete_session(session_id: PathId, request: Request) -> DeletedObject:
    """Delete a session and its KV."""
    return await session_service(request).delete(session_id)


@router.get("/sessions/{session_id}/history")
async def session_history(session_id: PathId, request: Request) -> SessionHistory:
    """A session's transcript."""
    return session_service(request).history(session_id)


@router.post("/sessions/{session_id}/rollback")
async def rollback_session(session_id: PathId, body: RollbackRequest, request: Request) -> SessionObject:
    """Keep only the first `keep_messages` messages."""
    return await session_service(request).rollback(session_id, body)


@router.post("/sessions/{session_id}/fork", status_code=status.HTTP_201_CREATED)
async def fork_session(session_id: PathId, request: Request, body: ForkRequest | None = None) -> SessionObject:
    """A new session sharing this one's KV (copied on write)."""
    return await session_service(request).fork(session_id, body or ForkRequest())


@router.post("/sessions/{session_id}/snapshot", status_code=status.HTTP_201_CREATED)
async def snapshot_session(session_id: PathId, request: Request, body: SnapshotRequest | None = None) -> SnapshotObject:
    """Save a session to disk as a snapshot."""
    return await session_service(request).snapshot(session_id, body or SnapshotRequest())


@router.get("/snapshots")
async def list_snapshots(request: Request) -> SnapshotList:
    """List snapshots, oldest first."""
    return await session_service(request).list_snapshots()


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: PathId, request: Request) -> SnapshotObject:
    """Show one snapshot."""
    return await session_service(request).get_snapshot(snapshot_id)


@router.patch("/snapshots/{snapshot_id}")
async def update_snapshot(snapshot_id: PathId, body: UpdateSnapshotRequest, request: Request) -> SnapshotObject:
    """Change a snapshot's title, description or tags (null clears a field)."""
    return await session_service(request).update_snapshot(snapshot_id, body)


@router.delete("/snapshots/{snapshot_id}")
async def delete_snapshot(snapshot_id: PathId, request: Request) -> DeletedObject:
    """Delete a snapshot."""
    return await session_service(request).delete_snapshot(snapshot_id)


@router.post("/snapshots/{snapshot_id}/load", status_code=status.HTTP_201_CREATED)
async def load_snapshot(
    snapshot_id: PathId, request: Request, body: LoadSnapshotRequest | None = None
) -> SessionObject:
    """Make a session from a snapshot."""
    return await session_service(request).load_snapshot(snapshot_id, body or LoadSnapshotRequest())
