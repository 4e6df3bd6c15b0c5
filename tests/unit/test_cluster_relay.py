"""How a replica's answer travels (in batches of ASGI messages) and how the router relays it when the replica drains
or dies mid-answer, over stand-in handles."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("ray")

from ray.exceptions import RayActorError
from starlette.types import Message, Receive, Scope, Send

from statelm.cluster.bridge import DRAINING, ForwardedRequest, run_app
from statelm.cluster.metrics import RouterMetrics
from statelm.cluster.placement import Replica, ReplicaState
from statelm.cluster.router import RouterApp

JSON_START: Message = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
SSE_START: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}


class Answer:
    """A replica's streamed answer: these batches of messages, then (if given) the replica's death."""

    def __init__(self, batches: list[list[Message]], dies: bool) -> None:
        self.batches = batches
        self.dies = dies

    def options(self, **_: object) -> Answer:
        return self

    @property
    def serve_http(self) -> Answer:
        return self

    def remote(self, request: ForwardedRequest, incarnation: str) -> AsyncIterator[list[Message]]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[list[Message]]:
        for batch in self.batches:
            yield batch
        if self.dies:
            raise RayActorError()


class Placement:
    """What the relay tells the placement: a replica lost or draining."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.events: list[str] = []

    async def lost(self, replica: Replica, incarnation: str) -> None:
        self.events.append(f"lost {replica.name}")

    def draining(self, replica: Replica, incarnation: str) -> None:
        self.events.append(f"draining {replica.name}")


def relay(batches: list[list[Message]], dies: bool, path: str = "/v1/chat/completions") -> tuple[bool, list, list]:
    """Relay one answer; whether it was answered, what the client was sent, and what the placement was told."""
    placement = Placement()
    router = RouterApp(placement, None, None, True, 1 << 20)  # type: ignore[arg-type]
    replica = Replica("replica-0", Answer(batches, dies), ReplicaState.LIVE, "incarnation")  # type: ignore[arg-type]
    sent: list[Message] = []

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    request = ForwardedRequest("POST", path, b"", [], b"{}")
    answered = asyncio.run(router._relay(replica, request, receive, send))
    return answered, sent, placement.events


def body(sent: list[Message]) -> bytes:
    return b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")


def test_a_replica_dying_after_its_answer_s_start_but_before_its_body_gives_a_clean_503() -> None:
    answered, sent, events = relay([[JSON_START]], dies=True)
    assert answered and events == ["lost replica-0"]
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 503 and json.loads(body(sent))["error"]["code"] == "replica_unavailable"


def test_a_stream_cut_by_a_replica_s_death_ends_with_an_error_event() -> None:
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    answered, sent, _ = relay([[SSE_START, chunk]], dies=True)
    assert sent[0]["status"] == 200 and (b"x-statelm-replica", b"replica-0") in sent[0]["headers"]
    last = json.loads(sent[-1]["body"].removeprefix(b"data: "))
    assert answered and last["error"]["code"] == "replica_unavailable" and not sent[-1]["more_body"]


def test_a_draining_replica_s_answer_is_not_sent_and_the_request_goes_elsewhere() -> None:
    answered, sent, events = relay([DRAINING], dies=False)
    assert not answered and sent == [] and events == ["draining replica-0"]


def test_an_answer_travels_in_batches_and_a_start_goes_with_the_first_part() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(SSE_START)
        await asyncio.sleep(0.01)  # a prefill: the start waits for the first chunk
        await send({"type": "http.response.body", "body": b"1", "more_body": True})
        await send({"type": "http.response.body", "body": b"2", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def batches() -> list[list[bytes]]:
        request = ForwardedRequest("POST", "/v1/chat/completions", b"", [], b"{}")
        return [[message.get("body", b"start") for message in batch] async for batch in run_app(app, request)]

    assert asyncio.run(batches()) == [[b"start", b"1", b"2"], [b""]]
