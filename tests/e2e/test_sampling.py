"""Sampling fields' effects on the default model's text, logprobs, stops and timings, through the openai SDK.

Requests that compare outputs send the same prompt first, so that all of them find it in the prefix cache
in the same state. Seeds and choices, session turns, server defaults and the 400s are in tests/http.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

CAPITAL = "What is the capital of France?"
CAT = "Repeat the word cat ten times."


def chat(client: openai.OpenAI, model: str, content: str, **kwargs: object) -> ChatCompletion:
    """A one-message chat completion."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kwargs)


def stream(client: openai.OpenAI, model: str, content: str, **kwargs: object) -> list[ChatCompletionChunk]:
    """The chunks of a streamed one-message chat completion."""
    return list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], stream=True, **kwargs
        )
    )


def streamed_text(chunks: list[ChatCompletionChunk], index: int = 0) -> str:
    """The content that chunks stream for choice index."""
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def token_id(server_url: str, text: str) -> int:
    """The one token id of text."""
    tokens = httpx.post(f"{server_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


@pytest.fixture(scope="module")
def greedy_capital(client: openai.OpenAI, model_name: str) -> ChatCompletion:
    """The greedy reply to CAPITAL with its logprobs (after a first request has put the prompt in the cache)."""
    chat(client, model_name, CAPITAL, temperature=0, max_tokens=1)
    reply = chat(client, model_name, CAPITAL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    return reply


def test_logprobs_are_the_tokens_of_the_content(greedy_capital: ChatCompletion) -> None:
    choice = greedy_capital.choices[0]
    tokens = choice.logprobs.content
    assert "".join(t.token for t in tokens) == choice.message.content
    assert b"".join(bytes(t.bytes) for t in tokens) == choice.message.content.encode()
    for token in tokens:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert (token.top_logprobs[0].token, token.top_logprobs[0].logprob) == (token.token, token.logprob)  # greedy


def test_streamed_logprobs_equal_the_whole_ones(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion
) -> None:
    chunks = stream(client, model_name, CAPITAL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == greedy_capital.choices[0].logprobs.content
    assert streamed_text(chunks) == greedy_capital.choices[0].message.content


def test_logit_bias_forces_and_bans_tokens(
    client: openai.OpenAI, model_name: str, server_url: str, greedy_capital: ChatCompletion
) -> None:
    banana = token_id(server_url, " banana")
    forced = chat(client, model_name, CAPITAL, temperature=0, max_tokens=4, logit_bias={str(banana): 100})
    assert forced.choices[0].message.content == " banana" * 4
    first = token_id(server_url, greedy_capital.choices[0].logprobs.content[0].token)
    banned = chat(client, model_name, CAPITAL, temperature=0, max_tokens=4, logit_bias={str(first): -100})
    assert not banned.choices[0].message.content.startswith("The")


def test_truncation_to_one_token_is_greedy(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion
) -> None:
    greedy = greedy_capital.choices[0].message.content
    for truncation in ({"top_p": 1e-6}, {"extra_body": {"min_p": 1.0}}, {"extra_body": {"top_k": 1}}):
        reply = chat(client, model_name, CAPITAL, temperature=1.5, max_tokens=12, **truncation)
        assert reply.choices[0].message.content == greedy, truncation


def test_penalties_lower_the_logprobs_of_seen_tokens(client: openai.OpenAI, model_name: str) -> None:
    chat(client, model_name, CAT, temperature=0, max_tokens=1)

    def tokens(**kwargs: object) -> list[tuple[str, float]]:
        reply = chat(client, model_name, CAT, temperature=0, max_tokens=5, logprobs=True, **kwargs)
        return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]

    plain = tokens()
    assert [token for token, _ in plain] == ["The", " cat", " is", " a", " cat"]
    for penalty in ({"presence_penalty": 1.0}, {"frequency_penalty": 1.0}):
        penalized = tokens(**penalty)
        assert penalized[1][0] == " cat" and abs(penalized[1][1] - plain[1][1]) < 0.01  # not generated yet
        assert penalized[4][1] < plain[4][1] - 0.5, penalty  # the second " cat" is penalized
    repeated = tokens(extra_body={"repetition_penalty": 1.2})  # the prompt has "cat": penalized at once
    assert repeated[1][0] != " cat" or repeated[1][1] < plain[1][1] - 1
    windowed = tokens(extra_body={"repetition_penalty": 1.2, "repetition_penalty_range": 2})
    assert windowed[1][0] == " cat" and abs(windowed[1][1] - plain[1][1]) < 0.1  # "cat" is outside the window
    assert tokens(extra_body={"repetition_penalty": 1.2, "repetition_penalty_range": 0}) == plain


def test_min_tokens_and_ignore_eos_keep_generating(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion
) -> None:
    assert greedy_capital.choices[0].finish_reason == "stop" and greedy_capital.usage.completion_tokens < 12
    for extra in ({"min_tokens": 12}, {"ignore_eos": True}):
        reply = chat(client, model_name, CAPITAL, temperature=0, max_tokens=12, extra_body=extra)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12, extra
        assert reply.choices[0].message.content.startswith("The capital of France is Paris.")


def test_stop_token_ids_end_the_reply_before_the_token(
    client: openai.OpenAI, model_name: str, server_url: str, greedy_capital: ChatCompletion
) -> None:
    france = token_id(server_url, " France")
    reply = chat(client, model_name, CAPITAL, temperature=0, max_tokens=12, extra_body={"stop_token_ids": [france]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "The capital of"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("l of Fr", "The capital of France is Paris."[: len("The capita")]),  # spans three tokens
        (["xyz", "Berlin", "is Par", "qqq", "zzz"], "The capital of France "),  # the earliest of five
        ("France is Rome", "The capital of France is Paris."),  # a partial match held back, then released
    ],
)
def test_stop_strings_across_tokens_never_leak(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion, stop: str | list[str], expected: str
) -> None:
    whole = chat(client, model_name, CAPITAL, temperature=0, max_tokens=12, stop=stop)
    assert whole.choices[0].message.content == expected
    chunks = stream(client, model_name, CAPITAL, temperature=0, max_tokens=12, stop=stop)
    assert streamed_text(chunks) == expected
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(expected.startswith("".join(pieces[: i + 1])) for i in range(len(pieces)))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_a_stop_string_wins_over_the_length_limit(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion
) -> None:
    reply = chat(client, model_name, CAPITAL, temperature=0, max_tokens=6, stop=" Paris")
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 6


def test_timings_in_the_response_and_the_last_chunk(
    client: openai.OpenAI, model_name: str, greedy_capital: ChatCompletion
) -> None:
    timings = greedy_capital.model_extra["timings"]
    usage = greedy_capital.usage
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert timings["cache_n"] == usage.prompt_tokens_details.cached_tokens > 0
    assert timings["predicted_n"] == usage.completion_tokens
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    for options in ({}, {"stream_options": {"include_usage": True}}):
        chunks = stream(client, model_name, CAPITAL, temperature=0, max_tokens=3, **options)
        with_timings = [i for i, chunk in enumerate(chunks) if (chunk.model_extra or {}).get("timings")]
        assert with_timings == [len(chunks) - 1], options
        assert chunks[-1].model_extra["timings"]["predicted_n"] == 3
