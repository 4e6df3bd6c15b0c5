"""Structured output in-process on the tiny model: bounded constraints hold for any model, and wrong ones are 400s.

Every constraint is enforced token by token, so even random weights give valid output; constraints that leave a
model room to go on (whitespace inside JSON, a repeating loop) are checked on the default model in tests/e2e.
"""

from __future__ import annotations

import re

import httpx
import openai

from tests.e2e.test_structured_output import chat


def error_of(api: httpx.Client, body: dict[str, object]) -> dict[str, object]:
    """The error body of a chat request that must fail with 400."""
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_regex_choice_and_grammar_extensions(client: openai.OpenAI, model_name: str) -> None:
    # [0-9], not \d: llguidance's \d takes every Unicode digit of a newer Unicode than Python 3.11's re knows
    code = {"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{4}"}}
    regex = chat(client, model_name, "Give me a code.", extra_body=code)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", regex.choices[0].message.content or "")
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
        model=model_name,
        prompt="The year was",
        max_tokens=10,
        temperature=0,  # sampled, a 4-byte digit could be cut at max_tokens on the random tiny model
        extra_body={"structured_outputs": {"regex": r" \d{4}"}},
    )
    assert re.fullmatch(r" \d{4}", completion.choices[0].text)


def test_a_wrong_or_doubled_constraint_is_a_400_naming_the_field(api: httpx.Client, model_name: str) -> None:
    base = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
    }
    assert error_of(api, {**base, "response_format": bad_schema})["param"] == "response_format.json_schema.schema"
    dangling = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/absent"}}}
    assert error_of(api, {**base, "response_format": dangling})["param"] == "response_format"  # when compiled
    assert error_of(api, {**base, "structured_outputs": {"regex": "(unclosed"}})["param"] == "structured_outputs"
    assert error_of(api, {**base, "grammar": "root ::= undefined_rule"})["param"] == "grammar"
    both = {**base, "response_format": {"type": "json_object"}, "guided_regex": "a+"}
    assert "both constrain" in str(error_of(api, both)["message"])
    two = {**base, "structured_outputs": {"regex": "a", "choice": ["b"]}}
    assert "exactly one" in str(error_of(api, two)["message"])
    assert api.get("/health").json()["status"] == "ok"
