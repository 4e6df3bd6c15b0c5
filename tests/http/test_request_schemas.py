"""The JSON Schemas a request carries are checked on arrival: a tool's parameters, a response format's schema and
structured outputs that are not JSON Schemas are 400s naming the field (and the function), in the shape of each
API, and the server stays healthy. A valid schema of any draft passes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.test_tools import WEATHER_PARAMETERS
from tests.http.test_anthropic import HELLO, assert_anthropic_error

NOT_A_SCHEMA = {"type": "frob"}
NESTED_WRONG = {"type": "object", "properties": {"city": {"type": "string", "maxLength": "thirty"}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool(parameters: Any, name: str = "get_weather") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "Weather.", "parameters": parameters}}


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The error of a 400 in OpenAI's shape."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [tool(NOT_A_SCHEMA)]}, "tools.0.function.parameters", ("'get_weather'", "'frob'", "at type")),
        ({"tools": [tool(WEATHER_PARAMETERS, "a"), tool(NESTED_WRONG, "b")]}, "tools.1.function.parameters",
         ("'b'", "properties/city/maxLength")),
        ({"tools": [tool({"type": "string"})]}, "tools.0.function.parameters", ("type 'object'",)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NOT_A_SCHEMA}}},
         "response_format.json_schema.schema", ("'frob'",)),
        ({"response_format": {"type": "json_schema", "schema": NESTED_WRONG}}, "response_format.schema",
         ("maxLength",)),
        ({"response_format": {"type": "json_object", "schema": NOT_A_SCHEMA}}, "response_format.schema", ("frob",)),
        ({"structured_outputs": {"json": NOT_A_SCHEMA}}, "structured_outputs.json", ("'frob'",)),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", ("not a JSON text",)),
        ({"guided_json": '{"type": "frob"}'}, "guided_json", ("'frob'",)),
        ({"json_schema": {"type": "object", "required": "city"}}, "json_schema", ("required",)),
    ],
)  # fmt: skip
def test_chat_refuses_what_is_not_a_json_schema(
    api: httpx.Client, model_name: str, fields: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 4, **fields}
    error = openai_error(api.post("/v1/chat/completions", json=body))
    assert error["param"] == param and error["code"] == "invalid_value"
    for word in words:
        assert word in error["message"], error["message"]


def test_completions_and_responses_refuse_them_too(api: httpx.Client, model_name: str) -> None:
    completion = {"model": model_name, "prompt": "The year was", "max_tokens": 4, "structured_outputs": {"json": []}}
    assert openai_error(api.post("/v1/completions", json=completion))["param"] == "structured_outputs.json"
    responses = {"model": model_name, "input": "Weather in Paris?", "max_output_tokens": 16}
    function = {"type": "function", "name": "get_weather", "parameters": NOT_A_SCHEMA}
    error = openai_error(api.post("/v1/responses", json={**responses, "tools": [function]}))
    assert error["param"] == "tools.0.parameters" and "'get_weather'" in error["message"]
    text = {"format": {"type": "json_schema", "name": "x", "schema": NESTED_WRONG}}
    assert openai_error(api.post("/v1/responses", json={**responses, "text": text}))["param"] == "text.format.schema"
    assert api.get("/health").json()["status"] == "ok"


def test_messages_refuse_them_in_anthropics_shape(api: httpx.Client) -> None:
    base = {"model": "default", "max_tokens": 6, "messages": HELLO}
    bad_tool = {"name": "get_weather", "description": "Weather.", "input_schema": NOT_A_SCHEMA}
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        response = api.post(route, json={**base, "tools": [bad_tool]})
        assert_anthropic_error(response, 400, "tools.0.input_schema", "'get_weather'", "'frob'")
    output = {"format": {"type": "json_schema", "schema": NESTED_WRONG}}
    response = api.post("/v1/messages", json={**base, "output_config": output})
    assert_anthropic_error(response, 400, "output_config.format.schema", "maxLength")
    assert api.get("/health").json()["status"] == "ok"


def test_valid_schemas_of_any_draft_pass(api: httpx.Client, model_name: str) -> None:
    draft7 = {**WEATHER_PARAMETERS, "$schema": "http://json-schema.org/draft-07/schema#", "definitions": {}}
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 4, "tools": [tool(draft7)]}
    assert api.post("/v1/chat/completions", json=body).status_code == 200
    no_parameters = {"type": "function", "function": {"name": "now", "description": "The time."}}
    assert api.post("/v1/chat/completions", json={**body, "tools": [no_parameters]}).status_code == 200
