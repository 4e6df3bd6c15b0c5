"""/v1/completions (text and token-id prompts, echo, legacy logprobs, streaming) and /tokenize on the default model.

Several choices per prompt and the error shapes are in tests/http.
"""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3,"


def tokenize(server_url: str, **body: object) -> list[int]:
    """The token ids /tokenize gives for body."""
    response = httpx.post(f"{server_url}/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI, model_name: str) -> openai.types.Completion:
    """The greedy continuation of PROMPT with legacy logprobs (the prompt cached by a first request)."""
    client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=1)
    return client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2)


def test_text_prompt_with_legacy_logprobs(greedy: openai.types.Completion) -> None:
    choice = greedy.choices[0]
    assert greedy.object == "text_completion" and choice.text.startswith(" Paris")
    assert choice.finish_reason == "length" and greedy.usage.completion_tokens == 6
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and top[token] == logprob and len(top) == 2  # greedy: the chosen token is the top one
    assert greedy.model_extra["timings"]["predicted_n"] == 6


def test_token_id_prompts_equal_text_prompts(
    client: openai.OpenAI, model_name: str, server_url: str, greedy: openai.types.Completion
) -> None:
    ids = tokenize(server_url, prompt=PROMPT)
    by_ids = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == greedy.choices[0].text
    assert by_ids.usage.prompt_tokens == greedy.usage.prompt_tokens == len(ids)
    texts = client.completions.create(model=model_name, prompt=[PROMPT, COUNTING], temperature=0, max_tokens=6)
    id_lists = [ids, tokenize(server_url, prompt=COUNTING)]
    lists = client.completions.create(model=model_name, prompt=id_lists, temperature=0, max_tokens=6)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text == greedy.choices[0].text
    assert [c.text for c in lists.choices] == [c.text for c in texts.choices]
    assert texts.usage.prompt_tokens == sum(len(prompt) for prompt in id_lists)


def test_echo_prepends_the_prompt(client: openai.OpenAI, model_name: str, greedy: openai.types.Completion) -> None:
    echoed = client.completions.create(model=model_name, prompt=PROMPT, echo=True, temperature=0, max_tokens=6)
    assert echoed.choices[0].text == PROMPT + greedy.choices[0].text
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, echo=True, temperature=0, max_tokens=6, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == echoed.choices[0].text


def test_stream_equals_the_whole_reply(client: openai.OpenAI, model_name: str, greedy: openai.types.Completion) -> None:
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            temperature=0,
            max_tokens=6,
            logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_text = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(choice.text for choice in with_text) == greedy.choices[0].text
    tokens = [token for choice in with_text if choice.logprobs for token in choice.logprobs.tokens]
    assert tokens == greedy.choices[0].logprobs.tokens
    assert [choice.finish_reason for choice in with_text if choice.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].model_extra["timings"]["predicted_n"] == 6


def test_stop_strings_in_completions(client: openai.OpenAI, model_name: str, greedy: openai.types.Completion) -> None:
    text = greedy.choices[0].text
    reply = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=6, stop=["ari"])
    assert reply.choices[0].text == text[: text.index("ari")] and reply.choices[0].finish_reason == "stop"


def test_tokenize_text_and_conversations(server_url: str, model_name: str) -> None:
    text = tokenize(server_url, prompt="Hello world", add_special_tokens=False)
    response = httpx.post(
        f"{server_url}/tokenize", json={"model": model_name, "prompt": "Hello world", "return_token_strs": True}
    )
    assert response.json()["token_strs"] == ["Hello", " world"] and response.json()["count"] == len(text)
    assert response.json()["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hello world"}]
    with_prompt = tokenize(server_url, messages=messages)
    without = tokenize(server_url, messages=messages, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    detokenized = httpx.post(f"{server_url}/detokenize", json={"tokens": with_prompt}).json()["prompt"]
    assert "Hello world" in detokenized and detokenized.endswith("assistant\n")
    assert tokenize(server_url, prompt=detokenized, add_special_tokens=False) == with_prompt
