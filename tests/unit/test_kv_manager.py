"""The KVManager with no model: growth, the prefix cache, copy on write, parking, pins; and that it alone changes
block tables."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from statelm.engine.cache_pins import CachePinRequest, CachePinTable
from statelm.engine.kv_manager import BlockTable, KVManager
from tests.unit.kv_managers import kv_manager

PACKAGE = Path(__file__).resolve().parents[2] / "statelm"
OWNER = PACKAGE / "engine" / "kv_manager.py"
TABLE_ATTRIBUTES = {"block_table", "blocks", "hashes"}  # a sequence's handle, and a table's two lists
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"}


def computed(kv: KVManager, tokens: list[int]) -> BlockTable:
    """A table of tokens as a sequence that computed them all leaves it: grown and published."""
    table = BlockTable()
    assert kv.grow(table, len(tokens))
    kv.publish(table, tokens, len(tokens))
    return table


def test_grow_covers_the_token_count_or_takes_nothing() -> None:
    kv = kv_manager(3, 16)
    table = BlockTable()
    assert kv.grow(table, 17) and len(table.blocks) == 2
    assert kv.grow(table, 32) and len(table.blocks) == 2
    assert not kv.grow(table, 64) and kv.missing_blocks(table, 64) == 2
    assert len(table.blocks) == 2 and kv.num_free_blocks == 1
    kv.free(table)
    assert table.blocks == [] and kv.num_free_blocks == 3


def test_a_prompt_starts_from_its_longest_cached_prefix_and_computes_its_last_token() -> None:
    kv = kv_manager(8, 4)
    tokens = list(range(12))
    first = computed(kv, tokens)
    assert len(first.hashes) == 3
    again = BlockTable()
    assert kv.start_from_cache(again, tokens) == 11  # two full blocks and 3 tokens copied: the last one is computed
    assert again.blocks[:2] == first.blocks[:2] and again.hashes == first.hashes[:2]
    assert len(again.blocks) == 3 and again.blocks[2] != first.blocks[2]
    longer = BlockTable()
    assert kv.start_from_cache(longer, [*tokens, 99]) == 12 and longer.blocks == first.blocks
    other = BlockTable()
    assert kv.start_from_cache(other, [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4
    for table in (first, again, longer, other):
        kv.free(table)
    assert kv.num_free_blocks == 8
    assert kv.start_from_cache(BlockTable(), [*tokens, 99]) == 12  # freed blocks stay cached until reused


def test_a_prompt_copies_the_first_tokens_it_shares_with_a_cached_block() -> None:
    kv = kv_manager(8, 4)
    first = computed(kv, [0, 1, 2, 3, 4, 5, 6, 7])
    kv.kv_cache.k[0][first.blocks[1], ..., :4] = torch.tensor([4.0, 5.0, 6.0, 7.0])  # keys: [blocks, heads, dim, block]
    table = BlockTable()
    assert kv.start_from_cache(table, [0, 1, 2, 3, 4, 5, 9, 9, 9]) == 6
    assert (
        table.blocks[0] == first.blocks[0] and table.blocks[1] != first.blocks[1] and table.hashes == first.hashes[:1]
    )
    assert kv.kv_cache.k[0][table.blocks[1], ..., :2].flatten().tolist() == [4.0, 5.0]
    kv.free(first)
    kv.free(table)
    assert kv.num_free_blocks == 8


def test_a_prompt_the_pool_cannot_hold_yet_copies_nothing_and_evicts_no_cached_block() -> None:
    kv = kv_manager(3, 4)
    for tokens in ([0, 1, 2, 3, 4, 5, 6, 7], [100, 101, 102, 103]):
        kv.free(computed(kv, tokens))  # every block cached and free, the first prompt's released first
    table = BlockTable()
    assert kv.start_from_cache(table, [0, 1, 2, 3, 4, 5, *[9] * 7]) == 4  # needs 4 blocks: only the whole one shared
    kv.free(table)
    assert kv.start_from_cache(BlockTable(), [100, 101, 102, 103, 7]) == 4  # still cached


def test_start_from_shares_whole_blocks_and_copies_the_partly_filled_one() -> None:
    kv = kv_manager(8, 4)
    source = computed(kv, list(range(10)))  # [0-3] [4-7] [8,9]
    kv.kv_cache.k[0][source.blocks[2], ..., :2] = torch.tensor([8.0, 9.0])  # keys: [blocks, heads, dim, block]
    table = BlockTable()
    assert kv.start_from(table, source, 10) == 10
    assert table.blocks[:2] == source.blocks[:2] and table.blocks[2] != source.blocks[2]
    assert table.hashes == source.hashes[:2]
    assert kv.kv_cache.k[0][table.blocks[2], ..., :2].flatten().tolist() == [8.0, 9.0]
    kv.free(source)
    assert kv.num_free_blocks == 8 - 3  # the shared two and the copy stay held by table
    kv.free(table)
    assert kv.num_free_blocks == 8


def test_start_from_leaves_the_partial_block_out_when_no_block_is_free() -> None:
    kv = kv_manager(3, 4)
    source = computed(kv, list(range(10)))
    table = BlockTable()
    assert kv.start_from(table, source, 10) == 8 and table.blocks == source.blocks[:2]


def test_park_keeps_the_computed_blocks_and_empties_the_table() -> None:
    kv = kv_manager(8, 4)
    table = computed(kv, list(range(10)))
    assert kv.grow(table, 16)  # room for tokens not computed yet
    parked = kv.park(table, 10)
    assert table.blocks == [] and table.hashes == [] and len(parked.blocks) == 3
    assert kv.num_free_blocks == 5
    shared = kv.share(parked)
    assert shared.blocks == parked.blocks and kv.num_sole_references(parked) == 0
    kv.free(parked, exported=True)
    assert kv.num_free_blocks == 5 and kv.num_sole_references(shared) == 3


def test_prefixes_are_pinned_once_their_blocks_are_published() -> None:
    kv = kv_manager(8, 2, cache_pins=CachePinTable(max_blocks=8, max_blocks_per_owner=8))
    pending = [CachePinRequest(2, 60.0, "a"), CachePinRequest(6, 60.0, "a")]
    table = BlockTable()
    tokens = [1, 1, 2, 2, 3, 3, 4]
    assert kv.grow(table, len(tokens))
    kv.publish(table, tokens, 3)
    kv.pin_published(table, pending)
    assert [request.num_tokens for request in pending] == [6] and kv.pool.cache_pins.num_pinned_blocks == 1
    kv.publish(table, tokens, 7)
    kv.pin_published(table, pending)
    assert pending == [] and kv.pool.cache_pins.num_pinned_blocks == 3


def test_load_then_gather_round_trips_a_sessions_kv() -> None:
    kv = kv_manager(8, 4, layers=2, head_dim=2)
    tokens = [5, 6, 7, 8, 9, 10]
    keys = [torch.arange(12, dtype=torch.float32).view(6, 1, 2) + layer for layer in range(2)]
    values = [key + 0.5 for key in keys]
    table = kv.load(tokens, keys, values, None)
    assert len(table.blocks) == 2 and len(table.hashes) == 1  # one full block published
    gathered_keys, gathered_values, ready = kv.gather(table, len(tokens))
    assert ready is None
    for ours, theirs in zip(gathered_keys + gathered_values, keys + values, strict=True):
        assert torch.equal(ours, theirs)


def changed_table_attributes(tree: ast.AST) -> list[int]:
    """Lines that assign a block table or its lists, or call a list mutator on them."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in TABLE_ATTRIBUTES:
                    lines.append(node.lineno)
    return lines


def test_only_the_kv_manager_changes_block_tables() -> None:
    changed = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if path != OWNER and (lines := changed_table_attributes(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert changed == {}
    assert changed_table_attributes(ast.parse(OWNER.read_text(encoding="utf-8")))  # the check sees assignments
