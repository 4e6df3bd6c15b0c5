"""Cache pins: prompt prefixes whose cached KV blocks other traffic may not evict until their TTL runs out.

A pin names a prefix by the chained hash of its last full block (which stands for every block before it) and
lists the blocks that hold the prefix. It holds no reference: a pinned block nobody computes with is free, and the
block pool hands it out only once no unpinned free block is left, releasing whole pins for it, the one closest to
expiry first. Each hit on a pinned prefix pushes its expiry back by its TTL; pins whose TTL has run out are
released on the engine thread. Pins are charged to an owner (an API key): the distinct blocks an owner's pins hold
count against a per-owner cap, and the distinct blocks of all pins against a pool-wide cap; a pin that would pass
either is not made (its prefix stays in the cache unpinned, like any other).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CachePinRequest:
    """A request's ask: pin the whole KV blocks of its prompt's first num_tokens tokens for ttl_s, charged to owner."""

    num_tokens: int
    ttl_s: float
    owner: str


@dataclass
class CachePin:
    """A pinned prefix: its blocks in order, who pays for them, its TTL and when it runs out."""

    blocks: tuple[int, ...]
    owner: str
    ttl_s: float
    expires_at: float


@dataclass
class CachePinCounters:
    """What the pin table has done since start-up, for /metrics."""

    created: int = 0
    hits: int = 0  # pinned prefixes that a request found whole in the cache (each pin a request covers counts)
    expired: int = 0
    released_under_pressure: int = 0
    refused: int = 0  # pins not made because the owner's or the pool's cap was reached


class CachePinTable:
    """Pins by prefix, how many pins hold each block, what each owner is charged, and when the next pin expires."""

    def __init__(self, max_blocks: int, max_blocks_per_owner: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.max_blocks_per_owner = max_blocks_per_owner
        self.clock = clock
        self.counters = CachePinCounters()
        self._pins: dict[int, CachePin] = {}
        self._holders: Counter[int] = Counter()  # block -> pins that hold it
        self._charged: dict[str, Counter[int]] = {}  # owner -> block -> that owner's pins that hold it
        self._next_expiry = math.inf  # no pin expires before this (refreshes may have pushed them all later)

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks that some pin holds."""
        return len(self._holders)

    def num_charged_blocks(self, owner: str) -> int:
        """Distinct blocks that owner's pins hold."""
        return len(self._charged.get(owner, ()))

    def is_pinned(self, block: int) -> bool:
        """Whether some pin holds block."""
        return block in self._holders

    def pin(self, key: int, blocks: Sequence[int], ttl_s: float, owner: str) -> list[int] | None:
        """Pin blocks as the prefix key for ttl_s (an existing pin of key is refreshed, its TTL the longer one).

        Returns the blocks no pin held before, or None when the pin would pass owner's or the pool's cap.
        """
        now = self.clock()
        existing = self._pins.get(key)
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            existing.expires_at = max(existing.expires_at, now + ttl_s)
            return []
        charged = self._charged.get(owner, Counter())
        new_blocks = [block for block in blocks if block not in self._holders]
        new_to_owner = sum(block not in charged for block in blocks)
        if (
            len(self._holders) + len(new_blocks) > self.max_blocks
            or len(charged) + new_to_owner > self.max_blocks_per_owner
        ):
            self.counters.refused += 1
            return None
        self._pins[key] = CachePin(tuple(blocks), owner, ttl_s, now + ttl_s)
        self._holders.update(blocks)
        charged.update(blocks)
        self._charged[owner] = charged
        self._next_expiry = min(self._next_expiry, now + ttl_s)
        self.counters.created += 1
        return new_blocks

    def hit(self, key: int) -> None:
        """A request reused the prefix key from the cache: if it is pinned, its TTL starts again."""
        pin = self._pins.get(key)
        if pin is not None:
            pin.expires_at = max(pin.expires_at, self.clock() + pin.ttl_s)
            self.counters.hits += 1

    def expire(self) -> list[int]:
        """Release every pin whose TTL has run out; the blocks that no pin holds any more."""
        if not self._pins:
            return []
        now = self.clock()
        if now < self._next_expiry:
            return []
        expired = [key for key, pin in self._pins.items() if pin.expires_at <= now]
        self.counters.expired += len(expired)
        unpinned = [block for key in expired for block in self._drop(key)]
        self._next_expiry = min((pin.expires_at for pin in self._pins.values()), default=math.inf)
        return unpinned

    def seconds_to_next_expiry(self) -> float | None:
        """How long until a pin may expire (0 if one may have already); None without pins."""
        if not self._pins:
            return None
        return max(0.0, self._next_expiry - self.clock())

    def release_under_pressure(self, free_blocks: Container[int]) -> list[int]:
        """Release the pin closest to expiry among those holding one of free_blocks; the blocks no pin holds now.

        Pins whose blocks are all in use are kept: releasing them would free nothing. Empty if no pin qualifies.
        """
        candidates = [
            (pin.expires_at, key)
            for key, pin in self._pins.items()
            if any(block in free_blocks for block in pin.blocks)
        ]
        if not candidates:
            return []
        self.counters.released_under_pressure += 1
        return self._drop(min(candidates)[1])

    def _drop(self, key: int) -> list[int]:
        """Forget the pin of key and its charge; the blocks that no other pin holds, in prefix order."""
        pin = self._pins.pop(key)
        charged = self._charged[pin.owner]
        unpinned = []
        for block in pin.blocks:
            for counts in (charged, self._holders):
                counts[block] -= 1
                if not counts[block]:
                    del counts[block]
            if block not in self._holders:
                unpinned.append(block)
        if not charged:
            del self._charged[pin.owner]
        return unpinned
