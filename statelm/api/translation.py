"""What every wire protocol that translates into the chat core shares: its request built as a chat request, and the
core's errors named by the protocol's own fields."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from statelm.api.errors import APIError
from statelm.api.protocol import ChatCompletionRequest


def renamer(names: Mapping[str, str]) -> Callable[[str | None], str | None]:
    """A function naming a core parameter (`max_tokens`, `stop.0`) as the protocol calls it, by its head."""

    def rename(param: str | None) -> str | None:
        if param is None:
            return None
        head, dot, rest = param.partition(".")
        return names.get(head, head) + dot + rest

    return rename


@contextmanager
def renamed_parameters(names: Mapping[str, str], keep_in_message: frozenset[str] = frozenset()) -> Iterator[None]:
    """Name the parameter of any APIError raised inside (and in its message) by the protocol's field that set it.

    A name in keep_in_message is renamed as the parameter only (the word is too common to replace in a message).
    """
    try:
        yield
    except APIError as error:
        head = (error.param or "").partition(".")[0]
        if head in names and head not in keep_in_message:  # a field name in the message too ("plus max_tokens 9000")
            error.message = error.message.replace(head, names[head])
        error.param = renamer(names)(error.param)
        raise


def chat_request(fields: Mapping[str, Any], names: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request of a translated request's fields; a value chat refuses is a 400 named by the protocol."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        problem = exc.errors()[0]
        param = renamer(names)(".".join(str(part) for part in problem["loc"]) or None)
        raise APIError(f"Invalid value for '{param}': {problem['msg']}", param=param) from exc
