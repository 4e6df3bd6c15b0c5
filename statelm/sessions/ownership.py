"""Who owns a session or snapshot, and who is asking: the principal of the request being served."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

LOCAL_OWNER = "local"


@dataclass(frozen=True)
class Principal:
    """A caller: the owner id its new sessions and snapshots record, and whether it may touch everyone's."""

    owner: str
    admin: bool = False

    def may_access(self, owner: str) -> bool:
        """Whether this caller may see and change what owner created."""
        return self.admin or owner == self.owner


LOCAL = Principal(LOCAL_OWNER, admin=True)  # a server without keys: the one local user owns everything
_current: ContextVar[Principal] = ContextVar("statelm_principal", default=LOCAL)


def current_principal() -> Principal:
    """The caller of the request being served (the local user outside any request)."""
    return _current.get()


@contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Serve what runs inside, and the tasks it starts, on behalf of principal."""
    token = _current.set(principal)
    try:
        yield
    finally:
        _current.reset(token)


def recorded_owner(fields: Mapping[str, Any]) -> str:
    """The owner a manifest section records; state written before owners were recorded is the local user's."""
    owner = fields.get("owner", LOCAL_OWNER)
    return owner if isinstance(owner, str) else LOCAL_OWNER
