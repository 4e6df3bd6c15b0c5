"""Tool calling on the default model (whose template has no tool format: statelm's fallback prompt and Hermes parser).

`required` and named choices are enforced by constrained decoding, so the 135M model always returns a
well-formed call. Parsing a call forced as text (`auto`, `none`, `parallel_tool_calls`), counting and the 400s
are in tests/http.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}},
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def ask(client: openai.OpenAI, model: str, **kwargs: Any) -> ChatCompletion:
    """A chat completion of QUESTION (or of kwargs' messages)."""
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", QUESTION), **kwargs)


def stream(client: openai.OpenAI, model: str, **kwargs: Any) -> list[ChatCompletionChunk]:
    """The chunks of a streamed chat completion of QUESTION."""
    return list(client.chat.completions.create(model=model, messages=QUESTION, stream=True, **kwargs))


def streamed_calls(chunks: list[ChatCompletionChunk]) -> list[dict[str, str]]:
    """The tool calls of a stream, put together from their deltas (id and name first, then arguments)."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index not in calls:
                assert delta.id and delta.function and delta.function.name and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None
            calls[delta.index]["arguments"] += (delta.function.arguments if delta.function else "") or ""
    return [calls[index] for index in sorted(calls)]


def test_required_gives_a_well_formed_call_streamed_or_not(client: openai.OpenAI, model_name: str) -> None:
    forced = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    reply = ask(client, model_name, max_tokens=80, **forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    chunks = stream(client, model_name, max_tokens=80, **forced)
    assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)] == [
        (call.function.name, call.function.arguments)
    ]
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_required_parallel_calls_each_follow_their_schema(client: openai.OpenAI, model_name: str) -> None:
    reply = ask(client, model_name, tools=TOOLS, tool_choice="required", temperature=0.7, seed=2, max_tokens=70)
    calls = reply.choices[0].message.tool_calls or []
    complete = calls if reply.choices[0].finish_reason == "tool_calls" else calls[:-1]  # a length cut ends the last
    assert complete
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_a_named_function_is_the_one_called_once(client: openai.OpenAI, model_name: str) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = ask(client, model_name, tools=TOOLS, tool_choice=choice, temperature=0.8, seed=1, max_tokens=60)
    calls = reply.choices[0].message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_time"]
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_a_tool_round_trip_in_history_and_in_a_session(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    first = ask(
        client, model_name, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    history = [*QUESTION, assistant, result]
    answer = ask(client, model_name, messages=history, tools=TOOLS, temperature=0, max_tokens=16)
    assert answer.choices[0].finish_reason in ("stop", "length")

    session = httpx.post(f"{server_url}/v1/sessions", json={}).json()["id"]
    turn = ask(
        client,
        model_name,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        extra_body={"session_id": session},
    )
    session_call = (turn.choices[0].message.tool_calls or [])[0]
    assert (session_call.function.name, session_call.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    reply = {"role": "tool", "tool_call_id": session_call.id, "content": '{"temperature": 21}'}
    follow_up = ask(
        client,
        model_name,
        messages=[reply],
        tools=TOOLS,
        temperature=0,
        max_tokens=16,
        extra_body={"session_id": session},
    )
    assert follow_up.choices[0].message.content == answer.choices[0].message.content
    usage = follow_up.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= turn.usage.prompt_tokens  # type: ignore[union-attr]
    transcript = httpx.get(f"{server_url}/v1/sessions/{session}/history").json()["messages"]
    assert [message["role"] for message in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[1]["tool_calls"][0]["function"]["name"] == call.function.name
    assert httpx.delete(f"{server_url}/v1/sessions/{session}").status_code in (200, 204)
