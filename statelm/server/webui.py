"""The web UI at `/`: the built page and its assets, public, compressed, with a strict Content-Security-Policy.

The page is a client of the public API (it sends the user's key itself), so serving its files needs no key.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, PlainTextResponse, Response
from starlette.middleware.gzip import GZipMiddleware
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ASSETS_PREFIX = "/webui"  # where the page's scripts, styles and icons are (the build's `base`)
NOT_BUILT = (
    "statelm's web UI is not built: run `make webui` (npm ci && npm run build in webui/) and restart the server;"
    " the API works without it.\n"
)
# Scripts and styles only from the server's own files (no inline script, no eval), data only from its own API,
# images only from itself (a reply's Markdown image cannot call another site), and no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
    "connect-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


class SecurityHeaders:
    """Adds the page's security headers (and long caching for content-hashed assets) to every answer of app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request through app with the headers added."""
        immutable = "/assets/" in scope.get("path", "")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(name.lower().encode(), value.encode()) for name, value in SECURITY_HEADERS.items()]
                cache = "public, max-age=31536000, immutable" if immutable else "no-cache"
                headers.append((b"cache-control", cache.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install_webui(app: FastAPI, dist: Path) -> None:
    """Serve the page built into dist at `/` and its assets under ASSETS_PREFIX; a one-line hint if it is not built."""
    index = dist / "index.html"

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        if not index.is_file():
            return PlainTextResponse(NOT_BUILT, status_code=404, headers=SECURITY_HEADERS)
        return FileResponse(index, headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})

    if dist.is_dir():
        files = StaticFiles(directory=dist)
        app.mount(ASSETS_PREFIX, GZipMiddleware(SecurityHeaders(files), minimum_size=512), name="webui")
