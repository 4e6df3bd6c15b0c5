"""Prompt lookup: drafts from the latest earlier occurrence of a sequence's last tokens, and their adaptive length."""

from __future__ import annotations

from statelm.engine.prompt_lookup import FIRST_LENGTH, MAX_PAUSE_STEPS, PromptLookup


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_three_tokens() -> None:
    lookup = PromptLookup(max_tokens=8)
    lookup.length = 8
    tokens = [1, 2, 3, 10, 11, 5, 1, 2, 3, 20, 21, 22, 23, 9, 1, 2, 3]
    assert lookup.propose(tokens, limit=8) == [20, 21, 22, 23, 9, 1, 2, 3]
    assert lookup.propose([*tokens, 20], limit=3) == [21, 22, 23]  # the tokens added since are searched too


def test_two_tokens_are_looked_up_where_three_are_not_found_and_one_never_is() -> None:
    lookup = PromptLookup(max_tokens=4)
    assert lookup.propose([7, 2, 3, 40, 41, 9, 2, 3], limit=4) == [40, 41]  # FIRST_LENGTH tokens at first
    assert FIRST_LENGTH == 2
    assert PromptLookup(max_tokens=4).propose([7, 3, 40, 41, 9, 3], limit=4) == []
    assert PromptLookup(max_tokens=4).propose([1, 2], limit=4) == []


def test_a_draft_never_passes_the_limit_or_the_text() -> None:
    lookup = PromptLookup(max_tokens=8)
    lookup.length = 8
    tokens = [4, 5, 6, 4, 5]
    assert lookup.propose(tokens, limit=8) == [6, 4, 5]  # the occurrence's followers run into the suffix itself
    assert lookup.propose(tokens, limit=1) == [6]
    assert lookup.propose(tokens, limit=0) == []


def test_a_byte_match_across_token_boundaries_is_not_an_occurrence() -> None:
    first, second = 0x04030201, 0x08070605  # bytes 01 02 03 04 05 06 07 08
    straddling = [0x02019999, 0x06050403, 0x99990807]  # the same eight bytes, two bytes into the first token
    assert PromptLookup(max_tokens=4).propose([*straddling, 5, first, second], limit=4) == []
    lookup = PromptLookup(max_tokens=4)
    assert lookup.propose([first, second, 42, 43, *straddling, 5, first, second], limit=4) == [42, 43]


def test_the_length_grows_while_drafts_are_taken_whole_and_falls_to_what_was_taken() -> None:
    lookup = PromptLookup(max_tokens=5)
    lookup.record(proposed=2, accepted=2)
    assert lookup.length == 4
    lookup.record(proposed=4, accepted=4)
    assert lookup.length == 5  # capped at max_tokens
    lookup.record(proposed=5, accepted=2)
    assert lookup.length == 3


def test_misses_in_a_row_pause_drafting_longer_each_time() -> None:
    lookup = PromptLookup(max_tokens=4)
    tokens = [1, 2, 3, 9, 1, 2, 3]
    pauses = []
    for _ in range(6):
        lookup.record(proposed=1, accepted=0)
        pauses.append(lookup.pause)
    assert pauses == [1, 3, 7, 15, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    lookup.pause = 1
    assert lookup.propose(tokens, limit=4) == []  # paused: one step without a draft
    assert lookup.propose(tokens, limit=4) == [9]  # the length a miss leaves: 1
    lookup.record(proposed=1, accepted=1)
    assert lookup.pause == 0 and lookup.misses == 0
