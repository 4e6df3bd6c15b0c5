"""The state store's condition, and the refusal a request gets when what it would keep cannot be saved.

A write fails for a cause (`full`, `read-only`, `missing`, `failing`), read off its error number and, for a missing
file, off the store's condition (a file missing inside a present store is no storage fault). A request whose effect
the server promises to keep and could not save gets StorageError, answered 507 Insufficient Storage with Retry-After:
its message says what could not be saved, where, and how much room is left.
"""

from __future__ import annotations

import errno
import threading
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from statelm.config import format_size
from statelm.sessions.errors import SessionError

RETRY_AFTER_S = 30  # what a refusal's Retry-After asks: room is freed, or a disk remounted, by a person
FULL_BELOW_BYTES = 1 << 20  # a store with less room than this reports itself full


class StorageCondition(StrEnum):
    """What a store's file system says about it: usable, out of room, mounted read-only, gone, or failing."""

    OK = "ok"
    FULL = "full"
    READ_ONLY = "read-only"
    MISSING = "missing"
    FAILING = "failing"


@dataclass(frozen=True)
class StoreSpace:
    """Where a store keeps its data, its condition, and its room in bytes (None: the store cannot tell)."""

    location: str
    condition: StorageCondition
    free_bytes: int | None = None
    total_bytes: int | None = None


_CAUSES = {
    errno.ENOSPC: StorageCondition.FULL,
    errno.EDQUOT: StorageCondition.FULL,
    errno.EROFS: StorageCondition.READ_ONLY,
}


def cause_of(error: OSError, space: StoreSpace | None = None) -> StorageCondition:
    """Why a write failed: its error number's cause. A missing file is a missing store unless the store (space: as
    seen just after) is there: then it is no storage fault (OK: the caller's own not-found, a deletion meanwhile)."""
    if isinstance(error, FileNotFoundError):
        missing = space is None or space.condition is StorageCondition.MISSING
        return StorageCondition.MISSING if missing else StorageCondition.OK
    return _CAUSES.get(error.errno or 0, StorageCondition.FAILING)


class StorageError(SessionError):
    """What a request would keep could not be saved: answered 507 with Retry-After; nothing of it was kept."""

    code = "insufficient_storage"

    def __init__(self, message: str, cause: StorageCondition) -> None:
        super().__init__(message)
        self.cause = cause
        self.retry_after = RETRY_AFTER_S


def describe(space: StoreSpace, cause: StorageCondition, error: OSError) -> str:
    """What is wrong with the store, in words, with its room when it is known."""
    room = ""
    if space.free_bytes is not None and space.total_bytes is not None:
        room = f" ({format_size(space.free_bytes)} free of {format_size(space.total_bytes)})"
    if cause is StorageCondition.FULL:
        return f"{space.location} is full{room}; free some space there"
    if cause is StorageCondition.READ_ONLY:
        return f"{space.location} is read-only; remount it read-write"
    if cause is StorageCondition.MISSING:
        return f"{space.location} no longer exists; the server makes it again"
    return f"{space.location} failed ({error}){room}"


class StorageHealth:
    """The store's condition as last seen, and the failed writes and refusals it caused, by cause.

    The condition is the store's own (probed now and then, and after each failure) unless that is ok while writes
    are still owed to it (a journal to rewrite, a spill to write): it is then the cause of the failure that left them.
    Updated from the event loop and from worker threads.
    """

    def __init__(self, space: StoreSpace) -> None:
        self.space = space
        self.refusals: Counter[StorageCondition] = Counter()
        self.failures: Counter[StorageCondition] = Counter()
        self._cause = StorageCondition.OK  # of the last failure, until nothing is owed
        self._lock = threading.Lock()

    def condition(self, owed: int) -> StorageCondition:
        """ok, or what is wrong now, given how many writes are owed."""
        if self.space.condition is not StorageCondition.OK or not owed:
            return self.space.condition
        return self._cause if self._cause is not StorageCondition.OK else StorageCondition.FAILING

    def failed(self, error: OSError, space: StoreSpace | None = None) -> StorageCondition:
        """Note a write that failed (space: the store as seen just after, if looked at); its cause."""
        cause = cause_of(error, space)
        with self._lock:
            if space is not None:
                self.space = space
            if cause is not StorageCondition.OK:
                self._cause = cause
                self.failures[cause] += 1
        return cause

    def refusal(self, what: str, error: OSError, space: StoreSpace) -> StorageError:
        """The error that refuses a request because what it would keep could not be saved, counted by cause."""
        cause = self.failed(error, space)
        if cause is StorageCondition.OK:
            cause = StorageCondition.FAILING
        with self._lock:
            self.refusals[cause] += 1
        return StorageError(f"could not save {what}: {describe(space, cause, error)}, then retry", cause)

    def observe(self, space: StoreSpace, owed: int) -> None:
        """The store as probed now, and the writes still owed to it."""
        with self._lock:
            self.space = space
            if not owed and space.condition is StorageCondition.OK:
                self._cause = StorageCondition.OK

    def report(self, owed: int) -> dict[str, object]:
        """The condition for /health (public: where the store is stays out of it); no I/O."""
        space = self.space
        return {
            "condition": self.condition(owed).value,
            "free_bytes": space.free_bytes,
            "total_bytes": space.total_bytes,
            "owed_writes": owed,
        }
