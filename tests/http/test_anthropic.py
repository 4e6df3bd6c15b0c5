"""Anthropic's Messages API in-process on the tiny model: every field honoured or refused with a 400 in Anthropic's
shape, the reply against the SDK's own models, the stream's event grammar, usage from what the engine reused, and
the errors of the guards before the routes (keys, body limits) in Anthropic's shape on its routes only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.e2e.test_tools import TOOLS
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args
from tests.http.typed_events import typed_events

ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (tool["function"] for tool in TOOLS)
]
VERDICT_TOOL = {
    "name": "verdict",
    "description": "Say whether it is fine.",
    "input_schema": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
}
EVENTS = TypeAdapter(RawMessageStreamEvent)
HELLO = [{"role": "user", "content": "Hello there"}]
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
}


def create(api: httpx.Client, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    """POST /v1/messages (greedy, short, unless body says otherwise), asserting the status; the body."""
    response = api.post("/v1/messages", json={"model": "default", "max_tokens": 6, "temperature": 0, **body})
    assert response.status_code == status, response.text
    assert response.headers["request-id"].startswith("req_")
    return response.json()


def stream_events(api: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed message, each checked against the SDK's event models and its `event:` line."""
    events = typed_events(api, "/v1/messages", {"model": "default", "max_tokens": 6, "temperature": 0, **body})
    for event in events:
        if event["type"] not in ("error", "ping"):
            EVENTS.validate_python(event)
    return events


def assert_anthropic_error(response: httpx.Response, status: int, *words: str) -> str:
    """The error message of response, after checking its status, Anthropic's shape and that it says words."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == ERROR_TYPES[status]
    message = body["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def test_the_reply_validates_against_the_sdk_and_counts_its_prompt(api: httpx.Client) -> None:
    body = {"messages": HELLO, "system": [{"type": "text", "text": "Be brief."}]}
    message = Message.model_validate(create(api, body))
    assert message.id.startswith("msg_") and message.role == "assistant" and message.type == "message"
    assert [block.type for block in message.content] in ([], ["text"])
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 6
    count = api.post("/v1/messages/count_tokens", json={"model": "default", **body})
    usage = message.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert count.json() == {"input_tokens": total}


def test_stream_events_in_order_and_equal_to_the_whole_reply(api: httpx.Client) -> None:
    body = {"messages": HELLO, "max_tokens": 8}
    whole = create(api, body)
    events = stream_events(api, body)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "".join(block["text"] for block in whole["content"])
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    blocks = [e for e in events if e["type"].startswith("content_block")]
    if blocks:
        assert blocks[0]["type"] == "content_block_start" and blocks[-1]["type"] == "content_block_stop"


def test_a_forced_tool_call_streams_its_input_as_json_deltas(api: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "Is it fine?"}],
        "tools": [*ANTHROPIC_TOOLS, VERDICT_TOOL],
        "tool_choice": {"type": "tool", "name": "verdict"},
        "max_tokens": 60,
    }
    whole = create(api, body)
    assert whole["stop_reason"] == "tool_use"
    (call,) = [block for block in whole["content"] if block["type"] == "tool_use"]
    assert call["id"].startswith("toolu_") and call["name"] == "verdict"
    assert set(call["input"]) == {"ok"}
    events = stream_events(api, body)
    pieces = [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert len(pieces) >= 1 and json.loads("".join(pieces)) == call["input"]
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "verdict"


def test_a_tool_result_round_trip(api: httpx.Client) -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
        {"role": "user", "content": [result, {"type": "text", "text": "So?"}]},
    ]
    body = create(api, {"messages": messages, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}})
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    failed = {**result, "is_error": True, "content": "timeout"}
    create(api, {"messages": [*messages[:2], {"role": "user", "content": [failed]}], "tools": ANTHROPIC_TOOLS})


def test_stop_sequences_report_the_one_that_matched(api: httpx.Client) -> None:
    text = create(api, {"messages": HELLO, "max_tokens": 12})["content"][0]["text"]
    stop = text[3:6]
    assert stop.strip(), text
    body = create(api, {"messages": HELLO, "max_tokens": 12, "stop_sequences": ["\u2603never", stop]})
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == stop
    assert body["content"][0]["text"] == text[: text.index(stop)]
    events = stream_events(api, {"messages": HELLO, "max_tokens": 12, "stop_sequences": [stop]})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_an_assistant_prefill_ends_the_prompt(api: httpx.Client) -> None:
    prefilled = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Well, well"}]}]
    plain = api.post("/v1/messages/count_tokens", json={"model": "default", "messages": HELLO}).json()
    count = api.post("/v1/messages/count_tokens", json={"model": "default", "messages": prefilled}).json()
    rendered = api.post("/tokenize", json={"model": "default", "messages": HELLO, "add_generation_prompt": True}).json()
    assert plain["input_tokens"] == rendered["count"] and count["input_tokens"] > plain["input_tokens"]
    usage = create(api, {"messages": prefilled})["usage"]
    assert (
        sum(usage[name] for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        == (count["input_tokens"])
    )


def test_prefix_usage_with_a_cache_breakpoint(api: httpx.Client) -> None:
    system = [{"type": "text", "text": "You are a careful assistant. " * 30, "cache_control": {"type": "ephemeral"}}]
    first = create(api, {"system": system, "messages": [{"role": "user", "content": "First question?"}]})["usage"]
    second = create(api, {"system": system, "messages": [{"role": "user", "content": "Another one!"}]})["usage"]
    assert first["cache_creation_input_tokens"] > 0
    assert first["cache_read_input_tokens"] < 16  # at most the template's first tokens, which earlier prompts share
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"]
    assert second["cache_creation_input_tokens"] == 0
    for usage in (first, second):
        assert usage["input_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"max_tokens": None}, ("max_tokens",)),
        ({"max_tokens": 0}, ("max_tokens",)),
        ({"messages": []}, ("messages",)),
        ({"messages": [{"role": "system", "content": "x"}]}, ("messages.0.role",)),
        ({"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]}, ("messages.0.content",)),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
            ("no images",),
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            ("no images",),
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            ("messages.0.content.0", "assistant"),
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                    {"role": "user", "content": "y"},
                ]
            },
            ("messages.1.content.0", "user"),
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
            ("toolu_x",),
        ),
        ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, ("assistant",)),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
            ("redacted",),
        ),
        ({"messages": [{"role": "assistant", "content": "prefill only"}]}, ("user message",)),
        ({"temperature": 1.5}, ("temperature",)),
        ({"top_k": -1}, ("top_k",)),
        ({"metadata": {"user_id": "u", "other": 1}}, ("metadata.other",)),
        ({"stop_sequences": [""]}, ("stop_sequences",)),
        ({"stop_sequences": [str(i) for i in range(20)]}, ("stop_sequences",)),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, ("tools.0",)),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": ANTHROPIC_TOOLS}, ("nope",)),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}, "max_tokens": 2000}, ("budget_tokens", "1024")),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024}, ("budget_tokens", "max_tokens")),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1025}, ("thinking.budget_tokens",)),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, ("ttl",)),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5}, ("maximum of 4",)),
        ({"container": "c"}, ("container",)),
    ],
)
def test_refused_fields_name_themselves_in_anthropics_shape(
    api: httpx.Client, body: dict[str, Any], words: tuple[str, ...]
) -> None:
    full = {"model": "default", "max_tokens": 6, "messages": HELLO, **body}
    full = {key: value for key, value in full.items() if value is not None}
    assert_anthropic_error(api.post("/v1/messages", json=full), 400, *words)


def test_hostile_bodies_are_refused_and_the_server_stays_healthy(api: httpx.Client) -> None:
    blocks = [{"type": "text", "text": "a "}] * 10_000
    assert_anthropic_error(create_raw(api, {"messages": [{"role": "user", "content": blocks}]}), 400, "context length")
    many = [{"role": "user", "content": "a"}] * 10_000
    assert_anthropic_error(create_raw(api, {"messages": many}), 400, "at most")
    bad_utf8 = b'{"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert_anthropic_error(api.post("/v1/messages", content=bad_utf8), 400)
    assert_anthropic_error(api.post("/v1/messages", content=b"{not json"), 400)
    surrogate = b'{"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert_anthropic_error(api.post("/v1/messages", content=surrogate), 400, "surrogate")
    assert_anthropic_error(create_raw(api, {"model": "nope"}), 404, "nope")
    assert api.get("/health").status_code == 200


def create_raw(api: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    """POST /v1/messages with body over the defaults, whatever the answer."""
    return api.post("/v1/messages", json={"model": "default", "max_tokens": 5, "messages": HELLO, **body})


def test_count_tokens_refuses_what_create_refuses(api: httpx.Client) -> None:
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
    response = api.post("/v1/messages/count_tokens", json={"model": "default", "messages": [image]})
    assert_anthropic_error(response, 400, "no images")
    assert_anthropic_error(api.post("/v1/messages/count_tokens", json={"model": "x", "messages": HELLO}), 404)


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app with one API key and a small body limit."""
    state = tmp_path_factory.mktemp("anthropic-keyed") / "state"
    with serve_in_process(tiny_args(tiny_model, state, "--api-key", "sk-right", "--max-request-bytes", "4096")) as app:
        yield app


def test_keys_as_x_api_key_and_errors_of_the_guards_in_each_routes_shape(keyed: InProcessServer) -> None:
    body = {"model": "default", "max_tokens": 2, "messages": HELLO}
    with keyed.http(headers={"x-api-key": "sk-right", "anthropic-version": "2023-06-01"}) as http:
        answer = http.post("/v1/messages", json=body, headers={"anthropic-beta": "some-beta-2099,other"})
        assert answer.status_code == 200 and answer.headers["request-id"]
        too_big = {**body, "system": "x" * 5000}
        assert_anthropic_error(http.post("/v1/messages", json=too_big), 413)
    with keyed.http(headers={"x-api-key": "sk-wrong"}) as http:
        assert_anthropic_error(http.post("/v1/messages", json=body), 401, "API key")
        openai_shape = http.post("/v1/chat/completions", json={"model": "default", "messages": HELLO})
        assert openai_shape.status_code == 401 and openai_shape.json()["error"]["type"] == "authentication_error"
