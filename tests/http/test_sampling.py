"""Sampling fields in-process on the tiny model: seeds and choices, session turns, server defaults, and the 400s.

What depends on the default model's own text (logprobs, penalties, stops, truncation) is in tests/e2e.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_sampling import CAPITAL, chat, stream, streamed_text
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args

STORY = "Tell me a short story about a dragon."


def test_seeds_reproduce_and_each_choice_is_its_own_seed(client: openai.OpenAI, model_name: str) -> None:
    chat(client, model_name, STORY, temperature=0, max_tokens=1)
    three = chat(client, model_name, STORY, temperature=1.0, seed=42, n=3, max_tokens=8)
    texts = [choice.message.content for choice in three.choices]
    assert [choice.index for choice in three.choices] == [0, 1, 2] and len(set(texts)) > 1
    singles = [chat(client, model_name, STORY, temperature=1.0, seed=42 + i, max_tokens=8) for i in range(3)]
    assert texts == [single.choices[0].message.content for single in singles]
    assert three.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)
    chunks = stream(client, model_name, STORY, temperature=1.0, seed=42, n=3, max_tokens=8)
    assert [streamed_text(chunks, index) for index in range(3)] == texts
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]


def test_session_turns_take_logprobs_but_one_choice(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    api.post("/v1/sessions", json={"session_id": "sampling-turns"}).raise_for_status()
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model_name, CAPITAL, n=2, extra_body={"session_id": "sampling-turns"})
    assert info.value.body["param"] == "n"
    # greedy: a sampled reply may hold a special token, which the logprobs list and the text leaves out
    turn = {"max_tokens": 4, "logprobs": True, "temperature": 0, "extra_body": {"session_id": "sampling-turns"}}
    reply = chat(client, model_name, CAPITAL, **turn)
    tokens = reply.choices[0].logprobs.content
    # every generated token is counted; the one that ended the reply (EOS, a stop token) has no logprob entry
    ended_by_token = reply.choices[0].finish_reason == "stop"
    assert len(tokens) == reply.usage.completion_tokens - ended_by_token
    # a token may hold part of a character (its text alone is U+FFFD): the tokens' bytes make the reply
    text = bytes(byte for token in tokens for byte in token.bytes).decode("utf-8", errors="replace")
    assert text == reply.choices[0].message.content
    history = api.get("/v1/sessions/sampling-turns/history").json()["messages"]
    assert history[-1] == {"role": "assistant", "content": reply.choices[0].message.content}
    ending = {"logit_bias": {"42": 100}, "extra_body": {"stop_token_ids": [42], "min_tokens": 1}}
    ended = chat(client, model_name, CAPITAL, max_tokens=4, logprobs=True, **ending)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 2
    assert len(ended.choices[0].logprobs.content) == 1  # the stop token is counted, not reported
    api.delete("/v1/sessions/sampling-turns").raise_for_status()  # its KV blocks go back to the pool


def test_a_prompt_and_max_tokens_beyond_the_context(client: openai.OpenAI, model_name: str) -> None:
    context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model_name, CAPITAL, max_tokens=context - 5)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert str(context) in error["message"] and str(context - 5) in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.01),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty_range", -2),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"99999999": 1}),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 100),
        ("n", 0),
        ("n", 129),
        ("top_logprobs", 3),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("stream_options", {"include_usage": True}),
    ],
)
def test_out_of_range_fields_are_named(api: httpx.Client, model_name: str, field: str, value: object) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, field: value}
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field and field in error["message"], error


def test_logprobs_limits(api: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


@pytest.fixture(scope="module")
def defaults_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app with greedy sampling by default and a 64-token context."""
    args = ["--max-model-len", "64", "--default-sampling", json.dumps({"temperature": 0})]
    with serve_in_process(tiny_args(tiny_model, tmp_path_factory.mktemp("defaults") / "state", *args)) as running:
        yield running


def test_server_defaults_apply_to_fields_a_request_leaves_out(defaults_server: InProcessServer) -> None:
    client = defaults_server.openai()
    model = client.models.list().data[0].id
    chat(client, model, STORY, temperature=0, max_tokens=1)
    greedy = chat(client, model, STORY, temperature=0, max_tokens=8).choices[0].message.content
    assert chat(client, model, STORY, max_tokens=8).choices[0].message.content == greedy
    sampled = {
        chat(client, model, STORY, temperature=1.5, seed=s, max_tokens=8).choices[0].message.content for s in (1, 2)
    }
    assert sampled != {greedy}
    filled = chat(client, model, STORY, extra_body={"ignore_eos": True})  # no max_tokens: as many as fit
    assert filled.choices[0].finish_reason == "length" and filled.usage.total_tokens == 64
