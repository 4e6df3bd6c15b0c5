"""bench/soak.py's memory verdict: growth that goes on after the warm-up is a leak; a step, noise or the KV pool's
pages becoming resident is not."""

from __future__ import annotations

import random

from bench.soak import MIB, MemorySample, memory_verdict


def samples(rss_of_requests: list[float], per_window: int = 1000, window_s: float = 30.0) -> list[MemorySample]:
    """One sample per window, the MiB given for each."""
    return [MemorySample(i * window_s, i * per_window, int(mib * MIB)) for i, mib in enumerate(rss_of_requests)]


def test_steady_growth_is_a_leak_and_a_step_or_noise_is_not() -> None:
    noise = random.Random(7)
    leak = samples([1000 + 3 * i + noise.uniform(-1, 1) for i in range(10)])
    verdict = memory_verdict(leak, warmup_s=60, threshold_mib=1.0)
    assert verdict.leaking and 2.5 < verdict.overall < 3.5 and 2 < verdict.recent < 4  # type: ignore[operator]
    pool_touched = samples([1000, 1300, 1560, 1562, 1561, 1563, 1562, 1564, 1563, 1562])  # the pool, then flat
    assert not memory_verdict(pool_touched, warmup_s=60, threshold_mib=1.0).leaking
    step = samples([1000, 1001, 1002, 1003, 1040, 1041, 1041, 1042, 1042, 1042])  # one step, then flat
    verdict = memory_verdict(step, warmup_s=60, threshold_mib=1.0)
    assert verdict.overall is not None and verdict.overall > 1.0 and not verdict.leaking  # it did not go on
    flat = samples([1000 + noise.uniform(-5, 5) for _ in range(10)])
    assert not memory_verdict(flat, warmup_s=60, threshold_mib=1.0).leaking


def test_a_run_too_short_to_judge_is_not_judged() -> None:
    verdict = memory_verdict(samples([1000, 1100, 1200, 1300, 1400]), warmup_s=60, threshold_mib=1.0)
    assert verdict.overall is None and verdict.recent is None and not verdict.leaking
