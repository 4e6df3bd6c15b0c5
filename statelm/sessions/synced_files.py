"""Writes that survive a crash: a file's content fsynced, and a directory fsynced after an entry changes in it."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    """Write data as the file at path and fsync it."""
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_directory(directory: Path) -> None:
    """Make the creation, rename or removal of an entry in directory durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
