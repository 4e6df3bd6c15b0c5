"""Repetition-loop detector: flags a loop within its required repeats, not a window later; ignores normal text."""

from __future__ import annotations

import random

import pytest

from statelm.engine.repetition import RepetitionConfig, RepetitionDetector


def first_detection(tokens: list[int], config: RepetitionConfig) -> tuple[int, int] | None:
    """(index of the token that completed the loop, its period), or None."""
    detector = RepetitionDetector(config)
    for index, token in enumerate(tokens):
        if (period := detector.add(token)) is not None:
            return index, period
    return None


def reference_detection(tokens: list[int], config: RepetitionConfig) -> tuple[int, int] | None:
    """Brute force: the first prefix whose tail is a block repeated as often as the config asks."""
    for end in range(1, len(tokens) + 1):
        for period in range(config.min_period, config.max_period + 1):
            span = period * config.repeats_needed(period)
            if span <= end:
                tail = tokens[end - span : end]
                if all(tail[i] == tail[i - period] for i in range(period, span)):
                    return end - 1, period
    return None


@pytest.mark.parametrize("period", [1, 2, 5, 13, 40])
def test_loop_is_flagged_exactly_when_its_repeats_complete(period: int) -> None:
    config = RepetitionConfig(min_period=1, max_period=48, min_repeats=3, min_tokens=24)
    rng = random.Random(period)
    prefix = rng.sample(range(1000, 2000), 30)  # distinct tokens: no loop of their own
    block = rng.sample(range(100), period)
    tokens = prefix + block * 50
    index, found = first_detection(tokens, config)
    assert found == period
    assert index == len(prefix) + period * config.repeats_needed(period) - 1


def test_matches_a_brute_force_reference_on_random_streams() -> None:
    rng = random.Random(0)
    config = RepetitionConfig(min_period=2, max_period=8, min_repeats=3, min_tokens=10)
    for _ in range(150):
        alphabet = rng.randint(2, 4)
        tokens = [rng.randrange(alphabet) for _ in range(60)]
        assert first_detection(tokens, config) == reference_detection(tokens, config)


def test_ordinary_text_and_short_repeats_pass() -> None:
    config = RepetitionConfig()
    rng = random.Random(1)
    prose = [rng.randrange(5000) for _ in range(2000)]
    assert first_detection(prose, config) is None
    laugh = prose[:50] + [7, 8] * 5 + prose[50:100]  # "ha ha ha ha ha"
    assert first_detection(laugh, config) is None
    too_long = prose[:10] + list(range(100)) * 5  # longer than max_period
    assert first_detection(too_long, config) is None


def test_periods_outside_the_range_are_ignored() -> None:
    config = RepetitionConfig(min_period=4, max_period=8, min_repeats=3, min_tokens=0)
    assert first_detection([5] * 100, config) == (11, 4)  # a 1-token loop is also a 4-token loop
    assert first_detection([1, 2, 3] * 10, config) == (17, 6)


def test_invalid_configs_are_rejected() -> None:
    for kwargs in ({"min_period": 0}, {"min_period": 9, "max_period": 8}, {"min_repeats": 1}, {"min_tokens": -1}):
        with pytest.raises(ValueError, match="repetition_detection"):
            RepetitionConfig(**kwargs)
