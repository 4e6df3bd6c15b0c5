"""Session turns on the real server, each checked against the stateless equivalent or another turn: the openai SDK
for chat, raw HTTP for the statelm routes. Snapshot metadata, damaged snapshots, ids and errors are in tests/http.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import delete_state

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = [
    "What is the capital of France?",
    "And what is the capital of Germany?",
    "Name a fruit that is yellow.",
    "Summarize our conversation in one sentence.",
]
TURN_TOKENS = 16  # enough to compare replies; a longer one only makes every later prompt longer


@pytest.fixture
def api(server_url: str) -> Iterator[httpx.Client]:
    """Raw HTTP to the server; every snapshot and session a test leaves behind is deleted after it."""
    with httpx.Client(base_url=server_url, timeout=120) as http:
        yield http
        delete_state(http)


def create_session(api: httpx.Client, **body: Any) -> dict[str, Any]:
    """POST /v1/sessions, asserting 201."""
    response = api.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def turn(client: openai.OpenAI, model: str, session_id: str, content: str, **extra: Any) -> Any:
    """One greedy session turn through the SDK."""
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=TURN_TOKENS,
        extra_body={"session_id": session_id, **extra},
    )


def stateless(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> str:
    """The greedy reply to a full history, without a session."""
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TURN_TOKENS)
    return reply.choices[0].message.content or ""


def history(api: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    """A session's transcript."""
    return api.get(f"/v1/sessions/{session_id}/history").json()["messages"]


def wait_busy(api: httpx.Client, session_id: str, busy: bool) -> dict[str, Any]:
    """The session once a turn runs on it (busy) or none does (not busy)."""
    deadline = time.monotonic() + 10
    while ((session := api.get(f"/v1/sessions/{session_id}").json())["state"] == "busy") != busy:
        assert time.monotonic() < deadline, f"session never became {'busy' if busy else 'idle'}"
        time.sleep(0.02)
    return session


def test_four_turns_equal_stateless_and_reuse_the_whole_conversation(
    client: openai.OpenAI, model_name: str, api: httpx.Client
) -> None:
    create_session(api, session_id="four-turns", system=SYSTEM)
    messages = [{"role": "system", "content": SYSTEM}]
    previous_total = 0
    for index, question in enumerate(QUESTIONS):
        reply = turn(client, model_name, "four-turns", question)
        messages.append({"role": "user", "content": question})
        assert reply.choices[0].message.content == stateless(client, model_name, messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if index > 0:  # everything the session computed: the previous prompt and reply but its last token
            assert cached >= previous_total - 1, (cached, previous_total)
        previous_total = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert history(api, "four-turns") == messages
    session = api.get("/v1/sessions/four-turns").json()
    assert session["num_messages"] == 9
    assert session["num_tokens"] == previous_total - 1
    assert session["state"] == "resident"


def test_rollback_then_turn_equals_the_stateless_equivalent(
    client: openai.OpenAI, model_name: str, api: httpx.Client
) -> None:
    create_session(api, session_id="rollback", system=SYSTEM)
    for question in QUESTIONS[:3]:
        turn(client, model_name, "rollback", question)
    kept = history(api, "rollback")[:3]
    response = api.post("/v1/sessions/rollback/rollback", json={"keep_messages": 3})
    assert response.status_code == 200 and response.json()["num_messages"] == 3
    reply = turn(client, model_name, "rollback", "What did I ask you first?")
    expected = stateless(client, model_name, [*kept, {"role": "user", "content": "What did I ask you first?"}])
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert api.post("/v1/sessions/rollback/rollback", json={"keep_messages": 99}).status_code == 400


def test_fork_diverges_without_touching_the_parent(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    create_session(api, session_id="parent", system=SYSTEM)
    turn(client, model_name, "parent", QUESTIONS[0])
    before = history(api, "parent")
    response = api.post("/v1/sessions/parent/fork", json={"session_id": "child"})
    assert response.status_code == 201 and response.json()["num_tokens"] > 0
    child_reply = turn(client, model_name, "child", "Tell me about Berlin.")
    assert child_reply.usage.prompt_tokens_details.cached_tokens > 0
    assert history(api, "parent") == before
    assert len(history(api, "child")) == len(before) + 2
    parent_reply = turn(client, model_name, "parent", QUESTIONS[1])
    expected = stateless(client, model_name, [*before, {"role": "user", "content": QUESTIONS[1]}])
    assert parent_reply.choices[0].message.content == expected


def test_cancelled_stream_leaves_the_session_unchanged(
    client: openai.OpenAI, server_url: str, model_name: str, api: httpx.Client
) -> None:
    create_session(api, session_id="cancel", system=SYSTEM)
    turn(client, model_name, "cancel", QUESTIONS[0])
    before, tokens_before = history(api, "cancel"), api.get("/v1/sessions/cancel").json()["num_tokens"]
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
        "session_id": "cancel",
    }
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    session = wait_busy(api, "cancel", busy=False)
    assert history(api, "cancel") == before
    assert session["num_tokens"] == tokens_before
    reply = turn(client, model_name, "cancel", QUESTIONS[1])
    assert reply.choices[0].message.content == stateless(
        client, model_name, [*before, {"role": "user", "content": QUESTIONS[1]}]
    )


def test_second_concurrent_turn_gets_409(
    client: openai.OpenAI, server_url: str, model_name: str, api: httpx.Client
) -> None:
    create_session(api, session_id="busy")
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 64,  # busy for the two requests that the test sends meanwhile, with room to spare
        "ignore_eos": True,
        "session_id": "busy",
    }
    first = threading.Thread(target=lambda: httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=120))
    first.start()
    try:
        wait_busy(api, "busy", busy=True)
        with pytest.raises(openai.ConflictError) as error:
            turn(client, model_name, "busy", "Hello?")
        assert error.value.body["code"] == "session_busy"
        assert api.delete("/v1/sessions/busy").status_code == 409
    finally:
        first.join()
    assert len(history(api, "busy")) == 2


def test_snapshot_load_continues_exactly_like_the_original(
    client: openai.OpenAI, model_name: str, api: httpx.Client
) -> None:
    create_session(api, session_id="original", system=SYSTEM)
    for question in QUESTIONS[:2]:
        turn(client, model_name, "original", question)
    response = api.post("/v1/sessions/original/snapshot", json={"title": "two turns", "tags": ["geo"]})
    assert response.status_code == 201, response.text
    snapshot = response.json()
    assert snapshot["num_tokens"] == api.get("/v1/sessions/original").json()["num_tokens"]
    assert snapshot["size_bytes"] > 0 and snapshot["title"] == "two turns"
    loaded = api.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "restored"})
    assert loaded.status_code == 201, loaded.text
    assert loaded.json()["num_tokens"] == snapshot["num_tokens"]
    assert history(api, "restored") == history(api, "original")
    original = turn(client, model_name, "original", QUESTIONS[2])
    restored = turn(client, model_name, "restored", QUESTIONS[2])
    assert restored.choices[0].message.content == original.choices[0].message.content
    assert restored.usage.prompt_tokens_details.cached_tokens == original.usage.prompt_tokens_details.cached_tokens
    assert restored.usage.prompt_tokens_details.cached_tokens >= snapshot["num_tokens"] - 1
    conflict = api.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "restored"})
    assert conflict.status_code == 409
    replaced = api.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "restored", "overwrite": True})
    assert replaced.status_code == 201 and replaced.json()["num_messages"] == snapshot["num_messages"]


def test_a_turn_ended_by_a_stop_string_is_committed(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    create_session(api, session_id="stopped")
    reply = turn(client, model_name, "stopped", QUESTIONS[0], stop=[" is "])  # the model goes on after " is "
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and text == "The capital of France"
    assert history(api, "stopped")[-1] == {"role": "assistant", "content": text}
    held = api.get("/v1/sessions/stopped").json()["num_tokens"]
    assert held >= reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    follow_up = turn(client, model_name, "stopped", "Go on.")
    messages = [*history(api, "stopped")[:-2], {"role": "user", "content": "Go on."}]
    assert follow_up.choices[0].message.content == stateless(client, model_name, messages)
    assert follow_up.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
