"""Allocation of the paged KV cache's blocks: reference counts, an LRU of free blocks, and the prefix cache.

A full block is identified by the hash of its tokens chained with the previous block's hash, so equal
hashes mean equal prefixes; the tokens are kept as well to rule out collisions. The cached blocks that follow one
hash are also kept sorted by their tokens, so that a prompt which parts from every cached one inside a block finds
the cached block sharing most of that block's first tokens (two neighbours in that order) and may copy them
instead of computing them, as llama.cpp's slots reuse a prompt to the token. A block whose last user
lets go keeps its contents and hash in the free LRU until it is handed out again, so a later request
with the same prefix can take it back instead of recomputing it.

Blocks of a pinned prefix (see `cache_pins.py`) that nobody holds wait apart from that LRU: they are free, but handed
out only when no unpinned free block is left, and then a whole pin is released first (the one closest to
expiry), its blocks going to the front of the LRU, last block first, so that its prefix shrinks from the end.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from statelm.engine.cache_pins import CachePinTable

ROOT_HASH = 0


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists, or two tuples (runs of 64 compared at once, then the
    differing run token by token: the scheduler asks this of every new prompt against those being computed, each
    step)."""
    limit = min(len(first), len(second))
    start = 0
    while start < limit and first[start : start + 64] == second[start : start + 64]:
        start += 64
    for index in range(start, min(start + 64, limit)):
        if first[index] != second[index]:
            return index
    return limit


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than were asked for."""


def chain_hash(previous: int, tokens: Sequence[int]) -> int:
    """Hash of one full block's tokens, chained with the hash of the block before it."""
    return xxhash.xxh3_64_intdigest(previous.to_bytes(8, "little") + array("q", tokens).tobytes())


class BlockPool:
    """Hands out KV block ids, takes them back, and finds cached blocks for a token prefix."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_pins: CachePinTable | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # None: a table that admits no pin
        self.cache_pins = cache_pins if cache_pins is not None else CachePinTable(max_blocks=0, max_blocks_per_owner=0)
        self._refcounts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_pinned: dict[int, None] = {}  # free blocks that a pin keeps: handed out after every other
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        self._parent_of: list[int] = [ROOT_HASH] * num_blocks  # chained hash of the block before a cached one
        self._followers: dict[int, list[tuple[tuple[int, ...], int]]] = {}  # hash -> (tokens, block), sorted
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that nobody holds (some may still hold reusable cached contents, some of them pinned)."""
        return len(self._free) + len(self._free_pinned)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Number of blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take count free blocks, least recently released first and pinned ones last, each with one reference."""
        if count > self.num_free_blocks:
            raise OutOfBlocksError(f"need {count} KV blocks, {self.num_free_blocks} free")
        while len(self._free) < count:
            self._unpin(self.cache_pins.release_under_pressure(self._free_pinned))
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refcounts[block] = 1
            blocks.append(block)
        return blocks

    def retain(self, blocks: list[int]) -> None:
        """Add one reference to each block, which must be held already."""
        for block in blocks:
            self._refcounts[block] += 1

    def num_sole_references(self, blocks: list[int]) -> int:
        """How many of blocks would become free if their holder released them."""
        return sum(self._refcounts[block] == 1 for block in blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go to the end of the free LRU (or wait pinned)."""
        for block in blocks:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                (self._free_pinned if self.cache_pins.is_pinned(block) else self._free)[block] = None

    def match_prefix(self, tokens: Sequence[int], counted: bool = True) -> tuple[list[int], list[int]]:
        """Cached blocks holding the longest prefix of tokens (leaving at least one token to compute).

        Returns the blocks, each now referenced once more, and their chained hashes. counted: a request's lookup,
        which the hit counters and the cache pins' hits count (not the engine's own refreshes).
        """
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        previous = ROOT_HASH
        size = self.block_size
        for start in range(0, len(tokens) - 1 - size + 1, size):
            chunk = tuple(tokens[start : start + size])
            digest = chain_hash(previous, chunk)
            block = self._block_of_hash.get(digest)
            if block is None or self._tokens_of[block] != chunk:
                break
            blocks.append(block)
            hashes.append(digest)
            previous = digest
        for block in blocks:
            self.hold(block)
        if not counted:
            return blocks, hashes
        if self.cache_pins:
            for digest in hashes:
                self.cache_pins.hit(digest)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(blocks) * size
        return blocks, hashes

    def take_partial(self, previous: int, tokens: Sequence[int], counted: bool = True) -> tuple[int, int, int]:
        """For tokens (at most a block's) that follow the chained hash previous: the cached block whose first tokens
        agree longest with them, a newly allocated block for the caller to copy that many of its tokens into, and the
        count; (-1, -1, 0) if none agrees or no other block is free. counted: as match_prefix's."""
        followers = self._followers.get(previous) if tokens else None
        if not followers:
            return -1, -1, 0
        wanted = tuple(tokens)
        index = bisect_left(followers, (wanted,))  # the longest agreement is with a neighbour in sorted order
        source, count = -1, 0
        for cached, block in followers[max(index - 1, 0) : index + 1]:
            agreed = common_prefix_length(cached, wanted)
            if agreed > count:
                source, count = block, agreed
        if not count:
            return -1, -1, 0
        self.hold(source)  # so that it is not the block handed out
        copy = self.allocate(1)[0] if self.num_free_blocks else -1
        self.release([source])
        if copy < 0:
            return -1, -1, 0
        self.hit_tokens += count if counted else 0
        return source, copy, count

    def hold(self, block: int) -> None:
        """Add one reference to a block, held or cached, taking a free one out of the free lists."""
        self._refcounts[block] += 1
        self._free.pop(block, None)
        self._free_pinned.pop(block, None)

    def register_full_blocks(
        self, tokens: Sequence[int], block_table: Sequence[int], block_hashes: Sequence[int], num_computed: int
    ) -> list[int]:
        """Publish the computed full blocks of a table past the block_hashes it has published; their chained hashes."""
        new_hashes: list[int] = []
        if not self.enable_prefix_caching:
            return new_hashes
        size = self.block_size
        previous = block_hashes[-1] if block_hashes else ROOT_HASH
        for index in range(len(block_hashes), num_computed // size):
            chunk = tuple(tokens[index * size : (index + 1) * size])
            digest = chain_hash(previous, chunk)
            block = block_table[index]
            if digest not in self._block_of_hash and self._hash_of[block] is None:
                self._block_of_hash[digest] = block
                self._hash_of[block] = digest
                self._tokens_of[block] = chunk
                self._parent_of[block] = previous
                insort(self._followers.setdefault(previous, []), (chunk, block))
            new_hashes.append(digest)
            previous = digest
        return new_hashes

    def pin_prefix(self, hashes: Sequence[int], ttl_s: float, owner: str) -> bool:
        """Pin the cached prefix whose full blocks have these chained hashes; False if not all cached or over a cap."""
        if not hashes or any(digest not in self._block_of_hash for digest in hashes):
            return False
        blocks = [self._block_of_hash[digest] for digest in hashes]
        newly_pinned = self.cache_pins.pin(hashes[-1], blocks, ttl_s, owner)
        if newly_pinned is None:
            return False
        for block in newly_pinned:
            if block in self._free:  # a cached block nobody holds
                del self._free[block]
                self._free_pinned[block] = None
        return True

    def expire_cache_pins(self) -> None:
        """Release the pins whose TTL has run out (nothing to do, at once, without pins)."""
        if self.cache_pins:
            self._unpin(self.cache_pins.expire())

    def _unpin(self, blocks: list[int]) -> None:
        """Blocks no pin holds any more: the free ones go to the front of the LRU, last block of a prefix first."""
        for block in blocks:
            if block in self._free_pinned:
                del self._free_pinned[block]
                self._free[block] = None
                self._free.move_to_end(block, last=False)

    def _forget(self, block: int) -> None:
        """Drop a block's cached identity before it is reused for other tokens."""
        digest = self._hash_of[block]
        if digest is not None:
            if self._block_of_hash.get(digest) == block:
                del self._block_of_hash[digest]
            followers = self._followers[self._parent_of[block]]
            del followers[bisect_left(followers, (self._tokens_of[block],))]
            if not followers:
                del self._followers[self._parent_of[block]]
            self._hash_of[block] = None
            self._tokens_of[block] = None
