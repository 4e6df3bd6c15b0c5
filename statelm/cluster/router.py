"""The cluster's HTTP endpoint: an ASGI app that forwards each request, streams included, to the replica that
should answer it through Ray Serve, and answers /health, /metrics and /v1/cluster itself.

Every other route is answered by a replica running statelm's own app, so routes, auth, ownership, limits and error
shapes are a single server's by construction; the router only reads what it needs to route (the path and a few body
fields) and enforces the body size before it buffers a body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import RequestCancelledError
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from statelm.api.errors import APIError
from statelm.cluster.bridge import DRAINING, ForwardedRequest
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.placement import NoReplicaError, Placement, Replica
from statelm.cluster.replica import StaleReplicaError
from statelm.cluster.scaling import NoRoomError, Scaler
from statelm.cluster.targets import TargetKind, classify
from statelm.server.auth import KeyRing, presented_key
from statelm.server.errors import error_body, error_response
from statelm.server.limits import body_too_large, read_body
from statelm.sessions.ownership import LOCAL, Principal

log = logging.getLogger(__name__)
CLUSTER_PATH = "/v1/cluster"
SCALE_PATH = f"{CLUSTER_PATH}/scale"
ATTEMPTS = 3  # tries of a request whose replica turned out to have restarted or to drain
REPLICA_HEADER = b"x-statelm-replica"  # on every forwarded answer: the replica that gave it


class ScaleRequest(BaseModel):
    """Body of POST /v1/cluster/scale: how many replicas the cluster should have."""

    model_config = ConfigDict(extra="forbid", strict=True)
    replicas: int = Field(ge=1)


def unavailable(message: str) -> APIError:
    """503 for a request no replica could finish."""
    return APIError(message, status=503, type="server_error", code="replica_unavailable")


class RouterApp:
    """The ASGI app in front of the replicas."""

    def __init__(
        self, placement: Placement, scaler: Scaler, keys: KeyRing | None, public_metrics: bool, max_body_bytes: int
    ) -> None:
        self.placement = placement
        self.scaler = scaler
        self.keys = keys
        self.public_metrics = public_metrics
        self.max_body_bytes = max_body_bytes
        self.metrics: RouterMetrics = placement.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one connection's request, or the lifespan's start and stop."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        own = {"/health": self._health, "/metrics": self._metrics, CLUSTER_PATH: self._status}
        if path in own:
            response = await own[path](scope)
        elif path.startswith(f"{CLUSTER_PATH}/replicas/") and path.endswith("/drain") and scope["method"] == "POST":
            response = await self._drain(scope, path.split("/")[4])
        elif path == SCALE_PATH and scope["method"] == "POST":
            response = await self._scale(scope, receive)
        else:
            await self._forward(scope, receive, send)
            return
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.placement.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.placement.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- forwarding ---------------------------------------------------------------------------------

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive, self.max_body_bytes)
        if body is None:
            await error_response(body_too_large(self.max_body_bytes), scope["path"])(scope, receive, send)
            return
        request = ForwardedRequest.from_scope(scope, body)
        target = classify(request.method, request.path, body)
        try:
            if target.kind is TargetKind.SESSION_LIST:
                response = await self._session_list(request)
                await response(scope, receive, send)
                return
            for _ in range(ATTEMPTS):
                choice = await self.placement.route(target)
                replica = self.placement.replicas[choice.replica]
                self.metrics.routed.labels(replica.name, choice.reason).inc()
                if await self._relay(replica, request, receive, send):
                    return
        except NoReplicaError as exc:
            await error_response(unavailable(str(exc)), request.path)(scope, receive, send)
            return
        error = unavailable("no replica could take the request; retry")
        await error_response(error, request.path)(scope, receive, send)

    async def _relay(self, replica: Replica, request: ForwardedRequest, receive: Receive, send: Send) -> bool:
        """Stream the replica's answer to the client; False if the replica restarted or drains (nothing was sent).

        The answer's start goes out with its first body part, so that a replica dying before that gives a clean error
        response rather than a cut one; once a stream has started, an error event ends it.
        """
        incarnation = replica.incarnation
        answer = replica.handle.options(stream=True).serve_http.remote(request, incarnation)
        start: Message | None = None
        started = complete = False
        gone = asyncio.create_task(_disconnected(receive))
        # only if the client went away: once the answer is whole, the server reports a disconnect too, and a cancel
        # then would cancel what the replica's request started and has yet to finish (a key ledger call, say)
        gone.add_done_callback(lambda task: task.cancelled() or complete or answer.cancel())
        replica.in_flight += 1
        try:
            async for batch in answer:
                if batch == DRAINING:
                    self.placement.draining(replica, incarnation)
                    return False
                for message in batch:
                    if message["type"] == "http.response.start":
                        start = {**message, "headers": [*message["headers"], (REPLICA_HEADER, replica.name.encode())]}
                        continue
                    if start is not None and not started:
                        await send(start)
                        started = True
                    complete = message["type"] == "http.response.body" and not message.get("more_body", False)
                    await send(message)
        except StaleReplicaError:
            await self.placement.lost(replica, incarnation)
            return False
        except RequestCancelledError:
            pass  # the client went away
        except RayError as exc:
            died = isinstance(exc, RayActorError)
            if died:
                await self.placement.lost(replica, incarnation)
            log.warning("request %s %s on replica %s failed: %s", request.method, request.path, replica.name, exc)
            error = unavailable(f"replica {replica.name} {'died' if died else 'failed'} while answering; retry")
            await _fail(error, request.path, start if started else None, send)
        finally:
            replica.in_flight -= 1
            gone.cancel()
        return True

    async def _session_list(self, request: ForwardedRequest) -> Response:
        """Every live replica's sessions, least recently used first (or the first refusal, e.g. a 401)."""
        live = self.placement.live()
        if not live:
            raise NoReplicaError("no replica is serving")
        answers = await asyncio.gather(*(_collect(replica, request) for replica in live))
        sessions: list[dict[str, Any]] = []
        for status, body in answers:
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
            sessions.extend(json.loads(body)["data"])
        sessions.sort(key=lambda session: session["last_used"])
        return JSONResponse({"object": "list", "data": sessions})

    # --- the router's own routes --------------------------------------------------------------------

    async def _health(self, scope: Scope) -> Response:
        states = {replica.name: replica.state.value for replica in self.placement.replicas.values()}
        ok = bool(self.placement.live())
        return JSONResponse({"status": "ok" if ok else "degraded", "replicas": states}, status_code=200 if ok else 503)

    async def _metrics(self, scope: Scope) -> Response:
        refusal = self._refusal(scope, lambda principal: True) if not self.public_metrics else None
        if refusal is not None:
            return refusal
        live = self.placement.live()
        texts = await asyncio.gather(*(replica.handle.metrics.remote() for replica in live), return_exceptions=True)
        replica_texts = {r.name: text.decode() for r, text in zip(live, texts, strict=True) if isinstance(text, bytes)}
        return Response(self.metrics.render(replica_texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _status(self, scope: Scope) -> Response:
        refusal = self._refusal(scope, lambda principal: True)
        if refusal is not None:
            return refusal
        replicas = list(self.placement.replicas.values())
        infos = await asyncio.gather(
            *(asyncio.wait_for(r.handle.info.remote(), 5) for r in self.placement.live()), return_exceptions=True
        )
        details = {info["name"]: info for info in infos if isinstance(info, dict)}
        rows = [
            {
                "name": replica.name,
                "state": replica.state.value,
                "pid": replica.pid,
                "in_flight": replica.in_flight,
                "sessions": details.get(replica.name, {}).get("sessions"),
                "running": details.get(replica.name, {}).get("running"),
                "waiting": details.get(replica.name, {}).get("waiting"),
            }
            for replica in replicas
        ]
        return JSONResponse({"object": "cluster", "policy": self.placement.balancer.policy.value, "replicas": rows})

    async def _drain(self, scope: Scope, name: str) -> Response:
        refusal = self._refusal(scope, lambda principal: principal.admin)
        if refusal is not None:
            return refusal
        try:
            saved = await self.placement.drain(name)
        except KeyError:
            error = APIError(f"no live replica named {name!r}", status=404, type="not_found_error", param="replica")
            return error_response(error, scope["path"])
        return JSONResponse({"object": "cluster.replica", "name": name, "state": "drained", "sessions": saved})

    async def _scale(self, scope: Scope, receive: Receive) -> Response:
        refusal = self._refusal(scope, lambda principal: principal.admin)
        if refusal is not None:
            return refusal
        body = await read_body(receive, self.max_body_bytes)
        if body is None:
            return error_response(body_too_large(self.max_body_bytes), scope["path"])
        try:
            count = ScaleRequest.model_validate_json(body).replicas
        except ValidationError as exc:
            problem = exc.errors()[0]
            param = ".".join(map(str, problem["loc"])) or None
            error = APIError(f'{param or "body"}: {problem["msg"]} (send {{"replicas": N}}, N ≥ 1)', param=param)
            return error_response(error, scope["path"])
        try:
            added, removed = await self.scaler.scale(count)
        except NoRoomError as exc:
            error = APIError(str(exc), status=409, type="invalid_request_error", param="replicas", code="no_room")
            return error_response(error, scope["path"])
        status = await self._status(scope)
        body = {**json.loads(status.body), "added": added, "removed": removed}
        return JSONResponse(body)

    def _refusal(self, scope: Scope, allowed: Callable[[Principal], bool]) -> Response | None:
        """None if the request's key may use a router route; else its 401 or 403."""
        principal = self._principal(scope)
        if principal is None:
            error = APIError("Incorrect or missing API key.", status=401, type="authentication_error",
                             code="invalid_api_key")  # fmt: skip
            return error_response(error, scope["path"], {"WWW-Authenticate": "Bearer"})
        if not allowed(principal):
            error = APIError("This needs an admin key.", status=403, type="permission_error", code="admin_only")
            return error_response(error, scope["path"])
        return None

    def _principal(self, scope: Scope) -> Principal | None:
        if self.keys is None:
            return LOCAL
        key = presented_key(dict(scope["headers"]))
        return self.keys.principal(key) if key is not None else None


async def _collect(replica: Replica, request: ForwardedRequest) -> tuple[int, bytes]:
    """A replica's whole answer to a request: status and body."""
    status, chunks = 500, []
    async for batch in replica.handle.options(stream=True).serve_http.remote(request, replica.incarnation):
        for message in batch:
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                chunks.append(message.get("body", b""))
    return status, b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _fail(error: APIError, path: str, sent_start: Message | None, send: Send) -> None:
    """Answer error; once an answer has started, end an event stream with an error event (any other answer is cut
    short: its length was promised)."""
    if sent_start is None:
        response = error_response(error, path)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})
        return
    content_type = dict(sent_start["headers"]).get(b"content-type", b"")
    if content_type.startswith(b"text/event-stream"):
        event: Message = {"type": "http.response.body", "body": _error_event(error, path), "more_body": False}
        await send(event)


def _error_event(error: APIError, path: str) -> bytes:
    data = json.dumps(error_body(error, path))
    return (
        f"event: error\ndata: {data}\n\n".encode() if path.startswith("/v1/messages") else f"data: {data}\n\n".encode()
    )
