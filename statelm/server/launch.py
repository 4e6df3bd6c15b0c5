"""Starts the engine and serves the app with uvicorn."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from statelm.api.chat import ChatService, ServedModel
from statelm.api.sessions import SessionService
from statelm.config import EngineConfig, ServerConfig
from statelm.engine.builder import BuiltEngine, EngineConfigError, build_engine
from statelm.metrics import ServingMetrics
from statelm.models.loader import ModelLoadError
from statelm.server.app import create_app
from statelm.sessions.manager import SessionManager

log = logging.getLogger("statelm")


class LaunchError(RuntimeError):
    """The server could not start; the message is for the user."""


def build_services(
    built: BuiltEngine, engine_config: EngineConfig, server_config: ServerConfig, metrics: ServingMetrics
) -> tuple[ChatService, SessionService]:
    """Chat and session services over a built engine, answering to the served name and the `--model` value."""
    name = server_config.served_model_name or built.loaded.name
    model = ServedModel(
        name=name,
        aliases=frozenset({engine_config.model, built.loaded.name} - {name}),
        max_model_len=built.engine.engine.max_model_len,
        created=int(time.time()),
    )
    manager = SessionManager(
        built.engine,
        built.loaded.name,
        built.loaded.fingerprint,
        server_config.state_dir,
        server_config.persist_sessions,
    )
    chat = ChatService(built.engine, built.loaded.tokenizer, model, metrics, manager)
    return chat, SessionService(manager)


def configure_logging(level: str) -> None:
    """Plain UTC-timestamped log lines on stderr."""
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.Formatter.converter = time.gmtime


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the model, then serve until interrupted."""
    configure_logging(server_config.log_level)
    started = time.perf_counter()
    try:
        built = build_engine(engine_config)
    except (ModelLoadError, EngineConfigError) as exc:
        raise LaunchError(str(exc)) from None
    metrics = ServingMetrics(built.engine.engine)
    chat, session_service = build_services(built, engine_config, server_config, metrics)
    app = create_app(built.engine, chat, session_service, metrics)
    log.info("model %s loaded in %.1fs", built.loaded.name, time.perf_counter() - started)
    with _graceful_signals_exit_zero():
        uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=server_config.log_level)


@contextmanager
def _graceful_signals_exit_zero() -> Iterator[None]:
    """Make SIGTERM/SIGINT end the process with status 0 once uvicorn has shut down gracefully.

    uvicorn handles the signal (drains, runs the lifespan shutdown that saves sessions), then raises it
    again against the handlers it found at start; with these no-op handlers that re-raise is a no-op.
    """
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
