"""Request limits in-process on the tiny model: each gives its documented status, and malformed bodies never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import delete_state
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args

KEYS = ("limits-key-1", "limits-key-2")
MAX_BODY = 64 * 1024
MAX_PROMPT_TOKENS = 80  # four "Say hi." messages take 65 tokens of the tiny model's ChatML prompt
SNAPSHOT_QUOTA = 24 * 1024  # a session of about 30 tokens takes about 17 KB (512 bytes of float32 KV a token)


@pytest.fixture(scope="module")
def limited(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app with small limits and two keys."""
    args = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--max-request-bytes", str(MAX_BODY)]
    args += ["--api-key", KEYS[0], "--api-key", KEYS[1]]
    args += ["--max-messages", "4", "--max-completion-tokens", "8", "--max-prompt-tokens", str(MAX_PROMPT_TOKENS)]
    args += ["--max-sessions-per-key", "2", "--snapshot-quota", str(SNAPSHOT_QUOTA)]
    with serve_in_process(tiny_args(tiny_model, tmp_path_factory.mktemp("limits") / "state", *args)) as running:
        yield running


@pytest.fixture
def users(limited: InProcessServer) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Raw HTTP as each key; their sessions and snapshots are deleted after the test."""
    clients = [limited.http(headers={"X-Api-Key": key}) for key in KEYS]
    yield clients[0], clients[1]
    for client in clients:
        delete_state(client)
        client.close()


def chat_body(content: str = "Say hi.", count: int = 1, **extra: Any) -> dict[str, Any]:
    """A chat request with count user messages."""
    messages = [{"role": "user", "content": content}] * count
    return {"model": "default", "messages": messages, "temperature": 0, **extra}


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The error object of response, after checking its status, its code and that it has a message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    return error


def test_a_body_over_the_size_limit_gets_413(users: tuple[httpx.Client, httpx.Client]) -> None:
    user, _ = users
    big = {"session_id": "big", "system": "x" * MAX_BODY}
    assert_error(user.post("/v1/sessions", json=big), 413, "request_too_large")
    chunks = (b" " * 1024 for _ in range(MAX_BODY // 1024 + 1))  # no Content-Length: sent chunked
    assert_error(user.post("/v1/chat/completions", content=chunks), 413, "request_too_large")
    assert user.post("/v1/sessions", json={"session_id": "small", "system": "x" * 1000}).status_code == 201


def test_too_many_messages_or_tokens_get_400(users: tuple[httpx.Client, httpx.Client]) -> None:
    user, _ = users
    error = assert_error(user.post("/v1/chat/completions", json=chat_body(count=5)), 400, "too_many_messages")
    assert error["param"] == "messages"
    for field in ("max_tokens", "max_completion_tokens"):
        response = user.post("/v1/chat/completions", json=chat_body(**{field: 9}))
        assert assert_error(response, 400, "max_tokens_exceeded")["param"] == field
    long_prompt = chat_body("hello " * MAX_PROMPT_TOKENS)  # at least a token a word
    assert_error(user.post("/v1/chat/completions", json=long_prompt), 400, "prompt_too_long")
    reply = user.post("/v1/chat/completions", json=chat_body(count=4, ignore_eos=True)).json()
    assert reply["usage"]["completion_tokens"] == 8  # the cap is also the default length


def test_sessions_per_key_are_capped_with_429(users: tuple[httpx.Client, httpx.Client]) -> None:
    first, second = users
    for name in ("one", "two"):
        assert first.post("/v1/sessions", json={"session_id": name}).status_code == 201
    error = assert_error(first.post("/v1/sessions", json={}), 429, "session_limit_reached")
    assert error["type"] == "rate_limit_error"
    assert_error(first.post("/v1/sessions/one/fork", json={}), 429, "session_limit_reached")
    snapshot = first.post("/v1/sessions/one/snapshot", json={}).json()["id"]
    assert_error(first.post(f"/v1/snapshots/{snapshot}/load", json={}), 429, "session_limit_reached")
    assert second.post("/v1/sessions", json={"session_id": "other"}).status_code == 201  # the cap is per key
    assert first.delete("/v1/sessions/two").status_code == 200
    assert first.post(f"/v1/snapshots/{snapshot}/load", json={"session_id": "two"}).status_code == 201


def test_snapshot_bytes_past_the_quota_get_507(users: tuple[httpx.Client, httpx.Client]) -> None:
    for index, user in enumerate(users):
        assert user.post("/v1/sessions", json={"session_id": f"quota-{index}"}).status_code == 201
        body = chat_body("Hello there.", max_tokens=4, session_id=f"quota-{index}")
        assert user.post("/v1/chat/completions", json=body).status_code == 200
    first, second = users
    snapshot = first.post("/v1/sessions/quota-0/snapshot", json={}).json()
    assert SNAPSHOT_QUOTA / 2 < snapshot["size_bytes"] < SNAPSHOT_QUOTA
    error = assert_error(first.post("/v1/sessions/quota-0/snapshot", json={}), 507, "snapshot_quota_exceeded")
    assert error["type"] == "insufficient_quota"
    assert len(first.get("/v1/snapshots").json()["data"]) == 1
    assert second.post("/v1/sessions/quota-1/snapshot", json={}).status_code == 201  # the quota is per key
    assert first.delete(f"/v1/snapshots/{snapshot['id']}").status_code == 200
    assert first.post("/v1/sessions/quota-0/snapshot", json={}).status_code == 201


MALFORMED_BODIES = [b"[]", b"1", b'"text"', b"{", b"\xff\xfe", b"[" * 50_000, b'{"unknown_field": 1}']
WRONG_TYPES = {
    "/v1/chat/completions": [{"model": 1, "messages": []}, {"model": "default", "messages": "hi"}],
    "/v1/sessions": [{"session_id": 5}, {"max_tokens": "10"}, {"max_tokens": True}, {"system": ["x"]}],
    "/v1/sessions/probe/rollback": [{"keep_messages": "1"}, {"keep_messages": 1.5}, {}],
    "/v1/sessions/probe/fork": [{"session_id": ["x"]}],
    "/v1/sessions/probe/snapshot": [{"tags": "x"}, {"title": 3}],
    "/v1/snapshots/snap-probe/load": [{"overwrite": "yes"}],
}
REQUIRED_BODIES = {"/v1/chat/completions", "/v1/sessions/probe/rollback"}


@pytest.mark.parametrize("path", list(WRONG_TYPES))
def test_malformed_bodies_get_400_or_422_never_500(users: tuple[httpx.Client, httpx.Client], path: str) -> None:
    user, _ = users
    user.post("/v1/sessions", json={"session_id": "probe"})
    bodies = [*MALFORMED_BODIES, *(json.dumps(body).encode() for body in WRONG_TYPES[path])]
    if path in REQUIRED_BODIES:  # elsewhere no body (or null) is a valid request
        bodies.append(b"")
    for body in bodies:
        response = user.post(path, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code in (400, 422), (path, body[:40], response.status_code, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    patch = user.patch("/v1/snapshots/snap-probe", json={"tags": [1]})
    assert patch.status_code == 400


def test_metrics_stay_public_and_health_answers_without_a_key(limited: InProcessServer) -> None:
    with limited.http() as anonymous:
        assert anonymous.get("/metrics").status_code == 200
        assert anonymous.get("/health").json()["status"] == "ok"
        assert anonymous.get("/v1/models").status_code == 401
