"""The web UI in Debian's chromium, driven by Playwright, on one real keyed server with the default model.

The browser is never downloaded: the tests use /usr/bin/chromium (`make test` installs it where apt can) and skip,
saying why, without it, without Playwright, or when the UI is not built (`make webui` needs Node and npm).
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from statelm.webui import DIST
from tests.e2e.conftest import delete_state, free_port, start_server, stop_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "webui-test-key"


def missing_requirement() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not (DIST / "index.html").is_file():
        return "the web UI is not built (`make webui` builds it; it needs Node >= 20.19 and npm)"
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} is missing (`apt-get install chromium`; `make test` installs it as root)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@dataclass
class Server:
    """A keyed default-model server that can be restarted on the same port (so that an open page can reconnect)."""

    state: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server and wait until it answers."""
        args = ["--model", "default", "--kv-cache-memory", "256MiB", "--state-dir", str(self.state), "--api-key", KEY]
        self.process, _ = start_server(args, self.state.parent / "server.log", port=self.port)

    def stop(self) -> None:
        """Stop it gracefully (sessions are saved)."""
        if self.process is not None:
            stop_server(self.process)
            self.process = None

    def http(self) -> httpx.Client:
        """Raw HTTP to the API with the key."""
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server."""
    running = Server(tmp_path_factory.mktemp("webui") / "state", free_port())
    running.start()
    yield running
    running.stop()


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    """The API with the key; what a test leaves is deleted after it."""
    with server.http() as http:
        yield http
        delete_state(http)


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """Debian's chromium, headless."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    """A page of the UI in a fresh browser profile that already holds the key; page errors fail the test."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    context.add_init_script(f"localStorage.setItem('statelm.key', JSON.stringify({KEY!r}))")
    context.set_default_timeout(60_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.url)
    yield page
    context.close()
    assert not errors, errors
