"""The session journal's file format: framed JSON records, appended and fsynced, read back torn-tail tolerant.

`<state-dir>/journal/<session_id>.journal` is a sequence of records, each

```
b"SLJ\\x01" | payload length (uint32, little endian) | CRC-32 of the payload (uint32) | payload (a JSON object)
```

A record is appended with one write and fsynced. A crash mid-append leaves a torn last record: too short,
or failing its checksum. Reading drops it, and only it: a damaged record followed by a valid one is not a
torn append but a damaged file, and reading refuses it (JournalCorruptError). The marker cannot occur
inside a payload (JSON escapes control characters), so "a valid record follows" is found by searching for
it. JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statelm.sessions.errors import SessionError
from statelm.sessions.synced_files import fsync_directory, write_synced
from statelm.sessions.temporaries import TEMP_PREFIX, temporary_path

MAGIC = b"SLJ\x01"
HEADER = struct.Struct("<4sII")
SUFFIX = ".journal"


class JournalCorruptError(SessionError):
    """A journal damaged other than by a torn last append, or holding records that do not make sense."""

    code = "journal_corrupt"


@dataclass
class JournalContents:
    """The valid records of a journal, how many bytes they take, and the bytes of a torn last record after them."""

    records: list[dict[str, Any]]
    valid_bytes: int
    torn_bytes: int


def encode_record(payload: dict[str, Any]) -> bytes:
    """One framed record holding payload."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data


def append_record(path: Path, record: bytes) -> int:
    """Append an encoded record and fsync it (and the directory, if the file is new); the file's new size."""
    created = not path.exists()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(record)
        while view:
            view = view[os.write(descriptor, view) :]
        os.fsync(descriptor)
        size = os.fstat(descriptor).st_size
    finally:
        os.close(descriptor)
    if created:
        fsync_directory(path.parent)
    return size


def replace_journal(path: Path, record: bytes) -> int:
    """Make record the journal's only content, atomically (temporary file, fsync, rename); the new size."""
    temporary = temporary_path(path.parent, TEMP_PREFIX, path.name)
    write_synced(temporary, record)
    os.replace(temporary, path)
    fsync_directory(path.parent)
    return len(record)


def remove_journal(path: Path) -> None:
    """Delete a journal durably; nothing if there is none."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_directory(path.parent)


def read_journal(path: Path) -> JournalContents:
    """The records of a journal, a torn last record left out; JournalCorruptError for any other damage."""
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        payload = _payload_at(data, offset)
        if payload is None:
            if _valid_record_after(data, offset):
                raise JournalCorruptError(f"{path.name}: the record at byte {offset} is damaged and records follow it")
            return JournalContents(records, offset, len(data) - offset)
        try:
            record = json.loads(payload)
        except ValueError as exc:
            raise JournalCorruptError(f"{path.name}: the record at byte {offset} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise JournalCorruptError(f"{path.name}: the record at byte {offset} is not a JSON object")
        records.append(record)
        offset += HEADER.size + len(payload)
    return JournalContents(records, offset, 0)


def truncate_journal(path: Path, size: int) -> None:
    """Cut a journal to its first size bytes (dropping a torn record) and fsync it."""
    with path.open("r+b") as file:
        file.truncate(size)
        file.flush()
        os.fsync(file.fileno())


def _payload_at(data: bytes, offset: int) -> bytes | None:
    """The payload of the record at offset if it is whole and passes its checksum, else None."""
    end_of_header = offset + HEADER.size
    if end_of_header > len(data):
        return None
    magic, length, checksum = HEADER.unpack_from(data, offset)
    payload = data[end_of_header : end_of_header + length]
    if magic != MAGIC or len(payload) != length or zlib.crc32(payload) != checksum:
        return None
    return payload


def _valid_record_after(data: bytes, offset: int) -> bool:
    """Whether a whole, valid record starts anywhere after offset."""
    start = data.find(MAGIC, offset + 1)
    while start != -1:
        if _payload_at(data, start) is not None:
            return True
        start = data.find(MAGIC, start + 1)
    return False
