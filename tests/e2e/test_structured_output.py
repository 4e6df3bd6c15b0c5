"""Structured output and loop stops on the default model, through the openai SDK and raw HTTP.

Every constraint is enforced token by token, so even the 135M model's sampled output is valid every time.
"""

from __future__ import annotations

import json
import re

import httpx
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
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kwargs)


def error_of(server_url: str, body: dict[str, object]) -> dict[str, object]:
    """The error body of a chat request that must fail with 400."""
    response = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    return response.json()["error"]


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


def test_regex_choice_and_grammar_extensions(client: openai.OpenAI, model_name: str) -> None:
    regex = chat(client, model_name, "Give me a code.", extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"}})
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", regex.choices[0].message.content or "")
    choices = ["yes", "no", "maybe later"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        picked = chat(client, model_name, "Is Paris in France?", temperature=0, extra_body=body)
        assert picked.choices[0].message.content in choices
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    for body in ({"structured_outputs": {"grammar": gbnf}}, {"guided_grammar": gbnf}, {"grammar": gbnf}):
        answer = chat(client, model_name, "What is 6 times 7?", temperature=0, extra_body=body)
        assert re.fullmatch(r"The answer is \d\d\.", answer.choices[0].message.content or "")


def test_completions_take_a_constraint_too(client: openai.OpenAI, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt="The year was", max_tokens=10, extra_body={"structured_outputs": {"regex": r" \d{4}"}}
    )
    assert re.fullmatch(r" \d{4}", completion.choices[0].text)


def test_a_wrong_or_doubled_constraint_is_a_400_naming_the_field(server_url: str, model_name: str) -> None:
    base = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
    }
    assert error_of(server_url, {**base, "response_format": bad_schema})["param"] == "response_format"
    assert error_of(server_url, {**base, "structured_outputs": {"regex": "(unclosed"}})["param"] == "structured_outputs"
    assert error_of(server_url, {**base, "grammar": "root ::= undefined_rule"})["param"] == "grammar"
    both = {**base, "response_format": {"type": "json_object"}, "guided_regex": "a+"}
    assert "both constrain" in str(error_of(server_url, both)["message"])
    two = {**base, "structured_outputs": {"regex": "a", "choice": ["b"]}}
    assert "exactly one" in str(error_of(server_url, two)["message"])
    assert httpx.get(f"{server_url}/health").json() == {"status": "ok"}


LOOP_REGEX = r"(ab )+"


@pytest.mark.parametrize("detect", [True, False])
def test_a_loop_ends_the_output_within_a_few_periods(client: openai.OpenAI, model_name: str, detect: bool) -> None:
    detection = {"enabled": detect, "min_period": 1, "max_period": 16, "min_repeats": 3, "min_tokens": 12}
    reply = chat(
        client,
        model_name,
        "Say ab over and over.",
        temperature=0,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": LOOP_REGEX}, "repetition_detection": detection},
    )
    choice = reply.choices[0]
    body = choice.model_dump()
    if not detect:
        assert choice.finish_reason == "length" and reply.usage and reply.usage.completion_tokens == 120
        assert "repetition_detected" not in body
        return
    assert choice.finish_reason == "stop" and body["repetition_detected"] is True
    assert reply.usage is not None and 12 <= reply.usage.completion_tokens <= 12 + 2 * 16
    assert re.fullmatch(r"(ab ?)+", choice.message.content or "")
