"""Errors of the sessions layer, each with a stable code that the API layer maps to an HTTP status."""

from __future__ import annotations

import re

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SessionError(Exception):
    """A session or snapshot operation that cannot be done; `code` says why, `param` names the culprit."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidIdError(SessionError):
    """An id that could be a path or is otherwise not allowed."""

    code = "invalid_id"


class NotFoundError(SessionError):
    """No session or snapshot with that id."""

    code = "not_found"


class AlreadyExistsError(SessionError):
    """A session or snapshot with that id exists."""

    code = "already_exists"


class SessionBusyError(SessionError):
    """The session is running a turn."""

    code = "session_busy"


class SnapshotCorruptError(SessionError):
    """A snapshot on disk is damaged, truncated or of an unknown schema."""

    code = "snapshot_corrupt"


class FingerprintMismatchError(SessionError):
    """A snapshot was made with another model, dtype, tokenizer or chat template."""

    code = "fingerprint_mismatch"


class SessionLimitError(SessionError):
    """The caller already has as many sessions as one key may have."""

    code = "session_limit_reached"


class SnapshotQuotaError(SessionError):
    """A new snapshot would take the caller's snapshots past their byte quota."""

    code = "snapshot_quota_exceeded"


class PoolTooSmallError(SessionError):
    """A session's KV does not fit the pool even after spilling every idle session."""

    code = "kv_pool_full"


def check_id(value: str, param: str) -> str:
    """value, if it is a safe session or snapshot id (never a path); InvalidIdError otherwise."""
    if not ID_PATTERN.fullmatch(value):
        raise InvalidIdError(
            f"invalid {param} {value!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            param=param,
        )
    return value
