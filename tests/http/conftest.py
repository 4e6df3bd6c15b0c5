"""In-process statelm apps on a tiny random model: the whole application (model, engine thread, routes, auth,
limits) built by `build_app` from `statelm serve` arguments and reached through its ASGI interface, no subprocess.

The app's lifespan and every request run on one event loop thread, so sync httpx clients and the sync openai SDK
talk to it as to a real server. Responses are buffered whole (as httpx's ASGITransport does): a test that acts
on a stream while it is still being written belongs to tests/e2e.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from typer.testing import CliRunner

from statelm.cli.main import app as cli
from statelm.config import EngineConfig, ServerConfig
from statelm.server import launch
from tests.models.tiny_model_dir import make_tiny_model_dir

BASE_URL = "http://testserver"
SERVED_NAME = "default"  # what request bodies name, as on a server started with `--model default`
CONTEXT = 8192  # the default model's context, so that a request's room and the caps are those of the real server
KEY_VARIABLES = ("STATELM_API_KEY", "STATELM_ADMIN_KEY")


class _Chunks(httpx.AsyncByteStream):
    """A request body already read from a sync stream, handed to the app chunk by chunk."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class InProcessTransport(httpx.BaseTransport):
    """A sync httpx transport that runs each request through httpx.ASGITransport on the app's event loop."""

    def __init__(self, app: FastAPI, portal: BlockingPortal) -> None:
        self.asgi = httpx.ASGITransport(app, raise_app_exceptions=False)  # an error is a 500, as from uvicorn
        self.portal = portal

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send request to the app and return its whole response."""
        body = _Chunks(list(request.stream))  # type: ignore[arg-type]  # a sync client's body is a sync stream
        forwarded = httpx.Request(request.method, request.url, headers=request.headers, stream=body)

        async def send() -> httpx.Response:
            response = await self.asgi.handle_async_request(forwarded)
            raw = b"".join([chunk async for chunk in response.aiter_raw()])  # still encoded, as a server sends it
            return httpx.Response(response.status_code, headers=response.headers, content=raw)

        return self.portal.call(send)


@dataclass
class InProcessServer:
    """An app with its lifespan running, and clients on it."""

    app: FastAPI
    transport: InProcessTransport
    url: str = BASE_URL

    def http(self, key: str | None = None, headers: dict[str, str] | None = None) -> httpx.Client:
        """Raw HTTP to the app, with key as a bearer token (none if key is None) and any other headers."""
        bearer = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.Client(transport=self.transport, base_url=self.url, headers={**bearer, **(headers or {})})

    def openai(self, key: str = "unused") -> openai.OpenAI:
        """The official openai SDK pointed at the app."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, http_client=self.http())


def serve_configs(args: Iterable[str], environment: dict[str, str] | None = None) -> tuple[EngineConfig, ServerConfig]:
    """The configs `statelm serve args` starts a server with, in environment (without the developer's key vars)."""
    captured: list[tuple[EngineConfig, ServerConfig]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "run_server", lambda engine, server: captured.append((engine, server)))
        env: dict[str, str | None] = {**dict.fromkeys(KEY_VARIABLES), **(environment or {})}
        result = CliRunner().invoke(cli, ["serve", *args], env=env)
    assert result.exit_code == 0 and captured, result.output
    return captured[0]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's startup and shutdown, as a server runs them (in the event loop that serves it)."""
    async with LifespanManager(app, startup_timeout=60, shutdown_timeout=60):
        yield


@contextmanager
def built_app(args: Iterable[str], environment: dict[str, str] | None = None) -> Iterator[FastAPI]:
    """The app `statelm serve args` would serve, built in this process; whoever serves it runs its lifespan."""
    threads = torch.get_num_threads()  # `--threads` sets them for the whole process: put them back after
    try:
        yield launch.build_app(*serve_configs(args, environment))[0]
    finally:
        torch.set_num_threads(threads)


@contextmanager
def serve_in_process(args: Iterable[str], environment: dict[str, str] | None = None) -> Iterator[InProcessServer]:
    """The app `statelm serve args` would serve, built in this process, its lifespan run around the block."""
    with (
        built_app(args, environment) as app,
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(lifespan(app)),
    ):
        yield InProcessServer(app, InProcessTransport(app, portal))


def tiny_args(model_dir: Path, state_dir: Path, *extra: str, served_name: str = SERVED_NAME) -> list[str]:
    """`statelm serve` arguments for a tiny model under the name the requests send, plus extra.

    One thread: the tiny model's matrices are too small to share, and a second thread spinning against other
    busy processes slows the start-up self-check from a fraction of a second to minutes.
    """
    model = ["--model", str(model_dir), "--served-model-name", served_name, "--kv-cache-memory", "64MiB"]
    return [*model, "--threads", "1", "--state-dir", str(state_dir), *extra]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint with a ChatML tokenizer and the default model's context length."""
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="package")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state dir (sessions, snapshots) of the shared app."""
    return tmp_path_factory.mktemp("app") / "state"


@pytest.fixture(scope="package")
def server(tiny_model: Path, state_dir: Path) -> Iterator[InProcessServer]:
    """The shared app: the tiny model with the server's default limits and no API keys."""
    with serve_in_process(tiny_args(tiny_model, state_dir)) as running:
        yield running


@pytest.fixture(scope="package")
def api(server: InProcessServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the shared app."""
    with server.http() as client:
        yield client


@pytest.fixture(scope="package")
def client(server: InProcessServer) -> openai.OpenAI:
    """The official openai SDK pointed at the shared app."""
    return server.openai()


@pytest.fixture(scope="package")
def model_name(client: openai.OpenAI) -> str:
    """The id the shared app lists in /v1/models."""
    return client.models.list().data[0].id
