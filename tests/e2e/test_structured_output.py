"""Structured output and loop stops on the default model, through the openai SDK.

Every constraint is enforced token by token, so even the 135M model's sampled output is valid every time.
Regexes, choices, grammars and the 400s of wrong constraints are in tests/http.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = "Describe a person as JSON with a name, an age and a city."


def chat(client: openai.OpenAI, model: str, content: str = ASK, **kwargs: object) -> ChatCompletion:
    """A one-message chat completion."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kwargs)


def test_twenty_sampled_json_schema_replies_all_validate(client: openai.OpenAI, model_name: str) -> None:
    reply = chat(client, model_name, response_format=PERSON_FORMAT, n=20, temperature=1.0, seed=3, max_tokens=80)
    assert len(reply.choices) == 20
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert len({choice.message.content for choice in reply.choices}) > 5  # sampled, not one forced answer


def test_json_object_and_streamed_json_schema(client: openai.OpenAI, model_name: str) -> None:
    reply = chat(client, model_name, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    whole = chat(client, model_name, response_format=PERSON_FORMAT, temperature=0, max_tokens=80)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": ASK}],
            response_format=PERSON_FORMAT,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=80,
            stream=True,
        )
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), PERSON)


LOOP_REGEX = r"(ab )+"
LOOP_MAX_TOKENS = 48  # past the latest token at which detection stops the loop (min_tokens + 2 * max_period = 44)


@pytest.mark.parametrize("detect", [True, False])
def test_a_loop_ends_the_output_within_a_few_periods(client: openai.OpenAI, model_name: str, detect: bool) -> None:
    detection = {"enabled": detect, "min_period": 1, "max_period": 16, "min_repeats": 3, "min_tokens": 12}
    reply = chat(
        client,
        model_name,
        "Say ab over and over.",
        temperature=0,
        max_tokens=LOOP_MAX_TOKENS,
        extra_body={"structured_outputs": {"regex": LOOP_REGEX}, "repetition_detection": detection},
    )
    choice = reply.choices[0]
    body = choice.model_dump()
    if not detect:
        assert choice.finish_reason == "length" and reply.usage and reply.usage.completion_tokens == LOOP_MAX_TOKENS
        assert "repetition_detected" not in body
        return
    assert choice.finish_reason == "stop" and body["repetition_detected"] is True
    assert reply.usage is not None and 12 <= reply.usage.completion_tokens <= 12 + 2 * 16
    assert re.fullmatch(r"(ab ?)+", choice.message.content or "")
