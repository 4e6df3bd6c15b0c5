"""Where the sessions layer keeps every byte it persists: saved sessions, snapshots and journals, behind one protocol.

A store holds two kinds of things:

- bundles: named sets of files written as a whole, in an area: `SESSIONS` (a session saved or spilled) or
  `SNAPSHOTS` (a user's snapshot). The snapshot format (statelm.sessions.snapshot_format) says what the files hold.
- logs: one append-only byte log per session, the journals (`JOURNAL`). The record framing is the journal's
  (statelm.sessions.journal); the store only moves bytes.

statelm.sessions.directory_store.DirectoryStore keeps them in a directory (`--state-dir`, on a file system every
replica mounts when they share it). The protocol asks nothing an object store (whole-object put, get, delete and
list; no append, no rename) could not do: a bundle can be its files under a fresh prefix, made current by one small
pointer object written last (the old prefix deleted after); a log can be one object per appended record, read back in
order, its size the sum of theirs.

The crash safety of the journal and of recovery rests on what every implementation must guarantee:

- a bundle is replaced atomically: a file read is the old bundle's or the new one's, whole, never half written (while
  a replacement is under way the bundle may briefly be missing), and after a crash at any point `prepare` leaves the
  old bundle or the new, complete; a file replaced in a bundle and a log replaced whole likewise. (Reading several
  files takes several calls: the sessions layer never replaces a bundle it is reading, and checks every file against
  the manifest's checksums);
- a write (bundle, file, append, log replace, truncate, removal) is durable when the call returns;
- read-your-writes: anything a call has written, any later call in any process sharing the store reads;
- listings never show a bundle half written, nor the temporaries of writes under way;
- a missing bundle, file or log is reported as FileNotFoundError, other failures as OSError, with the error number
  that says why (ENOSPC, EROFS, EIO…: statelm.sessions.storage tells the causes apart);
- a write that fails leaves nothing half done that a listing or a read could see (a torn append excepted, which the
  journal's framing tells apart), and no temporary behind.

Deleting a bundle need not be atomic: a crash may leave part of one, which readers report as damaged (a session's
journal records its deletion durably first, so recovery finishes it). Several processes may share a store, each
writing only the sessions it holds; what one that died left half done is cleaned by `prepare`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Protocol

from statelm.sessions.storage import StoreSpace


class Area(StrEnum):
    """A part of the store: SESSIONS and SNAPSHOTS hold bundles, JOURNAL holds logs."""

    SESSIONS = "sessions"
    SNAPSHOTS = "snapshots"
    JOURNAL = "journal"


class StateStore(Protocol):
    """Bundles and logs kept across restarts, read and written in worker threads (every method may block)."""

    def prepare(self, area: Area, exclusive: bool) -> None:
        """Ready an area at start, removing what writers that died left half done (all of it when exclusive: no other
        process uses the store; else only what no running writer may still finish)."""
        ...

    def write_bundle(self, area: Area, name: str, files: Mapping[str, bytes]) -> None:
        """Make files the bundle's whole content, atomically and durably, replacing any bundle of that name."""
        ...

    def read_file(self, area: Area, name: str, file: str) -> bytes:
        """One file of a bundle."""
        ...

    def replace_file(self, area: Area, name: str, file: str, data: bytes) -> None:
        """Replace one file of an existing bundle, atomically and durably."""
        ...

    def delete_bundle(self, area: Area, name: str) -> None:
        """Remove a bundle and its files."""
        ...

    def bundle_exists(self, area: Area, name: str) -> bool:
        """Whether the area holds a bundle of that name."""
        ...

    def bundle_names(self, area: Area) -> list[str]:
        """The names of the area's bundles, sorted."""
        ...

    def bundle_size(self, area: Area, name: str) -> int:
        """Bytes of a bundle's files."""
        ...

    def append_log(self, name: str, data: bytes) -> int:
        """Append data to a log (made if there is none), durably before returning; the log's new size."""
        ...

    def replace_log(self, name: str, data: bytes) -> int:
        """Make data the log's whole content, atomically and durably; its size."""
        ...

    def read_log(self, name: str) -> bytes:
        """A log's whole content."""
        ...

    def truncate_log(self, name: str, size: int) -> None:
        """Cut a log to its first size bytes (a torn last append), durably."""
        ...

    def remove_log(self, name: str) -> None:
        """Remove a log durably; nothing if there is none."""
        ...

    def log_exists(self, name: str) -> bool:
        """Whether there is a log of that name."""
        ...

    def log_size(self, name: str) -> int:
        """Bytes of a log."""
        ...

    def log_names(self) -> list[str]:
        """The names of the logs, sorted."""
        ...

    def space(self) -> StoreSpace:
        """Where the store is, its condition (missing, read-only, full…) and its room, as its file system says now."""
        ...

    def private(self) -> StateStore:
        """A store beside this one that only this process uses: for what is never kept (spills without durability)."""
        ...

    def destroy(self) -> None:
        """Remove the store and everything in it, as far as possible (a private store, at close)."""
        ...
