"""KeyedLocks: one holder per key at a time, and no entry left once nobody holds or waits."""

from __future__ import annotations

import asyncio

import pytest

from statelm.sessions.keyed_locks import KeyedLocks


def test_one_holder_per_key_and_other_keys_run_alongside() -> None:
    async def run() -> list[str]:
        locks, events = KeyedLocks(), []

        async def hold(key: str, name: str) -> None:
            async with locks.hold(key):
                events.append(f"{name} in")
                await asyncio.sleep(0.01)
                events.append(f"{name} out")

        await asyncio.gather(hold("a", "first"), hold("a", "second"), hold("b", "other"))
        assert len(locks) == 0
        return events

    events = asyncio.run(run())
    assert events.index("second in") > events.index("first out")  # the same key waits
    assert events.index("other in") < events.index("first out")  # another key does not


def test_a_waiter_cancelled_or_a_body_that_raises_leaves_no_entry() -> None:
    async def run() -> None:
        locks = KeyedLocks()
        held = asyncio.Event()

        async def holder() -> None:
            async with locks.hold("k"):
                held.set()
                await asyncio.sleep(0.05)

        async def waiter() -> None:
            async with locks.hold("k"):
                raise AssertionError("a cancelled waiter must not get the lock")

        first = asyncio.create_task(holder())
        await held.wait()
        second = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        await first
        assert len(locks) == 0
        with pytest.raises(ValueError):
            async with locks.hold("k"):
                raise ValueError("boom")
        assert len(locks) == 0

    asyncio.run(run())
