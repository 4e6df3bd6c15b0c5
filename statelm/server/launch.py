"""Starts the engine and serves the app with uvicorn, draining on SIGTERM."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from statelm.api.conversation import ConversationService
from statelm.api.limits import GenerationLimits
from statelm.api.openai.chat import ChatService
from statelm.api.openai.stored_completions import CompletionStore
from statelm.api.responses.chains import ResponseRetention
from statelm.api.responses.service import ResponsesService
from statelm.api.serving import ServedModel, ServingContext, sampling_defaults, system_fingerprint
from statelm.api.sessions import KVFootprint, SessionService
from statelm.config import EngineConfig, ServerConfig
from statelm.engine.builder import BuiltEngine, EngineConfigError, build_engine
from statelm.host_memory import available_host_memory
from statelm.metrics import ServingMetrics
from statelm.models.loader import ModelLoadError
from statelm.server.app import Guards, create_app
from statelm.server.auth import KeyRing
from statelm.server.drain import DrainGate, DrainingServer
from statelm.server.embedding_models import embedding_service
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.manager import SessionLimits, SessionManager
from statelm.sessions.tally import KeyTally
from statelm.webui import DIST

log = logging.getLogger("statelm")
SHUTDOWN_GRACE_S = 5  # after a drain, what uvicorn gives the requests still running before cancelling them


class LaunchError(RuntimeError):
    """The server could not start; the message is for the user."""


def build_services(
    built: BuiltEngine,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    metrics: ServingMetrics,
    limits: GenerationLimits,
    tally: KeyTally | None = None,
) -> tuple[ChatService, SessionService, ResponsesService]:
    """Chat, session and responses services over a built engine, answering to the served name and the `--model`
    value (with tally, a key's limits count what it holds on every server sharing it)."""
    name = server_config.served_model_name or built.loaded.name
    info = built.engine.info
    output_settings = {
        "device": built.loaded.device.type,
        "quantization": engine_config.quantization,
        "activations": built.loaded.model.activations,  # `auto` resolved
        "batch_invariant": engine_config.batch_invariant,
        "sampling_defaults": info.sampling_defaults,
    }
    model = ServedModel(
        name=name,
        aliases=frozenset({engine_config.model, built.loaded.name} - {name}),
        max_model_len=info.max_model_len,
        created=int(time.time()),
        system_fingerprint=system_fingerprint(built.loaded.fingerprint.digest, output_settings),
    )
    manager = SessionManager(
        built.engine,
        built.loaded.name,
        built.loaded.fingerprint,
        DirectoryStore(server_config.state_dir),
        server_config.session_durability,
        SessionLimits(server_config.max_sessions_per_key, server_config.snapshot_quota),
        metrics.journal,
        resume=server_config.resume_sessions,
        tally=tally,
        persist_idle_after=server_config.persist_idle_after,
    )
    try:
        context = ServingContext(
            built.engine,
            built.loaded.tokenizer,
            model,
            metrics,
            limits,
            sampling_defaults(info.sampling_defaults),
            tool_parser=server_config.tool_parser,
            reasoning_parser=server_config.reasoning_parser,
        )
    except ValueError as exc:  # an unknown --tool-parser or --reasoning-parser
        raise LaunchError(str(exc)) from None
    conversations = ConversationService(context, manager)
    chat = ChatService(conversations, CompletionStore(server_config.max_stored_completions))
    retention = ResponseRetention(server_config.max_stored_responses, server_config.response_retention)
    footprint = KVFootprint(info.kv_format, info.kv_bytes_per_token)
    return chat, SessionService(manager, footprint), ResponsesService(conversations, retention)


def generation_limits(server_config: ServerConfig, context_length: int) -> GenerationLimits:
    """The caps on one generation request that the server was started with, for a model of that context."""
    return GenerationLimits(
        max_messages=server_config.max_messages,
        max_prompt_tokens=server_config.max_prompt_tokens,
        max_completion_tokens=server_config.max_completion_tokens,
        context_length=context_length,
    )


def key_ring(server_config: ServerConfig) -> KeyRing | None:
    """The API keys the server requires, or None when none are configured (one local user, no checks)."""
    users = [key.strip() for key in server_config.api_keys]
    admins = [key.strip() for key in server_config.admin_keys]
    if not all(users + admins):
        raise LaunchError("an API key is empty")
    key_file = server_config.api_key_file
    if not users and not admins and key_file is None:
        return None
    if key_file is not None and not key_file.is_file():
        raise LaunchError(f"the API key file {key_file} does not exist")
    return KeyRing(users, admins, key_file)


def is_loopback(host: str) -> bool:
    """Whether host names only this machine (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure_logging(level: str) -> None:
    """Plain UTC-timestamped log lines on stderr."""
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.Formatter.converter = time.gmtime


def build_app(
    engine_config: EngineConfig, server_config: ServerConfig, tally: KeyTally | None = None
) -> tuple[FastAPI, DrainGate]:
    """Load the model and build the application (and the gate its server drains through), without serving it; with
    tally, the per-key limits count over every server sharing it (a cluster's replicas)."""
    keys = key_ring(server_config)
    host_memory = available_host_memory()  # before the models take theirs
    try:
        built = build_engine(engine_config)
    except (ModelLoadError, EngineConfigError) as exc:
        raise LaunchError(str(exc)) from None
    metrics = ServingMetrics(built.engine)
    limits = generation_limits(server_config, built.engine.info.max_model_len)
    chat, session_service, responses = build_services(built, engine_config, server_config, metrics, limits, tally)
    try:
        embeddings = embedding_service(built, chat.context.model, engine_config, metrics, limits, host_memory)
    except (ModelLoadError, ValueError) as exc:
        built.engine.shutdown()
        raise LaunchError(str(exc)) from None
    guards = Guards(
        keys=keys,
        public_metrics=not server_config.metrics_require_key,
        max_body_bytes=server_config.max_request_bytes,
        generation_limits=limits,
        drain=DrainGate(server_config.drain_timeout),
        webui=DIST if server_config.webui else None,
    )
    app = create_app(
        built.engine,
        chat,
        session_service,
        responses,
        metrics,
        guards,
        server_config.sse_keepalive,
        allowed_origins=server_config.allowed_origins,
        embedding_service=embeddings,
    )
    app.state.model_name = built.loaded.name
    return app, guards.drain


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the model, then serve until a signal; the first SIGTERM or SIGINT drains, then the process exits 0."""
    configure_logging(server_config.log_level)
    if key_ring(server_config) is None and not is_loopback(server_config.host):
        log.warning(
            "binding %s without API keys: anyone who can reach this address can read and delete every session "
            "and snapshot; pass --api-key or --api-key-file",
            server_config.host,
        )
    listener = bind_listener(server_config)
    started = time.perf_counter()
    app, drain = build_app(engine_config, server_config)
    log.info("model %s loaded in %.1fs", app.state.model_name, time.perf_counter() - started)
    serve_http(app, server_config, drain, listener)


def bind_listener(server_config: ServerConfig) -> socket.socket:
    """The server's address, bound before anything loads: a port in use fails the start at once (not after the
    model has loaded), and no other process can take the port meanwhile; it listens from serve_http on."""
    host, port = server_config.host, server_config.port
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return listener


def serve_http(app: ASGIApp, server_config: ServerConfig, gate: DrainGate, listener: socket.socket) -> None:
    """Serve app with uvicorn on the bound listener until a signal drains it through gate."""
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    DrainingServer(config, gate).run(sockets=[listener])
