"""The Responses API in-process on the tiny model: every field honoured or refused with a 400 naming it, the response
object and stream events against the SDK's own models, and what a stored response leaves behind (chains, deletion,
retention, restarts, the KV it reuses).

Replies compared with chat completions are in tests/e2e: only the default model's replies tokenize back to the
tokens it generated, so only there a chain re-rendered reaches the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from statelm.api.responses.chains import records
from statelm.sessions.session import Session, SessionKind
from tests.e2e.test_responses import TEXT_STREAM_END, TEXT_STREAM_START
from tests.e2e.test_tools import TOOLS
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args
from tests.http.test_chat import assert_openai_error
from tests.http.typed_events import typed_events
from tests.models.tiny_model_dir import make_tiny_thinking_model_dir

FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def create(api: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/responses (greedy, short, unless body says otherwise), asserting 200; the response object."""
    response = api.post("/v1/responses", json={"model": "default", "temperature": 0, "max_output_tokens": 6, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(api: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed response, each checked against the SDK's event models, numbered 0, 1, 2 …"""
    events = typed_events(api, "/v1/responses", {"model": "default", "temperature": 0, "max_output_tokens": 6, **body})
    for event in events:
        EVENTS.validate_python(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def chains(server: InProcessServer) -> list[Session]:
    """The response-chain sessions the app holds."""
    return [s for s in server.app.state.sessions.manager.sessions.values() if s.kind == SessionKind.RESPONSES]


def chain_of(server: InProcessServer, response_id: str) -> Session:
    """The chain session that holds a stored response."""
    (session,) = [session for session in chains(server) if response_id in records(session)]
    return session


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"background": True}, "background", "background"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "templates"),
        ({"max_tool_calls": 2}, "max_tool_calls", "built-in"),
        ({"truncation": "auto"}, "truncation", "context_length_exceeded"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in_memory"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "encrypts"),
        ({"include": ["file_search_call.results"]}, "include", "built-in tool"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tools"),
        ({"tools": [{"type": "function"}]}, "tools.0.name", "required"),
        ({"tools": [FUNCTION_TOOLS[0], FUNCTION_TOOLS[0]]}, "tools", "same name"),
        ({"tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice", "not supported"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": FUNCTION_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
        ({"tools": FUNCTION_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.name", "required"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "summarize"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning control"),
        ({"max_reasoning_tokens": 8}, "max_reasoning_tokens", "reasoning block"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "medium"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "required"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
            "text.format.schema",
            "not a valid JSON Schema",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
            "",
        ),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input.0.encrypted_content", ""),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "function_call_output"),
        ({"input": []}, "input", "at least 1"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
        ({"top_logprobs": 2}, "top_logprobs", "include"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({"max_output_tokens": 9000}, "max_output_tokens", "max_output_tokens 9000"),
        ({"temperature": 3}, "temperature", "less than"),
        ({"metadata": {"k": 1}}, "metadata.k", ""),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized"),
    ],
)
def test_each_field_is_honoured_or_refused_naming_it(
    api: httpx.Client, fields: dict[str, Any], param: str, words: str
) -> None:
    response = api.post("/v1/responses", json={"model": "default", "input": "Hi", **fields})
    error = assert_openai_error(response, 400, param)
    assert words in error["message"]


def test_missing_things_are_404s(api: httpx.Client) -> None:
    error = assert_openai_error(api.post("/v1/responses", json={"model": "gpt-9", "input": "Hi"}), 404, "model")
    assert error["code"] == "model_not_found"
    body = {"model": "default", "input": "Hi", "previous_response_id": "resp_missing"}
    assert assert_openai_error(api.post("/v1/responses", json=body), 404)["code"] == "previous_response_not_found"
    for method, path in [
        ("GET", "/v1/responses/resp_missing"),
        ("DELETE", "/v1/responses/resp_missing"),
        ("GET", "/v1/responses/resp_missing/input_items"),
        ("POST", "/v1/responses/resp_missing/cancel"),
    ]:
        assert assert_openai_error(api.request(method, path), 404, "response_id")["code"] == "response_not_found"


def test_the_response_object_is_the_sdks_and_is_stored_as_returned(api: httpx.Client) -> None:
    body = {"input": "Hello", "metadata": {"team": "blue"}, "user": "u-1", "instructions": "Be brief."}
    created = create(api, body)
    response = Response.model_validate(created)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == created["output_text"] and response.usage.output_tokens == 6
    assert (response.metadata, response.user, response.instructions, response.store) == (
        {"team": "blue"},
        "u-1",
        "Be brief.",
        True,
    )
    assert (response.temperature, response.top_p, response.tool_choice, response.truncation) == (
        0,
        1,
        "auto",
        "disabled",
    )
    usage = response.usage.input_tokens_details
    assert usage.cached_tokens + usage.cache_write_tokens == response.usage.input_tokens
    assert api.get(f"/v1/responses/{response.id}").json() == created
    assert assert_openai_error(api.get(f"/v1/responses/{response.id}", params={"stream": "true"}), 400, "stream")
    refused = api.post(f"/v1/responses/{response.id}/cancel")
    assert assert_openai_error(refused, 400)["code"] == "not_background"


def test_stream_events_come_in_order_and_build_the_stored_response(api: httpx.Client) -> None:
    events = stream_events(api, {"input": "Hello", "max_output_tokens": 8})
    types = [event["type"] for event in events]
    assert types[:4] == TEXT_STREAM_START and types[-4:] == [*TEXT_STREAM_END, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert all(len(d["delta"] + d["obfuscation"]) % 16 == 0 for d in deltas)  # padded, as OpenAI's default is
    final = events[-1]["response"]
    assert "".join(d["delta"] for d in deltas) == events[-4]["text"] == final["output_text"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert api.get(f"/v1/responses/{final['id']}").json() == final
    plain = stream_events(api, {"input": "Hello", "stream_options": {"include_obfuscation": False}})
    assert not any("obfuscation" in event for event in plain)


def test_a_chain_continues_from_its_kv_and_store_false_leaves_it_as_it_was(
    server: InProcessServer, api: httpx.Client
) -> None:
    first = create(api, {"input": "Tell me about the sea."})
    second = create(api, {"input": "And the hills?", "previous_response_id": first["id"]})
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    chain = chain_of(server, first["id"])
    assert chain is chain_of(server, second["id"]) and len(chain.transcript) == 4
    before = [dict(message) for message in chain.transcript], len(chains(server))
    peek = {"input": "And the woods?", "previous_response_id": second["id"], "store": False}
    unstored = create(api, peek)
    assert unstored["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert create(api, peek)["output_text"] == unstored["output_text"]
    assert ([dict(message) for message in chain.transcript], len(chains(server))) == before
    assert_openai_error(api.get(f"/v1/responses/{unstored['id']}"), 404)
    stateless = create(api, {"input": "Hi", "store": False})
    assert len(chains(server)) == before[1] and stateless["previous_response_id"] is None


def test_a_branch_gets_its_own_chain_and_deleting_frees_what_only_it_held(
    server: InProcessServer, api: httpx.Client
) -> None:
    first = create(api, {"input": "Name a colour."})
    second = create(api, {"input": "Another one?", "previous_response_id": first["id"]})
    branch = create(api, {"input": "And a fruit?", "previous_response_id": first["id"]})
    chain, branched = chain_of(server, second["id"]), chain_of(server, branch["id"])
    assert chain is chain_of(server, first["id"]) and branched is not chain
    assert branched.transcript[:2] == chain.transcript[:2] and len(branched.transcript) == 4
    assert branch["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert api.delete(f"/v1/responses/{branch['id']}").json() == {
        "id": branch["id"],
        "object": "response.deleted",
        "deleted": True,
    }
    assert branched not in chains(server)  # the branch's chain held nothing else
    api.delete(f"/v1/responses/{second['id']}")
    assert len(chain.transcript) == 2  # cut back to the first response
    again = create(api, {"input": "Another one?", "previous_response_id": first["id"]})
    assert chain_of(server, again["id"]) is chain and again["output_text"] == second["output_text"]
    for response in (first, again):
        api.delete(f"/v1/responses/{response['id']}")
    assert chain not in chains(server)


def test_function_calls_streamed_and_answered(server: InProcessServer, api: httpx.Client) -> None:
    forced = {
        "tools": FUNCTION_TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
    }
    events = stream_events(api, {"input": "Weather in Paris?", **forced})
    types = [event["type"] for event in events]
    assert types[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-2]["item"]
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        == call["arguments"]
    )
    parameters = {tool["name"]: tool["parameters"] for tool in FUNCTION_TOOLS}
    jsonschema.validate(json.loads(call["arguments"]), parameters[call["name"]])
    asked = events[-1]["response"]
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temperature": 21}'}
    answered = create(api, {"input": [answer], "previous_response_id": asked["id"], "tools": FUNCTION_TOOLS})
    transcript = chain_of(server, answered["id"]).transcript
    assert [message["role"] for message in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[1]["tool_calls"][0]["id"] == call["call_id"] and transcript[2]["tool_call_id"] == call["call_id"]
    listed = api.get(f"/v1/responses/{answered['id']}/input_items").json()
    assert [item["type"] for item in listed["data"]] == ["function_call_output"]


def test_json_schema_and_logprobs(api: httpx.Client) -> None:
    schema = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    verdict = create(api, {"input": "Is it?", "text": schema, "max_output_tokens": 40})
    assert verdict["status"] == "completed" and verdict["text"]["format"]["name"] == "verdict"
    jsonschema.validate(json.loads(verdict["output_text"]), VERDICT)
    include = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    logged = create(api, {"input": "Hello", **include})
    (part,) = logged["output"][0]["content"]
    assert "".join(entry["token"] for entry in part["logprobs"]) == part["text"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
    events = stream_events(api, {"input": "Hello", **include})
    streamed = [
        entry for event in events if event["type"] == "response.output_text.delta" for entry in event["logprobs"]
    ]
    assert streamed == part["logprobs"]


def test_input_items_pages(api: httpx.Client) -> None:
    items = [{"role": "user", "content": f"Message {n}"} for n in range(5)]
    response = create(api, {"input": items})
    path = f"/v1/responses/{response['id']}/input_items"
    first = api.get(path, params={"order": "asc", "limit": 2}).json()
    assert [item["content"][0]["text"] for item in first["data"]] == ["Message 0", "Message 1"] and first["has_more"]
    rest = api.get(path, params={"order": "asc", "after": first["last_id"]}).json()
    assert len(rest["data"]) == 3 and not rest["has_more"]
    latest = api.get(path).json()
    assert [item["id"] for item in latest["data"]] == [item["id"] for item in [*first["data"], *rest["data"]]][::-1]
    assert_openai_error(api.get(path, params={"limit": 0}), 400, "limit")
    assert_openai_error(api.get(path, params={"after": "msg_nope"}), 400, "after")


def test_access_log_and_metrics(api: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="statelm.access"):
        created = create(api, {"input": "Hi", "metadata": {"run": "7"}, "safety_identifier": "s-1", "store": False})
    lines = [record.getMessage() for record in caplog.records if record.name == "statelm.access"]
    assert any(created["id"] in line and '"run": "7"' in line and '"s-1"' in line for line in lines)
    assert 'route="/v1/responses",status="200"' in api.get("/metrics").text


@pytest.fixture(scope="module")
def bounded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app that keeps 3 responses per key, 2 sessions per key, 4 input items and 16 output tokens per request."""
    args = ["--max-stored-responses", "3", "--max-sessions-per-key", "2", "--max-messages", "4"]
    args += ["--max-completion-tokens", "16"]
    with serve_in_process(tiny_args(tiny_model, tmp_path_factory.mktemp("bounded") / "state", *args)) as running:
        yield running


def test_retention_by_count_and_the_session_quota(bounded: InProcessServer) -> None:
    with bounded.http() as api:
        chain = [create(api, {"input": "Start."})]
        for step in range(3):
            chain.append(create(api, {"input": f"Step {step}.", "previous_response_id": chain[-1]["id"]}))
        assert_openai_error(api.get(f"/v1/responses/{chain[0]['id']}"), 404)  # the oldest of four went
        assert all(api.get(f"/v1/responses/{r['id']}").status_code == 200 for r in chain[1:])
        others = [create(api, {"input": f"Alone {n}."}) for n in range(2)]  # a third chain: past the session quota
        assert len(chains(bounded)) == 2 and api.get(f"/v1/responses/{chain[-1]['id']}").status_code == 404
        assert all(api.get(f"/v1/responses/{r['id']}").status_code == 200 for r in others)
        too_many = api.post("/v1/responses", json={"model": "default", "input": [{"role": "user", "content": "x"}] * 5})
        assert assert_openai_error(too_many, 400, "input")["code"] == "too_many_messages"
        too_long = api.post("/v1/responses", json={"model": "default", "input": "x", "max_output_tokens": 17})
        assert assert_openai_error(too_long, 400, "max_output_tokens")["code"] == "max_tokens_exceeded"


def test_a_chain_the_retention_is_deleting_frees_its_place_before_another_is_dropped(
    tiny_model: Path, tmp_path: Path
) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--max-sessions-per-key", "2")
    with serve_in_process(args) as server, server.http() as api:
        dropped, kept = create(api, {"input": "One."}), create(api, {"input": "Two."})  # the key's two sessions
        emptied = chain_of(server, dropped["id"])
        service = server.app.state.responses

        async def sweep_while_another_deletes() -> None:
            service.chains.drop(dropped["id"])  # as the retention counted over a cluster drops it
            deleting = asyncio.create_task(service.sweep())
            await asyncio.sleep(0)  # that sweep is writing the deletion of the emptied chain
            assert emptied.busy
            await service.sweep()  # what a new response's request does first
            assert emptied.id not in server.app.state.sessions.manager.sessions
            await deleting

        server.transport.portal.call(sweep_while_another_deletes)
        create(api, {"input": "Three."})  # takes the freed place: no other chain is dropped to make one
        assert api.get(f"/v1/responses/{kept['id']}").status_code == 200


def test_retention_by_age(tiny_model: Path, tmp_path: Path) -> None:
    with serve_in_process(tiny_args(tiny_model, tmp_path / "state", "--response-retention", "2s")) as server:
        with server.http() as api:
            kept = create(api, {"input": "Hi"})
            assert api.get(f"/v1/responses/{kept['id']}").status_code == 200
            time.sleep(2.5)
            assert_openai_error(api.get(f"/v1/responses/{kept['id']}"), 404)
            create(api, {"input": "Hi", "store": False})  # any new response sweeps what has expired
        assert chains(server) == []


def test_chains_survive_a_restart_and_belong_to_their_key(tiny_model: Path, tmp_path: Path) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--api-key", "alice", "--api-key", "bob")
    with serve_in_process(args) as server, server.http("alice") as api:
        first = create(api, {"input": "Remember the number seven."})
        second = create(api, {"input": "What number?", "previous_response_id": first["id"]})
    with serve_in_process(args) as server:
        with server.http("alice") as api:
            assert api.get(f"/v1/responses/{second['id']}").json() == second
            third = create(api, {"input": "Again?", "previous_response_id": second["id"]})
            assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the chain's KV, read back from disk
        bob = server.openai("bob")
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(second["id"])
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="default", input="Hi", previous_response_id=second["id"])
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(second["id"])
        with server.http("bob") as api:
            assert api.get("/v1/sessions").json()["data"] == []  # chains are no sessions API sessions


def test_chains_spill_under_pressure_and_continue_from_disk(tiny_model: Path, tmp_path: Path) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--kv-cache-memory", "128KiB")
    with serve_in_process(args) as server, server.http() as api:
        heads = [
            create(api, {"input": f"Chain {n}: remember the number {n}, please, and tell me why."}) for n in range(8)
        ]
        spilled = [chain for chain in chains(server) if chain.on_disk or chain.spilled_kv is not None]
        assert spilled, "a pool of 128 KiB holds fewer chains than this"
        for head in heads:  # each continues from its KV, reloaded from disk if it was spilled
            follow = create(api, {"input": "Why?", "previous_response_id": head["id"]})
            cached = follow["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= head["usage"]["input_tokens"], (follow["usage"], head["usage"])
            assert chain_of(server, follow["id"]) is chain_of(server, head["id"])


def test_reasoning_items_are_streamed_counted_kept_and_taken_back(thinking: InProcessServer) -> None:
    body = {"model": "tiny", "input": "The quick brown fox?", "max_reasoning_tokens": 4, "max_output_tokens": 10}
    with thinking.http() as api:
        events = stream_events(api, {**body, "ignore_eos": True})
        types = [event["type"] for event in events]
        assert types[2:5] == [
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
        ]
        assert "response.reasoning_text.done" in types and "response.output_text.delta" in types
        response = events[-1]["response"]
        reasoning, message = response["output"]
        (part,) = reasoning["content"]
        assert reasoning["type"] == "reasoning" and part["type"] == "reasoning_text" and part["text"]
        assert message["type"] == "message" and "</think>" not in response["output_text"]
        usage = response["usage"]
        assert usage["output_tokens_details"]["reasoning_tokens"] == 4 + 1  # the budget's tokens and the end tag
        assert chain_of(thinking, response["id"]).transcript[1]["reasoning_content"] == part["text"]
        items = [{"role": "user", "content": body["input"]}, reasoning, message, {"role": "user", "content": "And?"}]
        create(api, {**body, "input": items})


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app on the tiny thinking model, whose template opens a think block."""
    root = tmp_path_factory.mktemp("thinking")
    with serve_in_process(
        tiny_args(make_tiny_thinking_model_dir(root / "model"), root / "state", served_name="tiny")
    ) as app:
        yield app
