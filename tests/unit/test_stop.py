"""Stop strings across chunk boundaries: nothing past a stop leaks, partial matches are held back."""

from __future__ import annotations

import itertools

import pytest

from statelm.api.parsers.stop import StopStringMatcher


def run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, list[str]]:
    emitted = [matcher.feed(piece) for piece in pieces]
    tail = "" if matcher.stopped else matcher.flush()
    return "".join(emitted) + tail, emitted


@pytest.mark.parametrize("stops", [["END"], ["\n\n", "END"], ["ab", "abc"], ["x"]])
def test_every_split_of_the_text_gives_the_same_result(stops: list[str]) -> None:
    text = "hello wor\nld ab\n\nEND tail after"
    expected_matches = [i for s in stops if (i := text.find(s)) >= 0]
    expected = text[: min(expected_matches)] if expected_matches else text
    for cut_a, cut_b in itertools.combinations(range(1, len(text)), 2):
        pieces = [text[:cut_a], text[cut_a:cut_b], text[cut_b:]]
        result, _ = run(StopStringMatcher(stops), pieces)
        assert result == expected, (pieces, stops)


def test_partial_match_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "
    assert matcher.feed("O") == ""
    assert matcher.feed("X") == "STOX"
    assert not matcher.stopped


def test_match_sets_stopped_and_drops_the_rest() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("answer</") == "answer"
    assert matcher.feed("s> more") == ""
    assert matcher.stopped
    assert matcher.feed("even more") == ""


def test_earliest_stop_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"


def test_no_stops_passes_everything() -> None:
    result, emitted = run(StopStringMatcher([]), ["a", "b", "c"])
    assert result == "abc" and emitted == ["a", "b", "c"]
