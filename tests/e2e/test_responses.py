"""The Responses API on the real server, through the official openai SDK: chains served from the KV of earlier
responses, checked against chat completions with the full history; streams, function calls, structured output,
storage and ownership. Field validation, error shapes, retention and restarts are in tests/http.

The module shares one server, with two API keys (a response belongs to the key that made it).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_sessions import QUESTIONS, SYSTEM
from tests.e2e.test_structured_output import ASK, PERSON
from tests.e2e.test_tools import QUESTION, TOOLS, WEATHER_PARAMETERS

KEY_A, KEY_B = "responses-key-a-0123", "responses-key-b-0123"
TOKENS = 16  # enough to compare replies; a longer one only makes every later prompt longer
FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # Responses' flat tool shape
FORECAST = '{"temperature": 21, "sky": "sunny"}'
TEXT_STREAM_START = [  # how a stream whose output is one message starts and ends
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def responses_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A default-model server with two API keys, for this module."""
    state = tmp_path_factory.mktemp("responses") / "state"
    args = ["--model", "default", "--kv-cache-memory", "512MiB", "--api-key", KEY_A, "--api-key", KEY_B]
    process, url = start_server([*args, "--state-dir", str(state)], state.parent / "server.log")
    yield url
    stop_server(process)


def sdk(url: str, key: str) -> openai.OpenAI:
    """The openai SDK on url with key."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(responses_url: str) -> openai.OpenAI:
    """The SDK with the first key."""
    return sdk(responses_url, KEY_A)


@pytest.fixture(scope="module")
def bob(responses_url: str) -> openai.OpenAI:
    """The SDK with the second key."""
    return sdk(responses_url, KEY_B)


def respond(client: openai.OpenAI, content: str | list[Any], **kwargs: Any) -> Response:
    """A greedy response to content."""
    settings = {"temperature": 0, "max_output_tokens": TOKENS, **kwargs}
    return client.responses.create(model="default", input=content, **settings)  # type: ignore[call-overload]


def chat_reply(client: openai.OpenAI, messages: Sequence[Any], **kwargs: Any) -> str:
    """The greedy chat completion of the same history."""
    reply = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=TOKENS, **kwargs
    )  # type: ignore[call-overload]
    return reply.choices[0].message.content or ""


def event_types(events: Sequence[Any]) -> list[str]:
    """The events' types, after checking that their sequence numbers count up from 0."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return [event.type for event in events]


def test_create_with_a_string_and_with_items(alice: openai.OpenAI) -> None:
    text = respond(alice, QUESTIONS[0])
    assert text.status == "completed" and text.object == "response" and text.id.startswith("resp_")
    assert "Paris" in text.output_text
    (message,) = text.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    usage = text.usage
    assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    items = [
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTIONS[1]}]},
    ]
    with_items = respond(alice, items)
    assert with_items.output_text == chat_reply(
        alice, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    )


def test_a_three_step_chain_reuses_its_kv_and_equals_chat_with_the_full_history(alice: openai.OpenAI) -> None:
    chain: list[Response] = []
    for question in QUESTIONS[:3]:
        previous = chain[-1].id if chain else None
        chain.append(respond(alice, question, previous_response_id=previous, instructions=SYSTEM))
    for earlier, later in itertools.pairwise(chain):  # the whole earlier step came from the chain's KV
        assert earlier.usage is not None and later.usage is not None
        held = earlier.usage.input_tokens + earlier.usage.output_tokens
        assert later.usage.input_tokens_details.cached_tokens >= held - 1, (later.usage, held)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for question, response in zip(QUESTIONS, chain, strict=False):
        messages.append({"role": "user", "content": question})
        assert response.output_text == chat_reply(alice, messages)
        messages.append({"role": "assistant", "content": response.output_text})
    assert chain[1].previous_response_id == chain[0].id and chain[1].instructions == SYSTEM


def test_branching_from_the_first_response_reuses_the_shared_prefix(alice: openai.OpenAI) -> None:
    first = respond(alice, QUESTIONS[0])
    second = respond(alice, QUESTIONS[1], previous_response_id=first.id)
    branch = respond(alice, QUESTIONS[2], previous_response_id=first.id)
    assert first.usage is not None and branch.usage is not None
    assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    history = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.output_text}]
    assert branch.output_text == chat_reply(alice, [*history, {"role": "user", "content": QUESTIONS[2]}])
    after_second = respond(alice, QUESTIONS[3], previous_response_id=second.id)  # the branch left the chain alone
    history += [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": second.output_text}]
    assert after_second.output_text == chat_reply(alice, [*history, {"role": "user", "content": QUESTIONS[3]}])
    again = respond(alice, QUESTIONS[2], previous_response_id=first.id)
    assert again.output_text == branch.output_text


def test_a_streamed_response_equals_the_whole_one(alice: openai.OpenAI) -> None:
    whole = respond(alice, QUESTIONS[0], store=False)
    with alice.responses.stream(
        model="default", input=QUESTIONS[0], temperature=0, max_output_tokens=TOKENS, store=False
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = event_types(events)
    assert types[:4] == TEXT_STREAM_START and types[-4:] == [*TEXT_STREAM_END, "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text


def test_a_streamed_function_call(alice: openai.OpenAI) -> None:
    with alice.responses.stream(
        model="default",
        input=QUESTION[0]["content"],
        tools=FUNCTION_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = event_types(events)
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    (call,) = final.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    by_name = {tool["name"]: tool["parameters"] for tool in FUNCTION_TOOLS}
    jsonschema.validate(json.loads(call.arguments), by_name[call.name])


def test_a_function_call_round_trip(alice: openai.OpenAI) -> None:
    weather = [FUNCTION_TOOLS[0]]
    question = QUESTION[0]["content"]
    asked = respond(
        alice, question, tools=weather, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80
    )
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": FORECAST}
    answered = respond(alice, [result], previous_response_id=asked.id, tools=weather)
    assert answered.output_text and answered.output[0].type == "message"
    function = {"name": call.name, "arguments": call.arguments}
    messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": FORECAST},
    ]
    assert answered.output_text == chat_reply(alice, messages, tools=[TOOLS[0]])
    items = [{"role": "user", "content": question}, call.model_dump(exclude_none=True), result]
    assert respond(alice, items, tools=weather).output_text == answered.output_text


class Person(BaseModel):
    """PERSON as a pydantic model, for the SDK's `text_format`."""

    name: str
    age: int
    city: str


def test_text_format_json_schema_output_validates(alice: openai.OpenAI) -> None:
    text_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = respond(alice, ASK, text=text_format, max_output_tokens=80)
    jsonschema.validate(json.loads(response.output_text), PERSON)
    parsed = alice.responses.parse(
        model="default", input=ASK, text_format=Person, temperature=0, max_output_tokens=80
    ).output_parsed
    assert isinstance(parsed, Person)


def test_store_false_leaves_nothing_to_continue(alice: openai.OpenAI) -> None:
    unstored = respond(alice, QUESTIONS[0], store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        respond(alice, QUESTIONS[1], previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"


def test_retrieve_input_items_and_delete(alice: openai.OpenAI) -> None:
    items = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    response = respond(alice, items, metadata={"topic": "geography"})
    kept = alice.responses.retrieve(response.id)
    assert (kept.output_text, kept.usage, kept.metadata) == (
        response.output_text,
        response.usage,
        {"topic": "geography"},
    )
    listed = list(alice.responses.input_items.list(response.id, order="asc"))
    assert [(item.type, item.role) for item in listed] == [("message", "developer"), ("message", "user")]
    assert listed[1].content[0].text == QUESTIONS[0] and all(item.id.startswith("msg_") for item in listed)
    latest_first = list(alice.responses.input_items.list(response.id, limit=1))
    assert [item.id for item in latest_first] == [item.id for item in reversed(listed)]
    alice.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_items.list(response.id)


def test_another_keys_response_is_404(alice: openai.OpenAI, bob: openai.OpenAI) -> None:
    response = respond(alice, QUESTIONS[0])
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        respond(bob, QUESTIONS[1], previous_response_id=response.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(response.id)
    assert alice.responses.retrieve(response.id).output_text == response.output_text


def test_unknown_fields_and_built_in_tools_are_refused(alice: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        respond(alice, QUESTIONS[0], tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as refused:
        respond(alice, QUESTIONS[0], include=["reasoning.encrypted_content"])
    assert refused.value.body["param"] == "include"
    with pytest.raises(openai.BadRequestError) as refused:
        respond(alice, QUESTIONS[0], background=True)
    assert refused.value.body["param"] == "background"
