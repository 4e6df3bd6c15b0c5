"""The FastAPI application: routers, error handlers and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from statelm.api.chat import ChatService
from statelm.engine.async_engine import AsyncEngine
from statelm.server.errors import install_error_handlers
from statelm.server.routes import health, openai


def create_app(engine: AsyncEngine, chat: ChatService) -> FastAPI:
    """An app serving chat on the given engine; the engine thread stops with the app."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="statelm", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.chat = chat
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    return app
