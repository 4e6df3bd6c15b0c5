"""The session journal's format: framed JSON records, appended durably, read back torn-tail tolerant.

A session's journal is a log in the state store (statelm.sessions.state_store), in a state directory
`journal/<session_id>.journal`: a sequence of records, each

```
b"SLJ\\x01" | payload length (uint32, little endian) | CRC-32 of the payload (uint32) | payload (a JSON object)
```

A record is appended with one durable append. A crash mid-append leaves a torn last record: too short,
or failing its checksum. Reading drops it, and only it: a damaged record followed by a valid one is not a
torn append but a damaged journal, and reading refuses it (JournalCorruptError). The marker cannot occur
inside a payload (JSON escapes control characters), so "a valid record follows" is found by searching for
it. JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from statelm.sessions.errors import SessionError

MAGIC = b"SLJ\x01"
HEADER = struct.Struct("<4sII")


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


def decode_journal(data: bytes) -> JournalContents:
    """The records of a journal's bytes, a torn last record left out; JournalCorruptError for any other damage."""
    records: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        payload = _payload_at(data, offset)
        if payload is None:
            if _valid_record_after(data, offset):
                raise JournalCorruptError(f"the journal's record at byte {offset} is damaged and records follow it")
            return JournalContents(records, offset, len(data) - offset)
        try:
            record = json.loads(payload)
        except ValueError as exc:
            raise JournalCorruptError(f"the journal's record at byte {offset} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise JournalCorruptError(f"the journal's record at byte {offset} is not a JSON object")
        records.append(record)
        offset += HEADER.size + len(payload)
    return JournalContents(records, offset, 0)


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
