"""The FastAPI application: routers, guards, error handlers, response accounting and the engine's lifetime."""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from statelm.api.anthropic.service import MessagesService
from statelm.api.embeddings.models import EmbeddingModels
from statelm.api.embeddings.service import EmbeddingService
from statelm.api.limits import GenerationLimits
from statelm.api.openai.chat import ChatService
from statelm.api.responses.service import ResponsesService
from statelm.api.sessions import SessionService
from statelm.engine.client import EngineClient
from statelm.metrics import ServingMetrics
from statelm.server.auth import AuthMiddleware, KeyRing
from statelm.server.drain import DrainGate, DrainMiddleware
from statelm.server.errors import install_error_handlers
from statelm.server.limits import RequestLimitMiddleware
from statelm.server.openapi import install_openapi
from statelm.server.request_id import RequestIdMiddleware
from statelm.server.response_count import ResponseCountMiddleware
from statelm.server.routes import anthropic, embeddings, health, metrics, openai, sessions
from statelm.server.routes import responses as responses_routes
from statelm.server.webui import ASSETS_PREFIX, install_webui

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"


@dataclass
class Guards:
    """What stands before the routes: API keys, request limits, and the gate that drains at shutdown."""

    keys: KeyRing | None  # None: no keys, one local user owns everything
    public_metrics: bool
    max_body_bytes: int
    generation_limits: GenerationLimits
    drain: DrainGate
    webui: Path | None = None  # the built web UI served at `/` (its files are public), or None: no UI

    def public_paths(self) -> frozenset[str]:
        """Routes answered without a key."""
        paths = {HEALTH_PATH, METRICS_PATH} if self.public_metrics else {HEALTH_PATH}
        return frozenset(paths | {"/"} if self.webui is not None else paths)

    def public_prefixes(self) -> tuple[str, ...]:
        """Path prefixes answered without a key: the web UI's files."""
        return (f"{ASSETS_PREFIX}/",) if self.webui is not None else ()


_frozen_apps = 0  # apps of this process running with the start-up heap frozen
_frozen_apps_lock = threading.Lock()


def freeze_start_up_heap() -> None:
    """Take what start-up built (the model's tables, the vocabulary, the routes and schemas) out of the garbage
    collector's scans, once its own garbage is collected.

    A full collection walks every tracked object while holding the GIL: with the default model's 240,000 objects it
    paused the event loop and the engine's Python for 120 ms, longer with a larger vocabulary, at moments no
    request chooses. Frozen objects stay alive as they would anyway; only cycles they later join are not collected.
    """
    global _frozen_apps
    with _frozen_apps_lock:
        _frozen_apps += 1
        gc.collect()
        gc.freeze()


def thaw_start_up_heap() -> None:
    """Give the frozen objects back to the collector once the last app of the process has stopped, so that the
    interpreter's exit collects them as usual (native bindings check for leaks then)."""
    global _frozen_apps
    with _frozen_apps_lock:
        _frozen_apps -= 1
        if _frozen_apps == 0:
            gc.unfreeze()


def create_app(
    engine: EngineClient,
    chat: ChatService,
    session_service: SessionService,
    responses: ResponsesService,
    serving_metrics: ServingMetrics,
    guards: Guards,
    sse_keepalive: float = 10.0,
    allowed_origins: list[str] | None = None,
    embedding_service: EmbeddingService | None = None,
) -> FastAPI:
    """An app serving chat, responses and sessions on the given engine; sessions (response chains too) are saved
    and the engine stopped at exit.

    Streams get an SSE comment every `sse_keepalive` seconds (so that proxies keep a long prefill open).
    """
    manager = session_service.manager
    embedding_service = embedding_service or EmbeddingService(EmbeddingModels([]))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        await responses.start()
        freeze_start_up_heap()
        try:
            yield
        finally:
            await manager.close()
            embedding_service.close()
            engine.shutdown()
            thaw_start_up_heap()

    app = FastAPI(title="statelm", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.chat = chat
    app.state.sessions = session_service
    app.state.responses = responses
    app.state.messages = MessagesService(chat.conversations)
    app.state.noted_betas = set()  # anthropic-beta names already logged as ignored
    app.state.metrics = serving_metrics
    serving_metrics.watch_storage(manager.health, lambda: len(manager.owed()))
    app.state.drain = guards.drain
    app.state.sse_keepalive = sse_keepalive
    app.state.invariance = engine.info.batch_invariance
    app.state.embeddings = embedding_service
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)
    app.include_router(embeddings.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic.router)
    app.include_router(sessions.router)
    if guards.webui is not None:
        install_webui(app, guards.webui)
    install_openapi(app, keyed=guards.keys is not None, public_paths=guards.public_paths())

    # Middleware added last runs first: responses are counted, then drain, keys and limits are checked.
    app.add_middleware(RequestLimitMiddleware, max_body_bytes=guards.max_body_bytes, limits=guards.generation_limits)
    app.add_middleware(
        AuthMiddleware, keys=guards.keys, public_paths=guards.public_paths(), public_prefixes=guards.public_prefixes()
    )
    app.add_middleware(DrainMiddleware, gate=guards.drain, exempt_paths=frozenset({HEALTH_PATH}))

    app.add_middleware(ResponseCountMiddleware, counter=serving_metrics.http_responses)
    app.add_middleware(RequestIdMiddleware)  # every answer, 401s and 413s too
    if allowed_origins:  # outermost: a preflight carries no key, and every answer (401s too) needs the headers
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return app
