"""Reasoning in-process: a tiny random Qwen3 whose own template opens a think block (`enable_thinking`).

The weights are random, so the text is noise; what is checked is where it goes (reasoning_content or
content), that the budget closes the block after exactly that many tokens, that a constraint starts after
it, that streaming agrees, and that a session keeps the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from statelm.api.anthropic.protocol import MIN_THINKING_BUDGET
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args
from tests.models.tiny_model_dir import make_tiny_thinking_model_dir

QUESTION = [{"role": "user", "content": "The quick brown fox?"}]
CONTEXT = 2048  # room for Anthropic's least thinking budget, 1024 tokens
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app on the tiny thinking model."""
    root = tmp_path_factory.mktemp("thinking")
    model_dir = make_tiny_thinking_model_dir(root / "model", max_position_embeddings=CONTEXT)
    keepalive = ["--sse-keepalive", "0.01"]  # a keep-alive comment between almost every pair of chunks
    with serve_in_process(tiny_args(model_dir, root / "state", *keepalive, served_name="tiny")) as app:
        yield app


@pytest.fixture(scope="module")
def thinker(thinking: InProcessServer) -> openai.OpenAI:
    """The openai SDK pointed at the thinking app."""
    return thinking.openai()


@pytest.fixture(scope="module")
def raw(thinking: InProcessServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the thinking app."""
    with thinking.http() as client:
        yield client


def think(client: openai.OpenAI, messages: list[Any] = QUESTION, **kwargs: Any) -> ChatCompletion:
    """A chat completion on the thinking model, greedy unless told otherwise."""
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


def test_the_budget_closes_the_block_the_template_opened(thinker: openai.OpenAI) -> None:
    budget = 4
    reply = think(
        thinker, max_tokens=12, logprobs=True, extra_body={"max_reasoning_tokens": budget, "ignore_eos": True}
    )
    message = reply.choices[0].message
    entries = reply.choices[0].logprobs.content or []  # type: ignore[union-attr]
    tokens = [entry.token for entry in entries]
    assert "</think>" not in tokens[:budget] and tokens[budget] == "</think>"
    assert entries[budget].logprob == 0.0  # forced

    def text(part: list[Any]) -> str:  # what the tokens decode to, special tokens (<|...|>) left out
        kept = b"".join(bytes(entry.bytes) for entry in part if not entry.token.startswith("<|"))
        return kept.decode("utf-8", errors="replace").strip()

    reasoning = message.model_dump()["reasoning_content"]
    assert reasoning == text(entries[:budget])
    assert message.content == text(entries[budget + 1 :])
    assert "</think>" not in (message.content or "") and "<think>" not in reasoning


def test_streamed_reasoning_and_content_equal_the_whole_reply(thinker: openai.OpenAI) -> None:
    extra = {"thinking_budget": 6, "ignore_eos": True}
    whole = think(thinker, max_tokens=16, extra_body=extra).choices[0].message.model_dump()
    chunks = list(
        thinker.chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0, max_tokens=16, stream=True, extra_body=extra
        )
    )
    deltas = [chunk.choices[0].delta.model_dump() for chunk in chunks if chunk.choices]
    assert "".join(delta.get("reasoning_content") or "" for delta in deltas) == whole["reasoning_content"]
    assert "".join(delta.get("content") or "" for delta in deltas) == whole["content"]


def test_streams_carry_keep_alive_comments_between_events(raw: httpx.Client) -> None:
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with raw.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert any(line.startswith(": ping") for line in lines)
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(json.loads(event)["object"] == "chat.completion.chunk" for event in data[:-1])


def test_a_json_schema_constrains_the_answer_after_the_reasoning(thinker: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    reply = think(
        thinker,
        temperature=1.0,
        seed=5,
        n=4,
        max_tokens=60,
        response_format=response_format,
        extra_body={"max_reasoning_tokens": 5},
    )
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        assert choice.message.model_dump().get("reasoning_content")


def test_thinking_off_through_template_kwargs_or_effort(thinker: openai.OpenAI) -> None:
    default = think(thinker, max_tokens=4)
    off = think(thinker, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    none = think(thinker, max_tokens=4, reasoning_effort="none")  # type: ignore[arg-type]
    high = think(thinker, max_tokens=4, reasoning_effort="high")  # type: ignore[arg-type]
    assert off.usage and none.usage and default.usage and high.usage
    assert off.usage.prompt_tokens == none.usage.prompt_tokens > default.usage.prompt_tokens
    assert high.usage.prompt_tokens == default.usage.prompt_tokens
    assert off.choices[0].message.model_dump().get("reasoning_content") is None


def test_a_session_keeps_the_reasoning_and_equals_stateless(thinker: openai.OpenAI, raw: httpx.Client) -> None:
    session = raw.post("/v1/sessions", json={}).json()["id"]
    extra = {"max_reasoning_tokens": 3, "ignore_eos": True}
    first = think(thinker, max_tokens=8, extra_body={**extra, "session_id": session})
    history = raw.get(f"/v1/sessions/{session}/history").json()["messages"]
    assert history[1]["reasoning_content"] == first.choices[0].message.model_dump()["reasoning_content"]
    follow = [{"role": "user", "content": "And the lazy dog?"}]
    second = think(thinker, follow, max_tokens=8, extra_body={**extra, "session_id": session})
    stateless = think(thinker, [*QUESTION, history[1], *follow], max_tokens=8, extra_body=extra)
    assert second.choices[0].message.model_dump() == stateless.choices[0].message.model_dump()
    assert second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    raw.delete(f"/v1/sessions/{session}")


def test_a_model_without_think_tags_refuses_reasoning_controls(api: httpx.Client, model_name: str) -> None:
    base = {"model": model_name, "messages": QUESTION, "max_tokens": 4}
    for field, value in (("reasoning_effort", "low"), ("max_reasoning_tokens", 10), ("thinking_budget", 10)):
        response = api.post("/v1/chat/completions", json={**base, field: value})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_anthropic_thinking_blocks_are_streamed_signed_and_taken_back(raw: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "max_tokens": MIN_THINKING_BUDGET + 8,
        "messages": QUESTION,
        "thinking": {"type": "enabled", "budget_tokens": MIN_THINKING_BUDGET},
        "temperature": 0,
    }
    whole = raw.post("/v1/messages", json=body).json()
    kinds = [block["type"] for block in whole["content"]]
    assert kinds[0] == "thinking" and whole["content"][0]["signature"], whole
    with raw.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [event["delta"] for event in events if event["type"] == "content_block_delta"]
    thought = "".join(delta["thinking"] for delta in deltas if delta["type"] == "thinking_delta")
    assert thought == whole["content"][0]["thinking"]
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [whole["content"][0]["signature"]]
    again = [*QUESTION, {"role": "assistant", "content": whole["content"]}, {"role": "user", "content": "More?"}]
    assert raw.post("/v1/messages", json={**body, "messages": again}).status_code == 200
    off = raw.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}}).json()
    assert all(block["type"] != "thinking" for block in off["content"])
