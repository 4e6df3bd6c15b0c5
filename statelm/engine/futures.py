"""Handing a worker thread's result to a future on the event loop."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


def settle(future: asyncio.Future[T], result: T | None, error: Exception | None) -> None:
    """Resolve future with result, or fail it with error; a future already done (cancelled) is left alone.

    Call it on the future's loop (`loop.call_soon_threadsafe(settle, ...)`).
    """
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
