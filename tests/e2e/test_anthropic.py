"""Anthropic's Messages API against a real server on the default model, through the official `anthropic` SDK and
LangChain's ChatAnthropic: create, stream, count tokens, a tool-use round trip, stop sequences, a prefill, the
errors the SDK raises, usage that says what the prefix cache served, and a stream whose client goes away."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_chat import QUESTION
from tests.e2e.test_langchain import Capital
from tests.e2e.test_serving import metric

KEY = "sk-ant-e2e-key"
GREEDY = {"temperature": 0}  # the SDK no longer sends sampling fields itself
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def messages_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A default-model server with one API key, for this module."""
    state = tmp_path_factory.mktemp("anthropic") / "state"
    args = ["--model", "default", "--kv-cache-memory", "512MiB", "--api-key", KEY, "--state-dir", str(state)]
    process, url = start_server(args, state.parent / "server.log")
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def claude(messages_url: str) -> anthropic.Anthropic:
    """The anthropic SDK on the server."""
    return anthropic.Anthropic(base_url=messages_url, api_key=KEY, max_retries=0, timeout=120)


def ask(client: anthropic.Anthropic, messages: list[Any] = QUESTION, **kwargs: Any) -> anthropic.types.Message:
    """A greedy message on the default model."""
    return client.messages.create(
        model="default", max_tokens=kwargs.pop("max_tokens", 12), messages=messages, extra_body=GREEDY, **kwargs
    )


def text_of(message: anthropic.types.Message) -> str:
    """The text blocks of a message, joined."""
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_and_count_tokens(claude: anthropic.Anthropic) -> None:
    message = ask(claude)
    assert "Paris" in text_of(message) and message.id.startswith("msg_") and message.model == "default"
    assert message.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model="default", messages=QUESTION)
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_stream_text_and_final_message_equal_the_whole_reply(claude: anthropic.Anthropic) -> None:
    whole = ask(claude, max_tokens=20)
    with claude.messages.stream(model="default", max_tokens=20, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    call_message = ask(claude, question, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=40)
    assert call_message.stop_reason == "tool_use"
    (call,) = [block for block in call_message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and isinstance(call.input["city"], str)
    with claude.messages.stream(
        model="default", max_tokens=40, messages=question, tools=[WEATHER_TOOL], tool_choice=choice, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    pieces = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json.loads("".join(pieces)) == call.input == streamed.content[-1].input
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees."}
    answer = ask(
        claude,
        [*question, {"role": "assistant", "content": call_message.content}, {"role": "user", "content": [result]}],
        tools=[WEATHER_TOOL],
        max_tokens=30,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_stop_sequences_report_the_one_that_matched(claude: anthropic.Anthropic) -> None:
    message = ask(claude, stop_sequences=["Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert "Paris" not in text_of(message)


def test_an_assistant_prefill_is_continued(claude: anthropic.Anthropic) -> None:
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    message = ask(claude, prefilled)
    assert "Paris" in text_of(message) and not text_of(message).startswith("The capital")


def test_images_and_wrong_keys_are_refused_in_anthropics_shape(claude: anthropic.Anthropic, messages_url: str) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        ask(claude, [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    assert refused.value.status_code == 400 and "no images" in refused.value.message
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert refused.value.response.headers["request-id"].startswith("req_")
    stranger = anthropic.Anthropic(base_url=messages_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        ask(stranger)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"


def test_a_repeated_system_prompt_is_read_from_the_cache(claude: anthropic.Anthropic) -> None:
    system = [
        {"type": "text", "text": "You answer questions about geography. " * 20, "cache_control": {"type": "ephemeral"}}
    ]
    first = ask(claude, system=system, max_tokens=4).usage
    second = ask(claude, [{"role": "user", "content": "And Spain?"}], system=system, max_tokens=4).usage
    assert first.cache_creation_input_tokens > 0
    assert first.cache_read_input_tokens < 16  # at most the template's opening, which earlier prompts share
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens + first.cache_read_input_tokens
    assert second.cache_creation_input_tokens == 0


def aborted_requests(url: str) -> float:
    """How many generations have ended because their client went away (or their engine step failed)."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r'^statelm_requests_finished_total\{finish_reason="abort"\} ([0-9.e+-]+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_client_that_disconnects_mid_stream_cancels_the_generation(messages_url: str) -> None:
    body = {
        "model": "default",
        "max_tokens": 2000,
        "temperature": 0,  # the greedy reply runs past 400 tokens (a sampled one may end after a few)
        "stream": True,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }
    before = aborted_requests(messages_url)
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{messages_url}/v1/messages", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while next(lines) != "event: content_block_delta":  # the reply is being generated
            pass
        assert metric(messages_url, "statelm_requests_running") == 1
    deadline = time.monotonic() + 30.0  # the engine drops it at its next step; 2000 tokens would take minutes
    while metric(messages_url, "statelm_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(messages_url, "statelm_requests_running") == 0
    assert aborted_requests(messages_url) == before + 1
    assert metric(messages_url, "statelm_kv_blocks_used") == 0


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat(messages_url: str) -> ChatAnthropic:
    """LangChain's ChatAnthropic on the server, greedy."""
    return ChatAnthropic(
        base_url=messages_url, api_key=KEY, model="default", temperature=0, max_tokens=60, max_retries=0
    )


def test_langchain_invoke_and_stream_agree(chat: ChatAnthropic) -> None:
    reply = chat.invoke(QUESTION[0]["content"])
    assert "Paris" in reply.text
    streamed = "".join(chunk.text for chunk in chat.stream(QUESTION[0]["content"]))
    assert streamed == reply.text


def test_langchain_forced_tool_call_and_structured_output(chat: ChatAnthropic) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    [call] = bound.invoke("What is the weather like in Paris?").tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    structured = chat.with_structured_output(Capital)
    answer = structured.invoke("What is the capital of France? Answer with the country and its capital.")
    assert isinstance(answer, Capital) and answer.capital and answer.country
