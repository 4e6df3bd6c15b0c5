"""/v1/completions and /tokenize, /detokenize in-process on the tiny model: choices in order and every error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.test_completions import COUNTING, PROMPT
from tests.http.test_anthropic_cache import metric

DRAFT_FIGURES = ("statelm_draft_tokens_total", "statelm_draft_tokens_accepted_total")


def test_several_prompts_with_several_choices_each(client: openai.OpenAI, model_name: str) -> None:
    reply = client.completions.create(
        model=model_name, prompt=[PROMPT, COUNTING], n=2, temperature=1.0, seed=9, max_tokens=4
    )
    assert [choice.index for choice in reply.choices] == [0, 1, 2, 3]
    for position, prompt in enumerate([PROMPT, COUNTING]):
        single = client.completions.create(model=model_name, prompt=prompt, n=2, temperature=1.0, seed=9, max_tokens=4)
        assert [c.text for c in reply.choices[2 * position : 2 * position + 2]] == [c.text for c in single.choices]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "suffix": " and more"}, "suffix"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 1}, "logprobs"),
        ({"prompt": PROMPT, "best_of": 3}, "best_of"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [99999999]}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 8190}, "max_tokens"),
        ({"prompt": PROMPT, "messages": []}, "messages"),
    ],
)
def test_bad_completion_requests_name_the_field(api: httpx.Client, model_name: str, body: dict, param: str) -> None:
    response = api.post("/v1/completions", json={"model": model_name, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == param


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [99999999]}, 400),
    ],
)
def test_bad_token_requests(api: httpx.Client, path: str, body: dict, status: int) -> None:
    response = api.post(path, json=body)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_reply_from_verified_drafts_streams_and_counts_as_one_at_a_time(
    client: openai.OpenAI, api: httpx.Client, model_name: str
) -> None:
    """The tiny model's greedy reply to this prompt repeats itself: prompt lookup drafts it, and the streamed text, the
    logprobs and the usage are those of the whole reply."""
    before = [metric(api, name) for name in DRAFT_FIGURES]
    prompt = "0 " + "a b c d e f g " * 8  # under the AVX2 class's arithmetic the reply ends after 24 tokens: ignore_eos
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**body, logprobs=1)
    streamed = list(client.completions.create(**body, logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
    logprobs = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices and chunk.choices[0].logprobs]
    tokens = [token for part in logprobs for token in part.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 40
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens == 40
    proposed, accepted = (metric(api, name) - start for name, start in zip(DRAFT_FIGURES, before, strict=True))
    assert accepted >= 10 and proposed >= accepted
    timings = whole.model_extra["timings"]  # llama.cpp's names for the request's own drafts
    assert 2 * timings["draft_n_accepted"] == accepted and 2 * timings["draft_n"] == proposed  # two like requests
    plain = client.completions.create(model=model_name, prompt="Hello", max_tokens=1)
    assert "draft_n" not in plain.model_extra["timings"]  # no draft ran
