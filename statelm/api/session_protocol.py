"""Request and response bodies of the sessions and snapshots API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from statelm.api.protocol import ChatMessage, Metadata, TemplateKwargs, TypedModel
from statelm.sessions.errors import ID_PATTERN

# Documented in the schema; checked by the sessions layer, whose error names the id (code `invalid_id`).
Identifier = Annotated[str, Field(json_schema_extra={"pattern": ID_PATTERN.pattern})]
Title = Annotated[str, Field(max_length=200)]
Description = Annotated[str, Field(max_length=4000)]
Tags = Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=32)]


class CreateSessionRequest(TypedModel):
    """Body of POST /v1/sessions."""

    session_id: Identifier | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    system: str | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    messages: list[ChatMessage] | None = None  # the initial transcript (an imported conversation), system included
    metadata: Metadata | None = None


class UpdateSessionRequest(TypedModel):
    """Body of PATCH /v1/sessions/{id}: the metadata that replaces the session's (null clears it)."""

    metadata: Metadata | None


class RollbackRequest(TypedModel):
    """Body of POST /v1/sessions/{id}/rollback."""

    keep_messages: Annotated[int, Field(ge=0)]


class ForkRequest(TypedModel):
    """Body of POST /v1/sessions/{id}/fork."""

    session_id: Identifier | None = None
    metadata: Metadata | None = None  # the fork's; absent: the parent's


class SnapshotRequest(TypedModel):
    """Body of POST /v1/sessions/{id}/snapshot."""

    title: Title | None = None
    description: Description | None = None
    tags: Tags | None = None


class UpdateSnapshotRequest(SnapshotRequest):
    """Body of PATCH /v1/snapshots/{id}: fields sent are set, null clears, absent ones stay."""


class LoadSnapshotRequest(TypedModel):
    """Body of POST /v1/snapshots/{id}/load."""

    session_id: Identifier | None = None
    overwrite: bool = False


class SessionObject(BaseModel):
    """A session as the API shows it."""

    id: str
    object: Literal["session"] = "session"
    created: int
    last_used: int
    num_tokens: int
    num_messages: int
    state: Literal["resident", "spilled", "busy"]
    kv_cache_dtype: str  # the format of its KV, the server's pool's (--kv-cache-dtype)
    kv_bytes_per_token: int  # bytes a token of its KV takes in the pool, all layers, K and V
    kv_bytes: int  # num_tokens x kv_bytes_per_token: its KV in the pool (resident) or to restore (spilled)
    max_tokens: int | None
    system: str | None
    chat_template_kwargs: dict[str, Any]
    metadata: dict[str, str]


class SessionList(BaseModel):
    """Body of GET /v1/sessions."""

    object: Literal["list"] = "list"
    data: list[SessionObject]


class SessionHistory(BaseModel):
    """Body of GET /v1/sessions/{id}/history."""

    id: str
    object: Literal["session.history"] = "session.history"
    messages: list[dict[str, Any]]


class SnapshotObject(BaseModel):
    """A snapshot as the API shows it."""

    id: str
    object: Literal["snapshot"] = "snapshot"
    created: int
    session_id: str | None
    num_tokens: int
    num_messages: int
    size_bytes: int
    model: str | None
    kv_cache_dtype: str | None = None  # the format of its KV (a server keeping another refuses to load it)
    title: str | None = None
    description: str | None = None
    tags: list[str] | None = None
    corrupt: str | None = Field(default=None, exclude_if=lambda value: value is None)  # unreadable manifest


class SnapshotList(BaseModel):
    """Body of GET /v1/snapshots."""

    object: Literal["list"] = "list"
    data: list[SnapshotObject]


class DeletedObject(BaseModel):
    """Body of a DELETE."""

    id: str
    object: Literal["session.deleted", "snapshot.deleted"]
    deleted: bool = True
