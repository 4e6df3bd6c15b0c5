"""LangChain's ChatOpenAI against the real server: invoke, stream, a forced tool call and structured output."""

from __future__ import annotations

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.e2e.test_chat import QUESTION


class Capital(BaseModel):
    """A country and its capital city."""

    country: str
    capital: str


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat(server_url: str, model_name: str) -> ChatOpenAI:
    """LangChain's OpenAI chat model on the server, greedy."""
    return ChatOpenAI(
        base_url=f"{server_url}/v1", api_key="unused", model=model_name, temperature=0, max_tokens=60, max_retries=0
    )


def test_invoke_and_stream_agree(chat: ChatOpenAI) -> None:
    reply = chat.invoke(QUESTION[0]["content"])
    assert "Paris" in reply.content
    assert reply.response_metadata["system_fingerprint"].startswith("fp_")
    streamed = "".join(chunk.content for chunk in chat.stream(QUESTION[0]["content"]))
    assert streamed == reply.content


def test_forced_tool_call(chat: ChatOpenAI) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke("What is the weather like in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["args"]["city"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output(chat: ChatOpenAI, method: str) -> None:
    structured = chat.with_structured_output(Capital, method=method)
    prompt = "What is the capital of France? Answer in JSON with the keys country and capital."
    answer = structured.invoke(prompt)
    assert isinstance(answer, Capital) and answer.capital and answer.country
