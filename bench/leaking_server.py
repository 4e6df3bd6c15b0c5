"""`statelm serve` with a deliberate leak: the app keeps every request object it is sent, forever.

Usage: .venv/bin/python -m bench.leaking_server serve [statelm serve options]

Test hook for bench/soak.py (`--leak-requests`), which must fail on this server and pass on the real one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response

from statelm.cli.main import app as cli
from statelm.server import launch

KEPT: list[Request] = []  # never emptied: the leak
_build_app = launch.build_app


def leaking_build_app(*args: Any, **kwargs: Any) -> tuple[FastAPI, Any]:
    """The app build_app makes, with a middleware that keeps every request."""
    app, drain = _build_app(*args, **kwargs)

    @app.middleware("http")
    async def keep(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        KEPT.append(request)
        return await call_next(request)

    return app, drain


if __name__ == "__main__":
    launch.build_app = leaking_build_app
    cli()
