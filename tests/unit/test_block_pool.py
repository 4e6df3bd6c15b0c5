"""The KV block pool: allocation, reference counts, growth."""

from __future__ import annotations

import pytest

from statelm.engine.block_pool import BlockPool, OutOfBlocksError


def test_allocate_and_release_return_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.release(blocks)
    assert pool.num_free_blocks == 4


def test_allocating_too_many_raises_and_takes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=16)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_grow_covers_the_token_count_or_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=16)
    table: list[int] = []
    assert pool.grow(table, 17) and len(table) == 2
    assert pool.grow(table, 32) and len(table) == 2
    assert not pool.grow(table, 64)
    assert len(table) == 2 and pool.num_free_blocks == 1


def test_blocks_needed_rounds_up() -> None:
    pool = BlockPool(num_blocks=1, block_size=16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
