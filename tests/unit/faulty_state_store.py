"""A state store that fails on demand: every call passes to an inner store, except those a fault picks, which fail
with an error number (ENOSPC, EROFS, EIO…), take longer, or both.

The seam for testing what a full, read-only or failing disk does to every write path without a small disk: wrap the
store the server uses (tests/http patch `statelm.server.launch.DirectoryStore`) and inject faults while it serves.
Test code, like tests/unit/memory_state_store.py.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from statelm.sessions.state_store import Area, StateStore
from statelm.sessions.storage import StorageCondition, StoreSpace

T = TypeVar("T")
WRITES = frozenset(
    {"write_bundle", "replace_file", "delete_bundle", "append_log", "replace_log", "truncate_log", "remove_log"}
)
LOG_WRITES = frozenset({"append_log", "replace_log"})
BUNDLE_WRITES = frozenset({"write_bundle", "replace_file"})
_CONDITIONS = {errno.ENOSPC: StorageCondition.FULL, errno.EROFS: StorageCondition.READ_ONLY}


@dataclass
class Fault:
    """What to do to the calls it picks: those of `operations`, in `areas` (None: any; logs are the JOURNAL area),
    the next `times` of them (None: every one until cleared)."""

    operations: frozenset[str] = WRITES
    error: int | None = errno.ENOSPC  # the error number to fail with (None: none, only the delay)
    delay_s: float = 0.0  # how long the call takes beyond its own time, before it runs
    areas: frozenset[Area] | None = None
    times: int | None = None
    after: bool = False  # the call takes effect, then fails (an fsync that reported an error after the write)
    torn: bool = False  # an append writes the first half of its bytes, then fails (a disk that filled mid-write)
    hits: int = 0  # calls it picked so far

    def picks(self, operation: str, area: Area) -> bool:
        """Whether the fault applies to this call (counting it if it does)."""
        if operation not in self.operations or (self.areas is not None and area not in self.areas):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


class FaultyStore:
    """The state store protocol over inner, with the faults injected into it (shared with its private store)."""

    def __init__(self, inner: StateStore, faults: list[Fault] | None = None) -> None:
        self.inner = inner
        self.faults: list[Fault] = faults if faults is not None else []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"

    def inject(self, fault: Fault) -> Fault:
        """Start failing calls as fault says."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Stop failing anything."""
        with self._lock:
            self.faults.clear()

    def prepare(self, area: Area, exclusive: bool) -> None:
        """Ready an area (a fault here stands for a state dir that cannot be made)."""
        self._call("prepare", area, lambda: self.inner.prepare(area, exclusive))

    def write_bundle(self, area: Area, name: str, files: Mapping[str, bytes]) -> None:
        """Write a bundle whole."""
        self._call("write_bundle", area, lambda: self.inner.write_bundle(area, name, files))

    def read_file(self, area: Area, name: str, file: str) -> bytes:
        """One file of a bundle."""
        return self._call("read_file", area, lambda: self.inner.read_file(area, name, file))

    def replace_file(self, area: Area, name: str, file: str, data: bytes) -> None:
        """Replace one file of a bundle."""
        self._call("replace_file", area, lambda: self.inner.replace_file(area, name, file, data))

    def delete_bundle(self, area: Area, name: str) -> None:
        """Remove a bundle."""
        self._call("delete_bundle", area, lambda: self.inner.delete_bundle(area, name))

    def bundle_exists(self, area: Area, name: str) -> bool:
        """Whether the bundle exists (never failed)."""
        return self.inner.bundle_exists(area, name)

    def bundle_names(self, area: Area) -> list[str]:
        """The area's bundles (never failed)."""
        return self.inner.bundle_names(area)

    def bundle_size(self, area: Area, name: str) -> int:
        """Bytes of a bundle (never failed)."""
        return self.inner.bundle_size(area, name)

    def append_log(self, name: str, data: bytes) -> int:
        """Append to a log; a torn fault writes half the bytes before failing."""
        fault = self._fault("append_log", Area.JOURNAL)
        if fault is not None and fault.torn:
            self.inner.append_log(name, data[: len(data) // 2])
        return self._apply(fault, lambda: self.inner.append_log(name, data))

    def replace_log(self, name: str, data: bytes) -> int:
        """Replace a log whole."""
        return self._call("replace_log", Area.JOURNAL, lambda: self.inner.replace_log(name, data))

    def read_log(self, name: str) -> bytes:
        """A log's bytes."""
        return self._call("read_log", Area.JOURNAL, lambda: self.inner.read_log(name))

    def truncate_log(self, name: str, size: int) -> None:
        """Cut a log."""
        self._call("truncate_log", Area.JOURNAL, lambda: self.inner.truncate_log(name, size))

    def remove_log(self, name: str) -> None:
        """Remove a log."""
        self._call("remove_log", Area.JOURNAL, lambda: self.inner.remove_log(name))

    def log_exists(self, name: str) -> bool:
        """Whether the log exists (never failed)."""
        return self.inner.log_exists(name)

    def log_size(self, name: str) -> int:
        """Bytes of a log (never failed)."""
        return self.inner.log_size(name)

    def log_names(self) -> list[str]:
        """The logs (never failed)."""
        return self.inner.log_names()

    def space(self) -> StoreSpace:
        """The inner store's, but as full (no byte free) or read-only while a fault of that error applies to every
        call it picks."""
        space = self.inner.space()
        with self._lock:
            lasting = [fault for fault in self.faults if fault.times is None and fault.error in _CONDITIONS]
        if not lasting or space.condition is not StorageCondition.OK:
            return space
        condition = _CONDITIONS[lasting[-1].error or 0]
        free = 0 if condition is StorageCondition.FULL else space.free_bytes
        return StoreSpace(space.location, condition, free, space.total_bytes)

    def private(self) -> FaultyStore:
        """The inner store's private store, failing with the same faults."""
        return FaultyStore(self.inner.private(), self.faults)

    def destroy(self) -> None:
        """Remove the inner store."""
        self.inner.destroy()

    def _fault(self, operation: str, area: Area) -> Fault | None:
        with self._lock:
            return next((fault for fault in reversed(self.faults) if fault.picks(operation, area)), None)

    def _call(self, operation: str, area: Area, call: Callable[[], T]) -> T:
        return self._apply(self._fault(operation, area), call)

    def _apply(self, fault: Fault | None, call: Callable[[], T]) -> T:
        if fault is None:
            return call()
        if fault.delay_s:
            time.sleep(fault.delay_s)
        if fault.error is None:
            return call()
        if fault.after:
            call()
        raise OSError(fault.error, os.strerror(fault.error))


def faulty_directory_stores(stores: list[FaultyStore]) -> Callable[[Any], FaultyStore]:
    """A stand-in for DirectoryStore(root) that wraps each store it makes, and lists them in stores."""
    from statelm.sessions.directory_store import DirectoryStore

    def make(root: Any) -> FaultyStore:
        store = FaultyStore(DirectoryStore(root))
        stores.append(store)
        return store

    return make
