"""A session as the server tracks it: settings, transcript, and where its KV currently lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from statelm.engine.client import SessionKVData
from statelm.sessions.errors import SessionError
from statelm.sessions.ownership import LOCAL_OWNER, recorded_owner


class SessionState(enum.StrEnum):
    """Where a session's KV is: in the pool, on disk (reloaded on the next turn), or in use by a turn."""

    RESIDENT = "resident"
    SPILLED = "spilled"
    BUSY = "busy"


class SessionKind(enum.StrEnum):
    """Which API a session belongs to: the sessions API, or /v1/responses (a chain of stored responses, which only
    that API reaches)."""

    SESSION = "session"
    RESPONSES = "responses"


@dataclass
class SessionSettings:
    """What a session was created with."""

    max_tokens: int | None = None  # cap on the whole context: transcript plus reply
    system: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping for manifests and responses."""
        return {"max_tokens": self.max_tokens, "system": self.system, "chat_template_kwargs": self.chat_template_kwargs}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionSettings:
        """Settings from a manifest's mapping."""
        return cls(data.get("max_tokens"), data.get("system"), dict(data.get("chat_template_kwargs") or {}))


@dataclass
class Session:
    """A conversation kept by the server; its KV is in the engine's pool, in `spilled_kv`, or on disk."""

    id: str
    settings: SessionSettings
    transcript: list[dict[str, Any]] = field(default_factory=list)
    owner: str = LOCAL_OWNER  # hash of the API key that created it
    kind: SessionKind = SessionKind.SESSION
    annotations: dict[str, Any] = field(default_factory=dict)  # what the API it belongs to keeps with it, saved too
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    busy: bool = False
    spilled_kv: SessionKVData | None = None  # KV taken out of the pool and not yet written to disk
    stored_tokens: int = 0  # tokens of the KV outside the pool (in spilled_kv or on disk)
    on_disk: bool = False  # its directory under the sessions dir holds its latest spilled KV
    disk_stale: bool = False  # transcript, settings or annotations changed since the directory was written
    lsn: int = 0  # log sequence number of its last change: journal records and its directory carry it

    @classmethod
    def restored(
        cls, session_id: str, fields: dict[str, Any], transcript: list[dict[str, Any]], default_time: float = 0.0
    ) -> Session:
        """The session a manifest's or a journal record's `session` section describes.

        SessionError if the section names a kind this server does not know or annotations that are not an object.
        """
        kind = fields.get("kind", SessionKind.SESSION)
        if kind not in tuple(SessionKind):
            raise SessionError(f"unknown kind {kind!r}")
        annotations = fields.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise SessionError("its annotations are not an object")
        return cls(
            session_id,
            SessionSettings.from_dict(fields),
            transcript,
            owner=recorded_owner(fields),
            kind=SessionKind(kind),
            annotations=dict(annotations),
            created=fields.get("created", default_time),
            last_used=fields.get("last_used", default_time),
        )

    def touch(self) -> None:
        """Record a use."""
        self.last_used = time.time()

    def state(self, resident: bool) -> SessionState:
        """The state to report, given whether the engine holds its KV."""
        if self.busy:
            return SessionState.BUSY
        return SessionState.RESIDENT if resident else SessionState.SPILLED

    def manifest_fields(self) -> dict[str, Any]:
        """What a snapshot's manifest records about the session it was taken from."""
        return {
            "session": {
                "id": self.id,
                "created": self.created,
                "last_used": self.last_used,
                "owner": self.owner,
                "kind": self.kind.value,
                "annotations": self.annotations,
                **self.settings.to_dict(),
            }
        }
