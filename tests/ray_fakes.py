"""A stand-in for a Ray actor or Ray Serve handle in tests that run without Ray."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Generator
from typing import Any


class _Done:
    """An answer already there, awaitable as a Ray call's is (and harmless when nobody awaits it)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[None, None, Any]:
        return self.value
        yield  # a generator: the await ends at once


class _Method:
    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def remote(self, *args: Any) -> Awaitable[Any]:
        answer = self.method(*args)
        return answer if inspect.isawaitable(answer) else _Done(answer)  # an async method's answer is awaited


class Remote:
    """An object called as through its Ray handle (`handle.method.remote(...)`), in this process, at once."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.target, name))
