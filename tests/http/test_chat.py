"""Chat completions in-process on the tiny model: health, SSE framing, length and seeds, and every error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.test_chat import QUESTION


def test_health(api: httpx.Client) -> None:
    response = api.get("/health")
    body = response.json()
    assert response.status_code == 200 and body["status"] == "ok"
    invariance = body["batch_invariance"]  # the start-up self-check's verdict on this machine
    assert invariance["verified"] is True and invariance["path"] in ("kernels", "torch", "torch-per-row")
    assert "torch" in invariance["cpu"] and isinstance(invariance["rejected"], dict)


def test_stream_ends_with_done(api: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 5, "stream": True}
    with api.stream("POST", "/v1/chat/completions", json=body) as response:
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


def test_seed_reproduces_and_top_k_one_is_greedy(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Tell me a short story."}]

    def ask(**kwargs: object) -> str:
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, **kwargs)
        return reply.choices[0].message.content

    assert ask(temperature=1.0, seed=1) == ask(temperature=1.0, seed=1)
    assert len({ask(temperature=1.0, seed=s) for s in (1, 2, 3)}) > 1
    assert ask(temperature=0.7, top_p=0.9, extra_body={"top_k": 1}) == ask(temperature=0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The error object of response, after checking its status, its four fields and (if given) its param."""
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
    api: httpx.Client, model_name: str, body: dict, status: int, param: str | None
) -> None:
    response = api.post("/v1/chat/completions", json={"model": model_name, **body})
    error = assert_openai_error(response, status, param)
    if param and status == 400:
        assert param.split(".")[0] in error["message"]
    assert api.get("/health").status_code == 200


def test_context_overflow_has_its_code(api: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 8190}  # under the server's cap, over the room
    error = assert_openai_error(api.post("/v1/chat/completions", json=body), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"'])
def test_body_that_is_not_a_json_object(api: httpx.Client, raw: bytes) -> None:
    response = api.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_sdk_raises_typed_errors(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=QUESTION, extra_body={"mystery": True})
    assert "mystery" in str(info.value)


def test_prompt_longer_than_one_engine_step(client: openai.OpenAI, model_name: str) -> None:
    long_text = "The river runs past the old mill. " * 120  # over 1,000 tokens: several prefill chunks
    messages = [{"role": "user", "content": long_text + "\nWhat runs past the old mill?"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=10)
    assert reply.usage.prompt_tokens > 900
    assert reply.choices[0].message.content
