"""The KV block pool: allocation, reference counts, and the prefix cache's index (no model)."""

from __future__ import annotations

import random

import pytest

from statelm.engine.block_pool import ROOT_HASH, BlockPool, OutOfBlocksError, common_prefix_length


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


def test_blocks_needed_rounds_up() -> None:
    pool = BlockPool(num_blocks=1, block_size=16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def cache_prompt(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate blocks for tokens as if a sequence had computed them all, and publish them."""
    table = pool.allocate(pool.blocks_needed(len(tokens)))
    pool.register_full_blocks(tokens, table, [], len(tokens))
    return table


def test_prefix_match_shares_full_blocks_and_leaves_the_last_token() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(12))
    table = cache_prompt(pool, tokens)
    blocks, hashes = pool.match_prefix(tokens)
    assert blocks == table[:2] and len(hashes) == 2  # 11 tokens may come from cache: two full blocks
    longer, _ = pool.match_prefix([*tokens, 99])
    assert longer == table
    other, _ = pool.match_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert other == table[:1]
    pool.release(table)
    pool.release(blocks)
    pool.release(longer)
    pool.release(other)
    assert pool.num_free_blocks == 8


def test_released_blocks_stay_reusable_until_handed_out_again() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    tokens = list(range(9))
    table = cache_prompt(pool, tokens)
    pool.release(table)
    assert pool.num_free_blocks == 3
    blocks, _ = pool.match_prefix(tokens)
    assert blocks == table[:2] and pool.num_free_blocks == 1
    pool.release(blocks)
    pool.allocate(3)  # evicts every cached block
    assert pool.match_prefix(tokens) == ([], [])


def test_least_recently_released_block_is_evicted_first() -> None:
    pool = BlockPool(num_blocks=5, block_size=2)
    first = cache_prompt(pool, [1, 1, 1])  # two blocks each, one block never used
    second = cache_prompt(pool, [2, 2, 2])
    pool.release(first)
    pool.release(second)
    pool.allocate(1)  # the never-used block
    pool.allocate(1)  # then first's full block, released before second's
    assert pool.match_prefix([1, 1, 1])[0] == []
    assert pool.match_prefix([2, 2, 2])[0] == second[:1]


def test_hash_collision_is_caught_by_the_stored_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import statelm.engine.block_pool as block_pool

    monkeypatch.setattr(block_pool, "chain_hash", lambda previous, tokens: 42)
    pool = BlockPool(num_blocks=4, block_size=2)
    cache_prompt(pool, [1, 2, 3])
    assert pool.match_prefix([7, 8, 9])[0] == []


def test_prefix_caching_can_be_turned_off() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=False)
    cache_prompt(pool, [1, 2, 3])
    assert pool.match_prefix([1, 2, 3]) == ([], [])


def test_a_prompt_parting_inside_a_block_takes_the_cached_block_agreeing_longest() -> None:
    pool = BlockPool(num_blocks=12, block_size=4)
    held = [
        cache_prompt(pool, [0, 1, 2, 3, *rest]) for rest in ([5, 6, 7, 8], [5, 6, 9, 9], [5, 7, 7, 7], [4, 4, 4, 4])
    ]
    blocks, hashes = pool.match_prefix([0, 1, 2, 3, 5, 6, 9, 1, 1])
    assert blocks == held[0][:1]
    source, copy, count = pool.take_partial(hashes[-1], [5, 6, 9, 1])
    assert (source, count) == (held[1][1], 3) and copy not in {b for table in held for b in table}
    assert pool.hit_tokens == 4 + 3
    assert pool.take_partial(hashes[-1], [6, 6, 6, 6]) == (-1, -1, 0)  # no cached block agrees on its first token
    assert pool.take_partial(hashes[-1], [5])[2] == 1  # the tokens left to take may be fewer than a block's
    assert pool.take_partial(hashes[-1], []) == (-1, -1, 0)


def test_a_refresh_s_lookups_are_not_counted() -> None:
    pool = BlockPool(num_blocks=12, block_size=4)
    cache_prompt(pool, [0, 1, 2, 3, 4, 5, 6, 7])
    cache_prompt(pool, [0, 1, 2, 3, 5, 6, 9, 9])
    blocks, hashes = pool.match_prefix([0, 1, 2, 3, 5, 6, 7, 1, 1], counted=False)
    assert len(blocks) == 1 and pool.take_partial(hashes[-1], [5, 6, 7, 1], counted=False)[2] == 2
    assert (pool.queried_tokens, pool.hit_tokens) == (0, 0)  # the engine's own work: neither queried nor hit


def test_a_partly_agreeing_block_is_found_until_it_is_handed_out_again() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    table = cache_prompt(pool, [1, 2, 3, 4])
    pool.release(table)
    source, copy, count = pool.take_partial(ROOT_HASH, [1, 9])
    assert (source, count) == (table[0], 1) and copy not in table  # the source itself is not handed out as the copy
    pool.release([copy])
    pool.allocate(3)  # evicts every cached block
    assert pool.take_partial(ROOT_HASH, [1, 9]) == (-1, -1, 0)


def test_a_partly_agreeing_block_is_not_copied_without_a_free_block() -> None:
    pool = BlockPool(num_blocks=1, block_size=2)
    table = cache_prompt(pool, [1, 2])
    pool.release(table)  # the only free block is the source
    assert pool.take_partial(ROOT_HASH, [1, 9]) == (-1, -1, 0)
    assert pool.num_free_blocks == 1 and pool.match_prefix([1, 2, 0])[0] == table


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


@pytest.mark.parametrize("seed", range(4))
def test_common_prefix_length_is_where_two_token_lists_first_differ(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        first = [rng.randrange(3) for _ in range(rng.randrange(300))]
        second = first[: rng.randrange(len(first) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(300))]
        length = min(len(first), len(second))
        expected = next((i for i in range(length) if first[i] != second[i]), length)
        assert common_prefix_length(first, second) == common_prefix_length(second, first) == expected
