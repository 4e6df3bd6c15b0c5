"""API keys: who may call the server, checked in constant time, and the principal each key acts as.

Keys come from `--api-key`, `STATELM_API_KEY`, `--api-key-file` (one a line, read again when the file
changes) and `--admin-key`. Only their SHA-256 digests are kept; the owner id recorded in manifests is
the hex digest, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from statelm.api.errors import APIError
from statelm.server.errors import error_response
from statelm.server.http_middleware import HttpMiddleware
from statelm.sessions.ownership import LOCAL, Principal, acting_as

log = logging.getLogger(__name__)

ANONYMOUS = Principal("anonymous")  # callers of public routes on a keyed server: they own nothing


def key_digest(key: str) -> bytes:
    """SHA-256 of a key: what the server keeps and compares."""
    return hashlib.sha256(key.encode()).digest()


def owner_of(digest: bytes) -> str:
    """The owner id that sessions and snapshots made with a key record."""
    return f"sha256:{digest.hex()}"


def _matches(digest: bytes, candidates: Iterable[bytes]) -> bool:
    """Whether digest is among candidates, comparing with every one in constant time (no early exit)."""
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(digest, candidate)
    return found


class KeyFile:
    """Keys listed one a line in a file (blank lines and `#` comments skipped), read again when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple[int, int, int] | None = None
        self._digests: tuple[bytes, ...] = ()
        self._readable = True
        self.digests()

    def digests(self) -> tuple[bytes, ...]:
        """Digests of the keys the file lists now; none while it cannot be read (its keys are then refused)."""
        try:
            stat = self.path.stat()
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if signature != self._signature:
                self._digests = tuple(key_digest(key) for key in _keys_in(self.path.read_text()))
                self._signature = signature
                log.info("read %d API keys from %s", len(self._digests), self.path)
            self._readable = True
        except (OSError, UnicodeDecodeError) as exc:
            if self._readable:
                log.error("cannot read the API key file, refusing its keys until it is readable: %s", exc)
            self._signature, self._digests, self._readable = None, (), False
        return self._digests


def _keys_in(text: str) -> list[str]:
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class KeyRing:
    """The keys the server accepts: user keys (flags, environment, file) and admin keys."""

    def __init__(self, user_keys: Iterable[str], admin_keys: Iterable[str], key_file: Path | None = None) -> None:
        self._users = tuple(key_digest(key) for key in user_keys)
        self._admins = tuple(key_digest(key) for key in admin_keys)
        self._file = KeyFile(key_file) if key_file is not None else None

    def principal(self, key: str) -> Principal | None:
        """Who key belongs to; None if the server does not accept it."""
        digest = key_digest(key)
        file_digests = self._file.digests() if self._file is not None else ()
        admin = _matches(digest, self._admins)
        user = _matches(digest, self._users + file_digests)
        if not (admin or user):
            return None
        return Principal(owner_of(digest), admin=admin)


def presented_key(headers: Mapping[bytes, bytes]) -> str | None:
    """The key a request carries as `Authorization: Bearer <key>` or `X-Api-Key: <key>`."""
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    return key or None


class AuthMiddleware(HttpMiddleware):
    """Serves each request as the principal of its key; 401 for a protected route without an accepted key.

    Without a key ring every request acts as the one local user.
    """

    def __init__(
        self, app: ASGIApp, keys: KeyRing | None, public_paths: frozenset[str], public_prefixes: tuple[str, ...] = ()
    ) -> None:
        super().__init__(app)
        self.keys = keys
        self.public_paths = public_paths
        self.public_prefixes = public_prefixes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request as its caller, or answer 401."""
        principal = self._principal(scope)
        if principal is None:
            await self._refuse(scope, receive, send)
            return
        with acting_as(principal):
            await self.app(scope, receive, send)

    def _principal(self, scope: Scope) -> Principal | None:
        if self.keys is None:
            return LOCAL
        if scope["path"] in self.public_paths or scope["path"].startswith(self.public_prefixes):
            return ANONYMOUS
        key = presented_key(dict(scope["headers"]))
        return self.keys.principal(key) if key is not None else None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = presented_key(dict(scope["headers"]))
        message = (
            "Incorrect API key provided."
            if key is not None
            else "No API key provided: send it as `Authorization: Bearer <key>` or `X-Api-Key: <key>`."
        )
        code = "invalid_api_key" if key is not None else "missing_api_key"
        error = APIError(message, status=401, type="authentication_error", code=code)
        await error_response(error, scope["path"], {"WWW-Authenticate": "Bearer"})(scope, receive, send)
