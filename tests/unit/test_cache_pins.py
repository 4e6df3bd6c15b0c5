"""Cache pins without a model: TTLs on an injected clock, refresh on hit, caps per owner and per pool, and the
pool's eviction order (unpinned cached blocks first, then whole pins, the one closest to expiry first)."""

from __future__ import annotations

from statelm.engine.block_pool import BlockPool
from statelm.engine.cache_pins import CachePinTable

FIVE_MINUTES = 300.0


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, max_blocks: int = 100, per_owner: int = 100) -> CachePinTable:
    """A pin table on clock with the given caps."""
    return CachePinTable(max_blocks=max_blocks, max_blocks_per_owner=per_owner, clock=clock)


def test_a_pin_expires_after_its_ttl_and_not_before() -> None:
    clock = Clock()
    pins = table(clock)
    assert pins.pin(key=7, blocks=[1, 2, 3], ttl_s=FIVE_MINUTES, owner="a") == [1, 2, 3]
    assert pins.seconds_to_next_expiry() == FIVE_MINUTES
    clock.now = FIVE_MINUTES - 1
    assert pins.expire() == [] and pins.is_pinned(1)
    clock.now = FIVE_MINUTES
    assert pins.expire() == [1, 2, 3]
    assert len(pins) == 0 and pins.num_pinned_blocks == 0 and pins.num_charged_blocks("a") == 0
    assert pins.counters.expired == 1 and pins.seconds_to_next_expiry() is None


def test_a_hit_starts_the_ttl_again() -> None:
    clock = Clock()
    pins = table(clock)
    pins.pin(7, [1, 2], FIVE_MINUTES, "a")
    clock.now = 200.0
    pins.hit(7)
    pins.hit(8)  # not a pinned prefix: nothing happens
    clock.now = 400.0
    assert pins.expire() == [] and pins.is_pinned(1)
    clock.now = 500.0
    assert pins.expire() == [1, 2]
    assert pins.counters.hits == 1


def test_pinning_a_pinned_prefix_again_refreshes_it_with_the_longer_ttl() -> None:
    clock = Clock()
    pins = table(clock)
    pins.pin(7, [1, 2], FIVE_MINUTES, "a")
    clock.now = 100.0
    assert pins.pin(7, [1, 2], 3600.0, "b") == []  # another key's breakpoint on the same prefix: no second charge
    assert pins.num_charged_blocks("b") == 0 and pins.counters.created == 1
    clock.now = 3699.0
    assert pins.expire() == []
    clock.now = 3700.0
    assert pins.expire() == [1, 2]


def test_nested_pins_charge_their_owner_each_block_once() -> None:
    pins = table(Clock(), per_owner=5)
    assert pins.pin(1, [10, 11], FIVE_MINUTES, "a") == [10, 11]
    assert pins.pin(2, [10, 11, 12, 13], FIVE_MINUTES, "a") == [12, 13]  # the longer prefix of the same system prompt
    assert pins.num_charged_blocks("a") == 4 and pins.num_pinned_blocks == 4
    assert pins.pin(3, [10, 11, 12, 13, 14, 15], FIVE_MINUTES, "a") is None  # a sixth block passes a's cap
    assert pins.counters.refused == 1
    assert pins.pin(4, [10, 11, 12, 13, 14], FIVE_MINUTES, "b") == [14]  # b pays for its own five
    assert pins.num_charged_blocks("b") == 5 and pins.num_pinned_blocks == 5


def test_the_pool_wide_cap_counts_distinct_blocks_of_every_owner() -> None:
    pins = table(Clock(), max_blocks=3)
    assert pins.pin(1, [10, 11], FIVE_MINUTES, "a") == [10, 11]
    assert pins.pin(2, [10, 11, 12], FIVE_MINUTES, "b") == [12]  # shares a's two blocks
    assert pins.pin(3, [20], FIVE_MINUTES, "c") is None
    assert pins.num_pinned_blocks == 3


def test_pressure_releases_the_pin_closest_to_expiry_that_frees_a_block() -> None:
    clock = Clock()
    pins = table(clock)
    pins.pin(1, [10, 11], FIVE_MINUTES, "a")
    clock.now = 10.0
    pins.pin(2, [20, 21], FIVE_MINUTES, "a")
    clock.now = 20.0
    pins.pin(3, [30], FIVE_MINUTES, "a")
    assert pins.release_under_pressure(free_blocks={20, 21, 30}) == [20, 21]  # pin 1 is in use: it would free nothing
    assert pins.release_under_pressure(free_blocks={30}) == [30]
    assert pins.release_under_pressure(free_blocks={99}) == []
    assert pins.counters.released_under_pressure == 2 and pins.is_pinned(10)


def pinned_pool(clock: Clock, num_blocks: int, max_pinned: int = 100) -> BlockPool:
    """A pool of two-token blocks whose pins run on clock."""
    return BlockPool(num_blocks, block_size=2, cache_pins=table(clock, max_blocks=max_pinned, per_owner=max_pinned))


def cache_and_pin(pool: BlockPool, tokens: list[int], pin: bool = True) -> list[int]:
    """Compute tokens into new blocks, publish them, pin their whole blocks if asked, and let go of them."""
    table = pool.allocate(pool.blocks_needed(len(tokens)))
    hashes = pool.register_full_blocks(tokens, table, [], len(tokens))
    if pin:
        assert pool.pin_prefix(hashes, FIVE_MINUTES, "a")
    pool.release(table)
    return table


def cached_tokens(pool: BlockPool, tokens: list[int]) -> int:
    """How many of tokens a request would read from the cache (the blocks it took are given back)."""
    blocks, _ = pool.match_prefix(tokens)
    pool.release(blocks)
    return len(blocks) * pool.block_size


def test_unpinned_cached_blocks_are_evicted_before_pinned_ones() -> None:
    pool = pinned_pool(Clock(), num_blocks=8)
    system = [1, 1, 2, 2, 3, 3]
    cache_and_pin(pool, system)
    cache_and_pin(pool, [5, 5, 6, 6], pin=False)
    assert pool.num_free_blocks == 8  # pinned blocks nobody uses are free: a request may have them
    held = pool.allocate(5)  # the three never used, then the two unpinned cached ones, never the pinned three
    assert cached_tokens(pool, [*system, 9]) == 6 and cached_tokens(pool, [5, 5, 6, 6, 9]) == 0
    pool.release(held)
    assert pool.cache_pins.counters.released_under_pressure == 0


def test_pressure_releases_a_pin_only_when_no_unpinned_block_is_free_and_its_tail_goes_first() -> None:
    pool = pinned_pool(Clock(), num_blocks=4)
    system = [1, 1, 2, 2, 3, 3]
    cache_and_pin(pool, system)
    first = pool.allocate(1)
    assert pool.cache_pins.counters.released_under_pressure == 0
    second = pool.allocate(1)  # no unpinned block left: the pin goes, and its last block is handed out first
    assert pool.cache_pins.counters.released_under_pressure == 1 and pool.cache_pins.num_pinned_blocks == 0
    assert cached_tokens(pool, [*system, 9]) == 4  # the head of the prefix is still cached
    pool.release(first + second)


def test_a_request_gets_the_blocks_of_pins_rather_than_waiting() -> None:
    pool = pinned_pool(Clock(), num_blocks=3)
    cache_and_pin(pool, [1, 1, 2, 2, 3, 3])
    assert pool.num_free_blocks == 3  # the pinned blocks nobody uses count as free: a request may have them
    assert len(pool.allocate(3)) == 3
    assert pool.num_free_blocks == 0 and len(pool.cache_pins) == 0


def test_blocks_in_use_stay_pinned_when_released() -> None:
    pool = pinned_pool(Clock(), num_blocks=4)
    system = [1, 1, 2, 2, 3, 3]
    cache_and_pin(pool, system)
    blocks, _ = pool.match_prefix([*system, 9])  # a request reads the pinned prefix
    assert pool.num_free_blocks == 1
    pool.release(blocks)
    other = pool.allocate(1)
    assert cached_tokens(pool, [*system, 9]) == 6 and pool.cache_pins.counters.hits == 2
    pool.release(other)


def test_expired_pins_are_evicted_before_other_cached_blocks() -> None:
    clock = Clock()
    pool = pinned_pool(clock, num_blocks=4)
    system = [1, 1, 2, 2]
    cache_and_pin(pool, system)
    cache_and_pin(pool, [5, 5, 6, 6], pin=False)  # released after the pinned prefix
    clock.now = FIVE_MINUTES
    pool.expire_cache_pins()
    assert pool.cache_pins.counters.expired == 1 and pool.cache_pins.num_pinned_blocks == 0
    held = pool.allocate(2)
    assert cached_tokens(pool, [*system, 9]) == 0 and cached_tokens(pool, [5, 5, 6, 6, 9]) == 4
    pool.release(held)


def test_a_hit_through_the_pool_refreshes_the_pin() -> None:
    clock = Clock()
    pool = pinned_pool(clock, num_blocks=4)
    system = [1, 1, 2, 2]
    cache_and_pin(pool, system)
    clock.now = 250.0
    assert cached_tokens(pool, [*system, 9]) == 4
    clock.now = 500.0
    pool.expire_cache_pins()
    assert pool.cache_pins.num_pinned_blocks == 2
    clock.now = 550.0
    pool.expire_cache_pins()
    assert pool.cache_pins.num_pinned_blocks == 0


def test_a_pin_over_the_cap_leaves_the_prefix_cached_unpinned() -> None:
    pool = pinned_pool(Clock(), num_blocks=4, max_pinned=1)
    tokens = [1, 1, 2, 2, 3]
    table = pool.allocate(pool.blocks_needed(len(tokens)))
    hashes = pool.register_full_blocks(tokens, table, [], len(tokens))
    assert not pool.pin_prefix(hashes, FIVE_MINUTES, "a")
    pool.release(table)
    assert cached_tokens(pool, tokens) == 4 and pool.cache_pins.counters.refused == 1
    pool.allocate(4)
    assert cached_tokens(pool, tokens) == 0


def test_a_pool_without_a_pin_table_pins_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    table = pool.allocate(2)
    hashes = pool.register_full_blocks([1, 1, 2, 2], table, [], 4)
    assert not pool.pin_prefix(hashes, FIVE_MINUTES, "a")
