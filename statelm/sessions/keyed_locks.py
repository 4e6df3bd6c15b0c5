"""Per-key asyncio locks that exist only while someone holds or waits for one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class KeyedLocks:
    """One asyncio lock per key, forgotten when its last holder or waiter leaves, so keys never pile up."""

    def __init__(self) -> None:
        self._locks: dict[str, _KeyLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold key's lock for the body (waiting for it if another task holds it)."""
        entry = self._locks.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)
