"""Scheduler, with no model: token budget, chunked prefill, preemption of the newest sequence, abort, and prompts
that wait for a shared prefix to reach the prefix cache."""

from __future__ import annotations

import zlib

import pytest

from statelm.engine.scheduler import Scheduler
from statelm.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tests.unit.kv_managers import kv_manager


def make_seq(request_id: str, prompt_len: int, priority: int = 0, prefix: tuple[int, ...] = ()) -> Sequence:
    """A sequence whose prompt is prefix, then tokens of its own (the request's)."""
    own = zlib.crc32(request_id.encode()) % 10_000 * 1_000
    return Sequence(
        request_id=request_id,
        prompt_ids=[*prefix, *range(own, own + prompt_len - len(prefix))],
        params=SamplingParams(max_tokens=100, priority=priority),
        eos_token_ids=frozenset({-1}),
        max_total_tokens=10_000,
    )


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule, pretend the forward ran (publishing the computed prompt blocks), append a token where one is
    sampled."""
    chunks = scheduler.schedule()
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        computed_prompt = min(chunk.seq.num_computed_tokens, len(chunk.seq.prompt_ids))
        scheduler.kv.publish(chunk.seq.block_table, chunk.seq.tokens, computed_prompt)
        if chunk.seq.num_uncomputed_tokens == 0:
            chunk.seq.append_token(7)
    return {chunk.seq.request_id: chunk.num_tokens for chunk in chunks}


def test_long_prompt_is_prefilled_in_chunks_next_to_running_decodes() -> None:
    scheduler = Scheduler(kv_manager(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    scheduler.add(make_seq("short", 5))
    assert run_step(scheduler) == {"short": 5}
    scheduler.add(make_seq("long", 70))
    assert run_step(scheduler) == {"short": 1, "long": 31}
    assert run_step(scheduler) == {"short": 1, "long": 31}
    assert run_step(scheduler) == {"short": 1, "long": 8}
    assert run_step(scheduler) == {"short": 1, "long": 1}


def test_max_num_seqs_caps_the_running_queue() -> None:
    scheduler = Scheduler(kv_manager(64, 16), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        scheduler.add(make_seq(f"s{i}", 4))
    assert set(run_step(scheduler)) == {"s0", "s1"}
    assert len(scheduler.waiting) == 1


def test_newest_sequence_is_preempted_when_blocks_run_out_and_recomputed_later() -> None:
    kv = kv_manager(4, 4)  # 16 tokens in all
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq("old", 7), make_seq("new", 7)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    assert run_step(scheduler) == {"old": 1, "new": 1}  # token 8 still fits in two blocks
    assert run_step(scheduler) == {"old": 1}  # old needs a third block for token 9: new is preempted
    assert old.status is SequenceStatus.RUNNING
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table.blocks == []
    assert scheduler.waiting[0] is new
    scheduler.abort("old")
    prompt_and_output = new.num_tokens
    assert run_step(scheduler) == {"new": prompt_and_output}  # recomputes prompt plus its output


def test_abort_frees_blocks_and_marks_the_sequence() -> None:
    kv = kv_manager(8, 16)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq("a", 20)
    scheduler.add(seq)
    run_step(scheduler)
    assert kv.num_free_blocks == 6
    assert scheduler.abort("a") == [seq]
    assert kv.num_free_blocks == 8 and seq.finish_reason is FinishReason.ABORT
    assert not scheduler.has_work() and scheduler.abort("a") == []


def test_abort_of_one_choice_keeps_the_others() -> None:
    kv = kv_manager(8, 16)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = make_seq("a", 4), make_seq("a", 4)
    second.index = 1
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add_ahead([second])
    assert scheduler.waiting[0] is second
    assert scheduler.abort("a", index=1) == [second]
    assert scheduler.running == [first] and not scheduler.waiting
    assert scheduler.abort("a") == [first] and kv.num_free_blocks == 8


def test_waiting_sequences_are_ordered_by_priority_then_arrival() -> None:
    scheduler = Scheduler(kv_manager(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    for request_id, priority in [("a", 0), ("b", -1), ("c", 1), ("d", 0), ("e", 1)]:
        scheduler.add(make_seq(request_id, 3, priority))
    assert [seq.request_id for seq in scheduler.waiting] == ["c", "e", "a", "d", "b"]


def test_a_prompt_waits_for_the_blocks_it_shares_with_one_being_computed_then_takes_them_from_the_cache() -> None:
    kv = kv_manager(32, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    system = tuple(range(500, 510))  # two whole blocks and half of a third
    first, second = make_seq("first", 14, prefix=system), make_seq("second", 13, prefix=system)
    other = make_seq("other", 6)
    for seq in (first, second, other):
        scheduler.add(seq)
    assert run_step(scheduler) == {"first": 14, "other": 6}  # second would compute the shared blocks again: it waits
    assert run_step(scheduler) == {"first": 1, "other": 1, "second": 3}  # 10 of its tokens from the cache
    assert second.num_cached_prompt_tokens == 10  # two whole blocks shared, two tokens of the third copied
    assert second.block_table.blocks[:2] == first.block_table.blocks[:2]
    assert second.block_table.blocks[2] != first.block_table.blocks[2]


@pytest.mark.parametrize(
    ("pool", "prefix_len", "waits"),
    [({}, 3, False), ({"enable_prefix_caching": False}, 10, False), ({}, 4, True)],
    ids=["under-a-block", "no-prefix-cache", "a-block"],
)
def test_a_prompt_waits_only_for_a_whole_shared_block_and_with_the_prefix_cache(
    pool: dict[str, bool], prefix_len: int, waits: bool
) -> None:
    scheduler = Scheduler(kv_manager(32, 4, **pool), max_num_seqs=8, max_num_batched_tokens=64)
    prefix = tuple(range(500, 500 + prefix_len))
    scheduler.add(make_seq("first", 14, prefix=prefix))
    scheduler.add(make_seq("second", 13, prefix=prefix))
    assert ("second" not in run_step(scheduler)) == waits


def test_a_prompt_waits_only_while_the_shared_blocks_are_uncomputed() -> None:
    kv = kv_manager(32, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)  # first's prompt takes two steps
    system = tuple(range(500, 512))
    first, second = make_seq("first", 14, prefix=system), make_seq("second", 14, prefix=system)
    scheduler.add(first)
    assert run_step(scheduler) == {"first": 8}
    scheduler.add(second)
    assert run_step(scheduler) == {"first": 6}  # 12 shared tokens: three blocks, the third not computed yet
    assert run_step(scheduler) == {"first": 1, "second": 2}
    assert second.num_cached_prompt_tokens == 12
