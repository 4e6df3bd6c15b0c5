"""One real server on the default model for the CLI tests, and an isolated state dir for the CLI itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import start_server, stop_server


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a server shared by the CLI test modules."""
    root = tmp_path_factory.mktemp("cli-server")
    process, url = start_server(
        ["--model", "default", "--kv-cache-memory", "512MiB", "--state-dir", str(root / "state")], root / "server.log"
    )
    yield url
    stop_server(process)


@pytest.fixture(scope="session")
def cli_env(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for CLI runs: the shared server, and the CLI's own state (history, workspaces) in a tmp dir."""
    return {"STATELM_URL": server_url, "XDG_STATE_HOME": str(tmp_path_factory.mktemp("cli-home"))}
