"""Chat completions through the official openai SDK on the real server: the default model's text and streaming.

Routes, error shapes and what does not depend on the model's text are in tests/http.
"""

from __future__ import annotations

import openai

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    defaults = models[0].model_dump()["sampling_defaults"]  # statelm's for the bundled model, over OpenAI's
    assert defaults["temperature"] == 0.0 and defaults["top_p"] == 0.9 and defaults["top_k"] == 0


def test_capital_of_france(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_concatenates_to_the_non_streamed_reply(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        temperature=0,
        max_tokens=16,
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


def test_stop_string_ends_the_reply_before_it(client: openai.OpenAI, model_name: str) -> None:
    free = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12)
    text = free.choices[0].message.content
    stop = text.split()[2]  # a word from the middle of the greedy reply
    cut = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=12, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=12, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]
