"""Tool calling in-process on the tiny model, whose ChatML template has no tool format either (fallback and Hermes).

Here the output is forced to a call's text, so what is checked is parsing, counting and the 400s; the calls a
model writes under `required` or a named choice are checked on the default model in tests/e2e.
"""

from __future__ import annotations

import json

import httpx
import openai

from tests.e2e.test_tools import HERMES_CALL, QUESTION, TOOLS, ask, stream, streamed_calls

TWO_CALLS = HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome")


def room_for(text: str) -> int:
    """A max_tokens that fits text however it is tokenized (a token is at least a byte), and the end of turn."""
    return len(text.encode()) + 1


def test_auto_parses_a_call_the_model_writes_and_none_does_not(client: openai.OpenAI, model_name: str) -> None:
    forced = {"extra_body": {"structured_outputs": {"choice": [HERMES_CALL]}}, "max_tokens": room_for(HERMES_CALL)}
    reply = ask(client, model_name, tools=TOOLS, tool_choice="auto", **forced)
    calls = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    chunks = stream(client, model_name, tools=TOOLS, **forced)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls(chunks)] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    plain = ask(client, model_name, tools=TOOLS, tool_choice="none", **forced)
    assert plain.choices[0].message.content == HERMES_CALL and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_one_call(client: openai.OpenAI, model_name: str) -> None:
    two_calls = {"extra_body": {"structured_outputs": {"choice": [TWO_CALLS]}}, "max_tokens": room_for(TWO_CALLS)}
    reply = ask(client, model_name, tools=TOOLS, parallel_tool_calls=False, **two_calls)
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == ["get_weather"]
    both = ask(client, model_name, tools=TOOLS, **two_calls)
    assert len(both.choices[0].message.tool_calls or []) == 2


def test_tokenize_counts_a_tool_request_as_chat_does(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    reply = ask(client, model_name, tools=TOOLS, max_tokens=1)
    counted = api.post("/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["count"]
    plain = api.post("/tokenize", json={"messages": QUESTION}).json()["count"]
    assert reply.usage is not None and counted == reply.usage.prompt_tokens > plain
    response = api.post("/tokenize", json={"prompt": "Hi", "tools": TOOLS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_tool_requests_that_cannot_be_honoured_are_400(api: httpx.Client, model_name: str) -> None:
    base = {"model": model_name, "messages": QUESTION, "max_tokens": 4}
    cases = [
        ({**base, "tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({**base, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({**base, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "forces"),
        ({**base, "tools": [TOOLS[0], TOOLS[0]]}, "same name"),
        ({**base, "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ]
    for body, words in cases:
        response = api.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert words in response.json()["error"]["message"]
