"""Request validation problems become OpenAI errors that name the right parameter."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from statelm.api.protocol import ChatCompletionRequest
from statelm.server.errors import validation_error

USER = [{"role": "user", "content": "hi"}]


def error_for(body: dict[str, Any]) -> tuple[str | None, str, str | None]:
    body = {"model": "m", **body}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    error = validation_error(errors, body)
    assert error.status == 400 and error.type == "invalid_request_error"
    return error.param, error.message, error.code


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": USER, "frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
        ({"messages": USER, "temperature": "hot"}, "temperature", "valid number"),
        ({"messages": USER, "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type", "'text'"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "required"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'system'"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        (
            {"messages": USER, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "required",
        ),
        ({"messages": USER, "tool_choice": "auto"}, "tool_choice", "needs tools"),
        (
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
            "response_format.json_schema.schema",
            "valid dictionary",
        ),
    ],
)
def test_the_parameter_at_fault_is_named(body: dict[str, Any], param: str, words: str) -> None:
    named, message, _ = error_for(body)
    assert named == param
    assert words in message and param in message


def test_non_finite_numbers_are_rejected() -> None:
    named, _, code = error_for({"messages": USER, "temperature": float("nan")})
    assert named == "temperature" and code == "invalid_value"
