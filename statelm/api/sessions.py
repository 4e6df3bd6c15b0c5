"""The sessions and snapshots API: request bodies in, manager calls, response objects out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from statelm.api.errors import APIError
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
from statelm.sessions.errors import SessionError, SnapshotCorruptError
from statelm.sessions.manager import SessionManager, SessionView
from statelm.sessions.ownership import current_principal
from statelm.sessions.session import Session, SessionSettings
from statelm.sessions.snapshot_format import snapshot_kv_format
from statelm.sessions.storage import StorageError

_STATUS_OF_CODE = {
    "invalid_id": 400,
    "invalid_request": 400,
    "not_found": 404,
    "already_exists": 409,
    "session_busy": 409,
    "fingerprint_mismatch": 409,
    "snapshot_corrupt": 422,
    "session_limit_reached": 429,
    "kv_pool_full": 507,
    "snapshot_quota_exceeded": 507,
    "insufficient_storage": 507,
}
METADATA = ("sessions", "metadata")  # where a session's metadata is kept: annotations[name][key]
_TYPE_OF_CODE = {
    "session_limit_reached": "rate_limit_error",
    "kv_pool_full": "server_error",
    "snapshot_quota_exceeded": "insufficient_quota",
    "insufficient_storage": "server_error",
}


def session_api_error(error: SessionError) -> APIError:
    """The HTTP error for a sessions-layer error."""
    status = _STATUS_OF_CODE.get(error.code, 400)
    kind = _TYPE_OF_CODE.get(error.code, "invalid_request_error")
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, StorageError) else None
    return APIError(error.message, status=status, type=kind, param=error.param, code=error.code, headers=headers)


@dataclass(frozen=True)
class KVFootprint:
    """What a token of a session's KV takes in the server's pool: the format, and bytes over all layers, K and V."""

    dtype: str
    bytes_per_token: int


def session_object(view: SessionView, kv: KVFootprint) -> SessionObject:
    """The API's view of a session."""
    session = view.session
    return SessionObject(
        id=session.id,
        created=int(session.created),
        last_used=int(session.last_used),
        num_tokens=view.num_tokens,
        num_messages=len(session.transcript),
        state=view.state.value,
        kv_cache_dtype=kv.dtype,
        kv_bytes_per_token=kv.bytes_per_token,
        kv_bytes=view.num_tokens * kv.bytes_per_token,
        **session.settings.to_dict(),
        metadata=session_metadata(session),
    )


def session_metadata(session: Session) -> dict[str, str]:
    """The metadata the API keeps with a session (empty if none was set)."""
    name, key = METADATA
    return dict(session.annotations.get(name, {}).get(key) or {})


def snapshot_object(manifest: dict[str, Any]) -> SnapshotObject:
    """The API's view of a snapshot manifest."""
    metadata = manifest.get("metadata", {})
    return SnapshotObject(
        id=manifest["id"],
        created=int(manifest.get("created", 0)),
        session_id=manifest.get("session", {}).get("id"),
        num_tokens=manifest.get("num_tokens", 0),
        num_messages=manifest.get("num_messages", 0),
        size_bytes=manifest.get("size_bytes", 0),
        model=manifest.get("model", {}).get("name"),
        kv_cache_dtype=_kv_format_name(manifest),
        title=metadata.get("title"),
        description=metadata.get("description"),
        tags=metadata.get("tags"),
        corrupt=manifest.get("corrupt"),
    )


def _kv_format_name(manifest: dict[str, Any]) -> str | None:
    """The KV format a snapshot's manifest names (None where it names none statelm knows)."""
    try:
        return snapshot_kv_format(manifest).name
    except SnapshotCorruptError:
        return None


class SessionService:
    """Serves the /v1/sessions and /v1/snapshots routes from the session manager."""

    def __init__(self, manager: SessionManager, kv: KVFootprint) -> None:
        self.manager = manager
        self.kv = kv

    async def create(self, body: CreateSessionRequest) -> SessionObject:
        """Create a session."""
        settings = SessionSettings(body.max_tokens, body.system, dict(body.chat_template_kwargs or {}))
        transcript = None
        if body.messages is not None:
            system = [{"role": "system", "content": body.system}] if body.system is not None else []
            transcript = system + [message.for_transcript() for message in body.messages]
        session = await self.manager.create(
            body.session_id, settings, transcript, annotations=_annotations(body.metadata)
        )
        return await self._object(session)

    async def update(self, session_id: str, body: UpdateSessionRequest) -> SessionObject:
        """Replace a session's metadata."""
        session = self.manager.get(session_id)
        self.manager.annotate(session, *METADATA, dict(body.metadata) if body.metadata else None)
        return await self._object(session, f"the metadata of session {session_id!r}")

    async def list(self) -> SessionList:
        """The caller's sessions, least recently used first."""
        views = await self.manager.view(self.manager.visible())
        return SessionList(data=[session_object(view, self.kv) for view in views])

    async def get(self, session_id: str) -> SessionObject:
        """One session."""
        return await self._object(self.manager.get(session_id))

    async def delete(self, session_id: str) -> DeletedObject:
        """Delete a session."""
        await self.manager.delete(session_id)
        return DeletedObject(id=session_id, object="session.deleted")

    def history(self, session_id: str) -> SessionHistory:
        """A session's transcript."""
        return SessionHistory(id=session_id, messages=self.manager.get(session_id).transcript)

    async def rollback(self, session_id: str, body: RollbackRequest) -> SessionObject:
        """Keep only the first messages of a session's transcript."""
        session = self.manager.rollback(session_id, body.keep_messages)
        return await self._object(session, f"the rollback of session {session_id!r}")

    async def fork(self, session_id: str, body: ForkRequest) -> SessionObject:
        """A copy of a session that shares its KV."""
        metadata = body.metadata if body.metadata is not None else session_metadata(self.manager.get(session_id))
        return await self._object(await self.manager.fork(session_id, body.session_id, _annotations(metadata)))

    async def snapshot(self, session_id: str, body: SnapshotRequest) -> SnapshotObject:
        """Save a session as a snapshot."""
        return snapshot_object(await self.manager.snapshot(session_id, body.model_dump()))

    async def list_snapshots(self) -> SnapshotList:
        """The caller's snapshots, oldest first."""
        manifests = await asyncio.to_thread(self.manager.snapshots.list, current_principal())
        return SnapshotList(data=[snapshot_object(manifest) for manifest in manifests])

    async def get_snapshot(self, snapshot_id: str) -> SnapshotObject:
        """One snapshot."""
        return snapshot_object(await asyncio.to_thread(self.manager.snapshots.get, snapshot_id, current_principal()))

    async def update_snapshot(self, snapshot_id: str, body: UpdateSnapshotRequest) -> SnapshotObject:
        """Change a snapshot's title, description or tags."""
        changes = body.model_dump(include=body.model_fields_set)
        what, update = f"the metadata of snapshot {snapshot_id!r}", self.manager.snapshots.update
        return snapshot_object(await self.manager.stored(what, update, snapshot_id, changes, current_principal()))

    async def delete_snapshot(self, snapshot_id: str) -> DeletedObject:
        """Delete a snapshot."""
        what, delete = f"the deletion of snapshot {snapshot_id!r}", self.manager.snapshots.delete
        await self.manager.stored(what, delete, snapshot_id, current_principal())
        return DeletedObject(id=snapshot_id, object="snapshot.deleted")

    async def load_snapshot(self, snapshot_id: str, body: LoadSnapshotRequest) -> SessionObject:
        """A new session from a snapshot."""
        return await self._object(await self.manager.load_snapshot(snapshot_id, body.session_id, body.overwrite))

    async def _object(self, session: Session, changed: str | None = None) -> SessionObject:
        """The session's object, once its changes (what `changed` names) are durable (StorageError if they cannot be:
        they were taken back)."""
        await self.manager.settled(session, changed)
        (view,) = await self.manager.view([session])
        return session_object(view, self.kv)


def _annotations(metadata: dict[str, str] | None) -> dict[str, Any]:
    """A new session's annotations holding metadata (None or empty: none)."""
    name, key = METADATA
    return {name: {key: dict(metadata)}} if metadata else {}
