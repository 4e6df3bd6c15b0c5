"""Streaming detection of a degenerate loop: the output's tail is one block of tokens repeated over and over."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RepetitionConfig:
    """Which loops count: a block of `min_period`..`max_period` tokens repeated `min_repeats` times in a row.

    Short blocks repeat harmlessly ("ha ha ha", a row of dashes), so a loop must also span `min_tokens`
    tokens: a period p needs max(min_repeats, ceil(min_tokens / p)) repeats.
    """

    min_period: int = 1
    max_period: int = 64
    min_repeats: int = 3
    min_tokens: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min_period <= self.max_period:
            raise ValueError("repetition_detection needs 1 <= min_period <= max_period")
        if self.min_repeats < 2:
            raise ValueError("repetition_detection needs min_repeats >= 2")
        if self.min_tokens < 0:
            raise ValueError("repetition_detection needs min_tokens >= 0")

    def repeats_needed(self, period: int) -> int:
        """How many back-to-back copies of a block of `period` tokens make a loop."""
        return max(self.min_repeats, math.ceil(self.min_tokens / period))


class RepetitionDetector:
    """Fed one output token at a time; reports the loop's period as soon as the required repeats are complete.

    For every candidate period p it keeps the length of the current run of positions t with token[t] ==
    token[t - p]; r copies of a p-token block make that run (r - 1) * p long. So a loop is flagged the moment
    its last required copy ends, and each token costs O(max_period) vectorized work.
    """

    def __init__(self, config: RepetitionConfig) -> None:
        self.config = config
        self._periods = np.arange(config.min_period, config.max_period + 1)
        self._runs_needed = np.array([(config.repeats_needed(int(p)) - 1) * int(p) for p in self._periods])
        self._runs = np.zeros(len(self._periods), dtype=np.int64)
        self._recent = np.full(config.max_period, -1, dtype=np.int64)  # _recent[k] = the token k + 1 steps back
        self.period: int | None = None

    def add(self, token_id: int) -> int | None:
        """Record the next output token; return the period of the loop found so far (the shortest), else None."""
        same = self._recent[self._periods - 1] == token_id
        self._runs = np.where(same, self._runs + 1, 0)
        self._recent[1:] = self._recent[:-1]
        self._recent[0] = token_id
        looping = self._runs >= self._runs_needed
        if self.period is None and looping.any():
            self.period = int(self._periods[int(np.argmax(looping))])
        return self.period
