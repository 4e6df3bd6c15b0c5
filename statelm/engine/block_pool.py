"""Allocation of the paged KV cache's blocks: a free list plus reference counts."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than were asked for."""


class BlockPool:
    """Hands out block ids of the KV cache and takes them back when their last user lets go."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that nobody holds."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Number of blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take count free blocks, each with one reference."""
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds return to the free list."""
        for block in blocks:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend block_table in place to hold num_tokens tokens; False if the pool is too small now."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        block_table.extend(self.allocate(missing))
        return True
