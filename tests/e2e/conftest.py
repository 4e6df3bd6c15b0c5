"""A real statelm server on the default model, started once per test session."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

STARTUP_TIMEOUT_S = 240
START_ATTEMPTS = 3  # a free port can be taken before the server binds it


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_environment() -> dict[str, str]:
    """This process's environment without the API-key variables a developer may have set for the CLI."""
    return {name: value for name, value in os.environ.items() if name not in ("STATELM_API_KEY", "STATELM_ADMIN_KEY")}


def start_server(
    args: list[str], log_path: Path, extra_environment: dict[str, str] | None = None, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `statelm serve` with args (and extra environment variables) on port (a free one if None) and wait until
    /health answers. A free port another process (the other pytest worker's server) took first is replaced."""
    for _ in range(START_ATTEMPTS - 1 if port is None else 0):
        with contextlib.suppress(PortTakenError):
            return _start_once(args, log_path, extra_environment, free_port())
    return _start_once(args, log_path, extra_environment, port or free_port())


class PortTakenError(RuntimeError):
    """The server could not bind its port."""


def port_was_taken(output: str) -> bool:
    """Whether a server's output says that it could not bind its port."""
    return "address already in use" in output.lower()


def _start_once(
    args: list[str], log_path: Path, extra_environment: dict[str, str] | None, port: int
) -> tuple[subprocess.Popen[bytes], str]:
    if "--state-dir" not in args:
        args = [*args, "--state-dir", str(log_path.parent / "state")]
    with log_path.open("ab") as log:
        written = log.tell()  # this start's output follows what earlier ones wrote
        process = subprocess.Popen(
            [sys.executable, "-m", "statelm", "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_environment(), **(extra_environment or {}), "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = log_path.read_bytes()[written:].decode(errors="replace")[-3000:]
            error = PortTakenError if port_was_taken(output) else RuntimeError
            raise error(f"server exited with {process.returncode}:\n{output}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state dir (sessions, snapshots) of the shared server."""
    return tmp_path_factory.mktemp("server") / "state"


@pytest.fixture(scope="session")
def server_url(state_dir: Path) -> Iterator[str]:
    """Base URL of a server on the default model."""
    log_path = state_dir.parent / "server.log"
    process, url = start_server(
        ["--model", "default", "--kv-cache-memory", "512MiB", "--state-dir", str(state_dir)], log_path
    )
    yield url
    stop_server(process)


@pytest.fixture(scope="session")
def client(server_url: str) -> openai.OpenAI:
    """The official OpenAI SDK pointed at the server."""
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(client: openai.OpenAI) -> str:
    """The id the server lists in /v1/models."""
    return client.models.list().data[0].id


def delete_state(http: httpx.Client) -> None:
    """Delete every snapshot, then every session, that the client's key can see."""
    for snapshot in http.get("/v1/snapshots").json()["data"]:
        http.delete(f"/v1/snapshots/{snapshot['id']}")
    for session in http.get("/v1/sessions").json()["data"]:
        http.delete(f"/v1/sessions/{session['id']}")
