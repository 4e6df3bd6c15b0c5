"""One engine replica, deployed by Ray Serve: statelm's own app and engine, unchanged, answering forwarded HTTP.

A replica starts holding no session: the router has it adopt sessions from the shared store. Each start is a new
incarnation; a call meant for an earlier one fails (StaleReplicaError), so that nothing is served by a restarted
replica that lost what its earlier incarnation held.

A replica drains when the router asks (the drain route, a scale-down) or when its process gets SIGTERM: it takes no
new request (it answers DRAINING instead, and the router routes the request again), lets running ones finish, saves
every session to the shared store and stops its engine. After a SIGTERM it then exits, and Ray Serve starts a new
incarnation in its place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from starlette.types import Message

from statelm.api.errors import APIError
from statelm.cluster.bridge import DRAINING, ForwardedRequest, run_app
from statelm.cluster.ledger import LedgerTally
from statelm.cluster.sigterm import drain_on_sigterm, exit_process
from statelm.cluster.targets import TargetKind
from statelm.config import EngineConfig, ServerConfig
from statelm.server.launch import build_app, configure_logging
from statelm.sessions.ownership import LOCAL
from statelm.sessions.session import SessionKind

log = logging.getLogger("statelm.cluster")
APP_PREFIX = "statelm-"  # every replica is the Ray Serve application APP_PREFIX + its name
EXIT_AFTER_DRAIN_S = 1.0  # a SIGTERM-drained replica lives this long after its drain, to answer the router's call


class StaleReplicaError(RuntimeError):
    """A call meant for an earlier incarnation of a replica, which restarted and holds nothing of that one's."""


class ReplicaDrainingError(RuntimeError):
    """A call reached a replica that drains (it takes no new work): the router asks another."""


class EngineReplica:
    """statelm's app over one engine, reached through its Ray Serve handle."""

    async def __init__(self, name: str, engine_config: EngineConfig, server_config: ServerConfig, ledger: Any) -> None:
        configure_logging(server_config.log_level)
        self.name = name
        self.incarnation = uuid.uuid4().hex
        tally = LedgerTally(ledger, server_config.max_stored_responses, self._drop_everywhere)
        self.app, self.gate = build_app(engine_config, server_config, tally)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self._closed = False
        self._drained: asyncio.Task[int] | None = None
        loop = asyncio.get_running_loop()
        if not drain_on_sigterm(lambda: loop.call_soon_threadsafe(self._terminate)):
            log.warning("replica %s: this Ray's worker does not handle SIGTERM as statelm expects; SIGTERM ends the "
                        "replica at once (its sessions continue elsewhere from their journals)", name)  # fmt: skip

    async def serve_http(self, request: ForwardedRequest, incarnation: str) -> AsyncIterator[list[Message]]:
        """The app's answer to a request, as batches of ASGI messages."""
        self._check(incarnation)
        if self.gate.draining:  # said as a message, not raised: Ray Serve logs a raised error as a failed request
            yield DRAINING
            return
        async for batch in run_app(self.app, request):
            yield batch

    async def holds(self, kind: TargetKind, key: str, incarnation: str) -> bool:
        """Whether this replica holds that session, stored response or stored completion (whoever owns it)."""
        self._check(incarnation)
        state = self.app.state
        if kind is TargetKind.SESSION:
            return key in state.sessions.manager.sessions
        if kind is TargetKind.RESPONSE:
            return state.responses.chains.find(key, LOCAL, time.time()) is not None
        try:
            state.chat.completions.get(LOCAL, key)
        except APIError:
            return False
        return True

    async def held(self, incarnation: str) -> list[str]:
        """Ids of every session this replica holds, response chains included."""
        self._check(incarnation)
        return list(self.app.state.sessions.manager.sessions)

    async def adopt(self, session_ids: list[str], incarnation: str) -> list[str]:
        """Take over sessions from the shared store (nobody else holds them); the ids taken."""
        self._check(incarnation)
        if self.gate.draining:
            raise ReplicaDrainingError(f"replica {self.name} is draining")
        sessions = await self.app.state.sessions.manager.adopt(session_ids)
        self.app.state.responses.chains.resume(session for session in sessions if session.kind is SessionKind.RESPONSES)
        return [session.id for session in sessions]

    async def recount(self, incarnation: str) -> None:
        """Count every session and stored response this replica holds in the key ledger again (it restarted empty)."""
        self._check(incarnation)
        self.app.state.sessions.manager.recount()
        self.app.state.responses.chains.recount()

    async def drop_responses(self, response_ids: list[str]) -> None:
        """Drop those stored responses if this replica holds them (the retention counted over the cluster)."""
        if not self._closed:
            await self.app.state.responses.drop_stored(response_ids)

    async def info(self) -> dict[str, Any]:
        """Who this replica is (its incarnation, process and Ray actor) and its load."""
        stats = self.app.state.engine.stats()
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "actor": ray.get_runtime_context().current_actor,
            "sessions": len(self.app.state.sessions.manager.sessions),
            "running": stats.running,
            "waiting": stats.waiting,
            "draining": self.gate.draining,
        }

    async def metrics(self) -> bytes:
        """This replica's Prometheus text."""
        return self.app.state.metrics.render()

    async def drain(self, incarnation: str) -> int:
        """Take no new requests, let running ones finish (up to the drain timeout), save every session to the shared
        store and stop the engine; the number of sessions it held. Drains once, whoever asks and however often."""
        self._check(incarnation)
        return await asyncio.shield(self._drain())

    def _drain(self) -> asyncio.Task[int]:
        if self._drained is None:
            self.gate.draining = True
            self._drained = asyncio.create_task(self._drain_once())
        return self._drained

    async def _drain_once(self) -> int:
        deadline = time.monotonic() + self.gate.timeout_s
        while self.gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        held = len(self.app.state.sessions.manager.sessions)
        await self._close()
        log.info("replica %s drained: %d sessions saved to the store", self.name, held)
        return held

    def _terminate(self) -> None:
        """SIGTERM: drain, then end the process (Ray Serve starts a new incarnation)."""
        log.info("replica %s: SIGTERM, draining %d requests in flight", self.name, self.gate.in_flight)
        loop = asyncio.get_running_loop()
        self._drain().add_done_callback(lambda _: loop.call_later(EXIT_AFTER_DRAIN_S, exit_process))

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown (the cluster stopping, an application deleted): the drain, or the end of one
        already under way (a SIGTERM sent to every process of the cluster at once starts both)."""
        await asyncio.shield(self._drain())

    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._lifespan.__aexit__(None, None, None)

    async def _drop_everywhere(self, response_ids: list[str]) -> None:
        """Have every replica drop those stored responses (only the one holding each has it)."""
        status = await asyncio.to_thread(serve.status)  # the replicas there are now (a scale changes them)
        apps = [app for app in status.applications if app.startswith(APP_PREFIX)]
        calls = [serve.get_app_handle(app).drop_responses.remote(response_ids) for app in apps]
        await asyncio.gather(*calls, return_exceptions=True)  # a replica gone has nothing to drop

    def _check(self, incarnation: str) -> None:
        if incarnation != self.incarnation:
            raise StaleReplicaError(f"replica {self.name} restarted; the call was meant for its earlier incarnation")
