"""Caps on one generation request: message count, completion and prompt tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from statelm.api.errors import APIError
from statelm.api.limits import GenerationLimits

LIMITS = GenerationLimits(max_messages=2, max_prompt_tokens=100, max_completion_tokens=50, context_length=1000)


def error_code(call: Callable[[], object]) -> str | None:
    with pytest.raises(APIError) as error:
        call()
    assert error.value.status == 400
    return error.value.code


def test_bodies_within_the_caps_pass() -> None:
    LIMITS.check_body({"messages": [{}, {}], "max_tokens": 50, "max_completion_tokens": 50})
    LIMITS.check_body({"messages": "not a list", "max_tokens": "not a number", "max_completion_tokens": True})
    GenerationLimits(None, None, None).check_body({"messages": [{}] * 10_000, "max_tokens": 10**9})
    LIMITS.check_body({"max_tokens": 1000})  # no prompt fits with it: the context check answers instead


def test_bodies_over_the_caps_get_400_naming_the_field() -> None:
    assert error_code(lambda: LIMITS.check_body({"messages": [{}, {}, {}]})) == "too_many_messages"
    assert error_code(lambda: LIMITS.check_body({"max_tokens": 51})) == "max_tokens_exceeded"
    assert error_code(lambda: LIMITS.check_body({"max_completion_tokens": 50.5})) == "max_tokens_exceeded"
    assert error_code(lambda: LIMITS.check_prompt(101, "prompt")) == "prompt_too_long"
    with pytest.raises(APIError) as raised:
        LIMITS.check_prompt(101, "prompt")
    assert raised.value.param == "prompt"  # the completions endpoint's field, not chat's `messages`
    LIMITS.check_prompt(100, "messages")


def test_the_cap_is_the_default_completion_length() -> None:
    assert LIMITS.completion_budget(None, room=1000) == 50
    assert LIMITS.completion_budget(None, room=20) == 20
    assert LIMITS.completion_budget(7, room=1000) == 7
    assert GenerationLimits(max_completion_tokens=None).completion_budget(None, room=1000) == 1000
