"""The one owner of the paged KV cache's block tables and of the references they hold.

Every run of KV blocks, a sequence's or a session's, is a `BlockTable` that only the KVManager changes: it grows a
table for new tokens, starts one from the prefix cache or from another table (whole blocks shared, a partly filled
last block copied: copy on write), publishes a table's computed full blocks to the prefix cache and pins prefixes of
it there, parks the computed part of a table when a session turn ends, and frees tables. The block pool below it
counts the references and keeps the prefix cache's index; the KV cache holds the blocks' contents, which the manager
copies (copy on write) and moves to and from host memory (a session's export and load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from statelm.engine.block_pool import ROOT_HASH, BlockPool
from statelm.engine.cache_pins import CachePinRequest
from statelm.engine.kv_cache import KVCache


@dataclass(eq=False)
class BlockTable:
    """KV blocks holding a run of tokens in order, and the chained hashes of its full blocks published so far.

    A sequence or a session holds one as its handle on the pool; anyone may read it, only the KVManager changes it.
    """

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class KVManager:
    """Allocates, shares, publishes, parks and frees the blocks of every BlockTable."""

    def __init__(self, pool: BlockPool, kv_cache: KVCache) -> None:
        self.pool = pool
        self.kv_cache = kv_cache

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.pool.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Number of blocks that hold num_tokens tokens."""
        return self.pool.blocks_needed(num_tokens)

    def missing_blocks(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks table lacks to hold num_tokens tokens."""
        return self.pool.blocks_needed(num_tokens) - len(table.blocks)

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Give table the blocks it lacks to hold num_tokens tokens; False (and nothing taken) if too few are free."""
        missing = self.missing_blocks(table, num_tokens)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        table.blocks.extend(self.pool.allocate(missing))
        return True

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Free table's blocks past those holding its first num_tokens tokens (a draft's rows that were not taken)."""
        keep = self.pool.blocks_needed(num_tokens)
        self.pool.release(table.blocks[keep:])
        del table.blocks[keep:]

    def start_from_cache(self, table: BlockTable, tokens: Sequence[int], counted: bool = True) -> int:
        """Fill the empty table with the prefix cache's blocks of the longest cached prefix of tokens (leaving at
        least one token to compute): whole blocks shared, then the first tokens of the block after them copied from
        the cached block that agrees longest with them (if the pool has the blocks for the rest of tokens); the number
        of tokens it holds. counted: a request's lookup (BlockPool.match_prefix), not a refresh's."""
        table.blocks, table.hashes = self.pool.match_prefix(tokens, counted)
        start = len(table.blocks) * self.pool.block_size
        if self.missing_blocks(table, len(tokens)) > self.pool.num_free_blocks:
            return start  # a prompt the pool cannot hold yet waits: a copy for it would evict a cached block each try
        previous = table.hashes[-1] if table.hashes else ROOT_HASH
        source, copy, count = self.pool.take_partial(
            previous, tokens[start : min(len(tokens) - 1, start + self.block_size)], counted
        )
        if count:
            self.kv_cache.copy_block(source, copy)
            table.blocks.append(copy)
        return start + count

    def start_from(self, table: BlockTable, source: BlockTable, num_tokens: int) -> int:
        """Fill the empty table with source's first num_tokens tokens: whole blocks shared, a partly filled last
        block copied (so that table never writes into source's blocks) if a block is free, else left out; the number
        of tokens table holds."""
        full, partial = divmod(num_tokens, self.pool.block_size)
        table.blocks = list(source.blocks[:full])
        table.hashes = list(source.hashes[:full])
        self.pool.retain(table.blocks)
        if not partial or not self.pool.num_free_blocks:
            return full * self.pool.block_size
        (copy,) = self.pool.allocate(1)
        self.kv_cache.copy_block(source.blocks[full], copy)
        table.blocks.append(copy)
        return num_tokens

    def share(self, source: BlockTable) -> BlockTable:
        """A new table holding the very blocks of source (one more reference each), for a reader that never writes."""
        self.pool.retain(source.blocks)
        return BlockTable(list(source.blocks), list(source.hashes))

    def park(self, table: BlockTable, num_tokens: int) -> BlockTable:
        """Move the blocks holding table's first num_tokens tokens into a new table, freeing the rest; table is left
        empty (a session turn that ended keeps what it computed)."""
        self.trim(table, num_tokens)
        parked = BlockTable(table.blocks, table.hashes)
        table.blocks, table.hashes = [], []
        return parked

    def free(self, table: BlockTable, exported: bool = False) -> None:
        """Let go of table's blocks and empty it. exported: its blocks may still be read by an export (a session's),
        which later forwards on a GPU wait for before they overwrite them."""
        if exported:
            self.kv_cache.fence_reads(table.blocks)
        self.pool.release(table.blocks)
        table.blocks, table.hashes = [], []

    def num_sole_references(self, table: BlockTable) -> int:
        """How many of table's blocks would become free if it were freed."""
        return self.pool.num_sole_references(table.blocks)

    def publish(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        """Enter the full blocks among table's first num_computed tokens into the prefix cache."""
        table.hashes.extend(self.pool.register_full_blocks(tokens, table.blocks, table.hashes, num_computed))

    def pin_published(self, table: BlockTable, pending: list[CachePinRequest]) -> None:
        """Pin each prefix asked for (shortest first) whose whole blocks table has published; those are taken out of
        pending, the rest wait for more blocks."""
        size = self.pool.block_size
        while pending and pending[0].num_tokens // size <= len(table.hashes):
            request = pending.pop(0)
            self.pool.pin_prefix(table.hashes[: request.num_tokens // size], request.ttl_s, request.owner)

    def expire_cache_pins(self) -> None:
        """Release the cache pins whose TTL has run out."""
        self.pool.expire_cache_pins()

    def gather(
        self, table: BlockTable, num_tokens: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event | None]:
        """K and V of table's first num_tokens tokens, per layer on the host (see KVCache.gather)."""
        return self.kv_cache.gather(table.blocks, num_tokens)

    def load(
        self,
        tokens: Sequence[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ready: torch.cuda.Event | None,
    ) -> BlockTable:
        """A new table of tokens whose K and V (per layer, [tokens, heads, dim]) are written into newly allocated
        blocks once ready fires, its full blocks published; the caller has made room."""
        table = BlockTable(self.pool.allocate(self.pool.blocks_needed(len(tokens))))
        self.kv_cache.scatter(table.blocks, keys, values, ready)
        self.publish(table, tokens, len(tokens))
        return table
