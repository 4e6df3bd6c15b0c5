"""The FastAPI application: routers, error handlers, response accounting and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from statelm.api.chat import ChatService
from statelm.engine.async_engine import AsyncEngine
from statelm.metrics import ServingMetrics
from statelm.server.errors import install_error_handlers
from statelm.server.routes import health, metrics, openai


def create_app(engine: AsyncEngine, chat: ChatService, serving_metrics: ServingMetrics) -> FastAPI:
    """An app serving chat on the given engine; the engine thread stops with the app."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="statelm", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.chat = chat
    app.state.metrics = serving_metrics
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)

    @app.middleware("http")
    async def count_responses(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        serving_metrics.http_responses.labels(path, str(response.status_code)).inc()
        return response

    return app
