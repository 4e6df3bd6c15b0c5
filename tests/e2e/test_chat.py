"""Chat completions through the official openai SDK and raw HTTP against the real server."""

from __future__ import annotations

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_health(server_url: str) -> None:
    response = httpx.get(f"{server_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_capital_of_france(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_concatenates_to_the_non_streamed_reply(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=60)
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        temperature=0,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(server_url: str, model_name: str) -> None:
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert len(data) >= 3


def test_max_tokens_gives_length(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    same = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_completion_tokens=3)
    assert same.choices[0].message.content == reply.choices[0].message.content


def test_stop_string_ends_the_reply_before_it(client: openai.OpenAI, model_name: str) -> None:
    free = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40)
    text = free.choices[0].message.content
    stop = text.split()[2]  # a word from the middle of the greedy reply
    cut = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=40, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_seed_reproduces_and_top_k_one_is_greedy(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Tell me a short story."}]

    def ask(**kwargs: object) -> str:
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, **kwargs)
        return reply.choices[0].message.content

    assert ask(temperature=1.0, seed=1) == ask(temperature=1.0, seed=1)
    assert len({ask(temperature=1.0, seed=s) for s in (1, 2, 3)}) > 1
    assert ask(temperature=0.7, top_p=0.9, extra_body={"top_k": 1}) == ask(temperature=0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "no-such-model", "messages": QUESTION}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": QUESTION, "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": QUESTION, "temperature": 3}, 400, "temperature"),
        ({"messages": QUESTION, "top_p": 0}, 400, "top_p"),
        ({"messages": QUESTION, "logprobs": "maybe"}, 400, "logprobs"),
        ({"messages": QUESTION, "frobnicate": 1}, 400, "frobnicate"),
        ({"messages": QUESTION, "n": 0}, 400, "n"),
        ({"messages": QUESTION, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_completion_tokens"),
        ({"messages": QUESTION, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(
    server_url: str, model_name: str, body: dict, status: int, param: str | None
) -> None:
    response = httpx.post(f"{server_url}/v1/chat/completions", json={"model": model_name, **body}, timeout=30)
    error = assert_openai_error(response, status, param)
    if param and status == 400:
        assert param.split(".")[0] in error["message"]
    assert httpx.get(f"{server_url}/health").status_code == 200


def test_context_overflow_has_its_code(server_url: str, model_name: str) -> None:
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 8190}  # under the server's cap, over the room
    error = assert_openai_error(httpx.post(f"{server_url}/v1/chat/completions", json=body), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"'])
def test_body_that_is_not_a_json_object(server_url: str, raw: bytes) -> None:
    response = httpx.post(
        f"{server_url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400)


def test_sdk_raises_typed_errors(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=QUESTION, extra_body={"mystery": True})
    assert "mystery" in str(info.value)


def test_prompt_longer_than_one_engine_step(client: openai.OpenAI, model_name: str) -> None:
    long_text = "The river runs past the old mill. " * 120  # about 1,000 tokens: several prefill chunks
    messages = [{"role": "user", "content": long_text + "\nWhat runs past the old mill?"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=10)
    assert reply.usage.prompt_tokens > 900
    assert reply.choices[0].message.content
