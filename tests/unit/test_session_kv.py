"""SessionKVStore on a real block pool and KV cache: LCP attach, copy on write, park/commit/discard, spill."""

from __future__ import annotations

import torch

from statelm.engine.sequence import SamplingParams, Sequence
from statelm.engine.session_kv import SessionKVData, SessionKVStore
from tests.unit.kv_managers import kv_manager

BLOCK = 4


def make_store(num_blocks: int = 16) -> SessionKVStore:
    return SessionKVStore(kv_manager(num_blocks, BLOCK, layers=2, head_dim=2))


def data_for(tokens: list[int]) -> SessionKVData:
    """KV whose every value is the token id, so where it lands can be read back."""
    fill = [torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 2).clone() for _ in range(2)]
    return SessionKVData(tokens, fill, [t + 0.5 for t in fill])


def turn(store: SessionKVStore, session_id: str, prompt: list[int], request_id: str = "r") -> Sequence:
    """A sequence of a session turn, attached as the scheduler would, its whole prompt computed."""
    seq = Sequence(request_id, prompt, SamplingParams(), frozenset(), 1000, session_id=session_id)
    store.acquire(session_id, None)
    if length := store.reusable_length(seq):
        store.attach(seq, length)
    assert store.kv.grow(seq.block_table, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_turn_shares_full_blocks_copies_the_partial_one_and_leaves_the_session_untouched() -> None:
    store = make_store()
    store.load("s", data_for(list(range(10))))  # blocks: [0-3] [4-7] [8,9]
    session_blocks = list(store.resident["s"].table.blocks)
    seq = turn(store, "s", [*range(10), 99, 98])
    assert seq.block_table.blocks[:2] == session_blocks[:2]
    assert seq.block_table.blocks[2] != session_blocks[2]  # the partly filled block was copied, not shared
    keys = store.kv.kv_cache.k[0]  # [blocks, heads, dim, block_size]
    assert torch.equal(keys[seq.block_table.blocks[2], ..., :2], keys[session_blocks[2], ..., :2])
    keys[seq.block_table.blocks[2], ..., 2:] = -1.0  # the turn writes its new tokens into its own copy
    assert store.resident["s"].tokens == list(range(10))
    assert keys[session_blocks[2], 0, 0, :2].tolist() == [8.0, 9.0]


def test_lcp_stops_at_the_first_differing_token_and_keeps_one_token_to_compute() -> None:
    store = make_store()
    store.load("s", data_for([1, 2, 3, 4, 5, 6]))
    edited = Sequence("r", [1, 2, 9, 4, 5, 6, 7], SamplingParams(), frozenset(), 100, session_id="s")
    assert store.reusable_length(edited) == 2
    same = Sequence("r", [1, 2, 3, 4, 5, 6], SamplingParams(), frozenset(), 100, session_id="s")
    assert store.reusable_length(same) == 5


def test_commit_replaces_the_session_kv_and_discard_keeps_it() -> None:
    store = make_store()
    store.load("s", data_for([1, 2, 3, 4, 5]))
    free_before = store.kv.pool.num_free_blocks
    seq = turn(store, "s", [1, 2, 3, 4, 5, 6, 7, 8, 9], "dropped")
    store.park(seq)
    store.discard("dropped")
    assert store.resident["s"].tokens == [1, 2, 3, 4, 5]
    assert store.kv.pool.num_free_blocks == free_before
    seq = turn(store, "s", [1, 2, 3, 4, 5, 6, 7, 8, 9], "kept")
    store.park(seq)
    assert store.commit("kept", "s") == 9
    assert store.resident["s"].tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert store.kv.pool.num_used_blocks == 3
    assert store.commit("kept", "s") is None


def test_fork_shares_blocks_and_each_side_writes_its_own_copy() -> None:
    store = make_store()
    store.load("parent", data_for(list(range(6))))
    assert store.fork("parent", "child")
    assert store.resident["child"].table.blocks == store.resident["parent"].table.blocks
    used = store.kv.pool.num_used_blocks
    child_turn = turn(store, "child", [*range(6), 50, 51], "c")
    store.park(child_turn)
    store.commit("c", "child")
    assert store.resident["parent"].tokens == list(range(6))
    assert store.resident["child"].table.blocks[0] == store.resident["parent"].table.blocks[0]
    assert store.resident["child"].table.blocks[1] != store.resident["parent"].table.blocks[1]
    store.release("child")
    assert store.kv.pool.num_used_blocks == used
    assert not store.fork("missing", "other")


def test_export_then_load_round_trips_the_kv() -> None:
    store = make_store()
    original = data_for([7, 8, 9, 10, 11, 12, 13])
    store.load("a", original)
    exported = store.export("a")
    assert exported is not None and exported.tokens == original.tokens
    for ours, theirs in zip(exported.keys + exported.values, original.keys + original.values, strict=True):
        assert torch.equal(ours, theirs)
    assert store.export("missing") is None


def test_reclaim_spills_least_recently_used_idle_sessions_only() -> None:
    store = make_store(num_blocks=6)
    spilled: list[str] = []
    store.spill_handler = lambda session_id, data: spilled.append(session_id)
    store.load("old", data_for(list(range(8))))
    store.load("busy", data_for(list(range(100, 108))))
    store.acquire("busy", None)
    store.load("new", data_for(list(range(200, 204))))
    assert store.reclaim(3)
    assert spilled == ["old"] and "old" not in store.resident and "busy" in store.resident
    assert not store.reclaim(6)  # only "new" was idle: spilled, and "busy" still holds its blocks
    assert spilled == ["old", "new"]


def test_a_spilled_session_is_restored_when_its_turn_acquires_it() -> None:
    store = make_store()
    data = data_for([1, 2, 3, 4, 5])
    store.acquire("s", data)
    assert store.resident["s"].tokens == [1, 2, 3, 4, 5] and store.resident["s"].users == 1


def test_decoded_tail_is_not_reused_until_a_refresh_has_recomputed_it() -> None:
    store = make_store()
    seq = turn(store, "s", [1, 2, 3, 4, 5], "t")
    seq.tokens += [6, 7, 8]  # three decoded tokens, the last one sampled but not yet computed
    seq.num_computed_tokens = 7
    store.park(seq)
    store.commit("t", "s")
    assert store.resident["s"].tokens == [1, 2, 3, 4, 5, 6, 7] and store.resident["s"].exact == 5
    follow_up = Sequence("u", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), frozenset(), 100, session_id="s")
    assert store.reusable_length(follow_up) == 5
    assert store.export("s").tokens == [1, 2, 3, 4, 5]
    refresh = store.refresh_sequence("s")
    assert refresh is not None and refresh.prefill_only and refresh.prompt_ids == [1, 2, 3, 4, 5, 6, 7]
    assert store.refresh_sequence("s") is None  # one at a time
    assert store.holds_back(follow_up) and not store.holds_back(refresh)
    store.attach(refresh, store.reusable_length(refresh))
    assert store.kv.grow(refresh.block_table, refresh.num_tokens)
    refresh.num_computed_tokens = refresh.num_tokens
    store.park(refresh)
    store.finish_refresh(refresh)
    assert store.resident["s"].exact == 7 and not store.holds_back(follow_up)
    assert store.reusable_length(follow_up) == 7


def test_a_refresh_overtaken_by_a_change_of_the_session_is_dropped() -> None:
    store = make_store()
    seq = turn(store, "s", [1, 2, 3], "t")
    seq.tokens += [4, 5]
    seq.num_computed_tokens = 4
    store.park(seq)
    store.commit("t", "s")
    refresh = store.refresh_sequence("s")
    assert refresh is not None
    store.release("s")  # the session was deleted (or replaced) while the refresh ran
    refresh.num_computed_tokens = 0
    store.park(refresh)
    used = store.kv.pool.num_used_blocks
    store.finish_refresh(refresh)
    assert "s" not in store.resident and store.kv.pool.num_used_blocks <= used and not store.refreshing
