"""The FastAPI application: routers, error handlers, response accounting and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from statelm.api.chat import ChatService
from statelm.api.sessions import SessionService
from statelm.engine.async_engine import AsyncEngine
from statelm.metrics import ServingMetrics
from statelm.server.errors import install_error_handlers
from statelm.server.routes import health, metrics, openai, sessions


def create_app(
    engine: AsyncEngine, chat: ChatService, session_service: SessionService, serving_metrics: ServingMetrics
) -> FastAPI:
    """An app serving chat and sessions on the given engine; sessions are saved and the engine stopped at exit."""
    manager = session_service.manager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        try:
            yield
        finally:
            await manager.close()
            engine.shutdown()

    app = FastAPI(title="statelm", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.chat = chat
    app.state.sessions = session_service
    app.state.metrics = serving_metrics
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)
    app.include_router(sessions.router)

    @app.middleware("http")
    async def count_responses(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        serving_metrics.http_responses.labels(path, str(response.status_code)).inc()
        return response

    return app
