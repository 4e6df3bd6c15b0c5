"""Caps on one generation request: messages, prompt tokens and completion tokens, each a clear 400."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from statelm.api.errors import APIError

COMPLETION_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MESSAGE_LIST_FIELDS = ("messages", "input")  # chat's messages, a response's input items


@dataclass(frozen=True)
class GenerationLimits:
    """What one generation request may ask for; None means no cap beyond the model's context."""

    max_messages: int | None = 1024
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = 8192
    context_length: int | None = None  # the model's; a max_tokens this large is a context error, not a cap one

    def check_body(self, body: Mapping[str, Any]) -> None:
        """400 if a request body, as sent, has too many messages (or input items) or asks for more tokens than the cap.

        A max_tokens no prompt could fit with is left to the context check, whose code says so.
        """
        for name in MESSAGE_LIST_FIELDS:
            messages = body.get(name)
            if self.max_messages is not None and isinstance(messages, list) and len(messages) > self.max_messages:
                raise APIError(
                    f"The request has {len(messages)} {name}; this server takes at most {self.max_messages}.",
                    param=name,
                    code="too_many_messages",
                )
        cap, context = self.max_completion_tokens, self.context_length
        for name in COMPLETION_LENGTH_FIELDS:
            value = body.get(name)
            if not isinstance(value, int | float) or isinstance(value, bool) or (context and value >= context):
                continue
            if cap is not None and value > cap:
                raise APIError(
                    f"{name} is {value}, but this server generates at most {cap} tokens per request.",
                    param=name,
                    code="max_tokens_exceeded",
                )

    def check_prompt(self, prompt_tokens: int, param: str) -> None:
        """400 naming param (the prompt's field) if a prompt has more tokens than the prompt cap."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise APIError(
                f"The prompt has {prompt_tokens} tokens; this server takes at most {self.max_prompt_tokens}.",
                param=param,
                code="prompt_too_long",
            )

    def completion_budget(self, requested: int | None, room: int) -> int:
        """The completion length of a request: as requested, else what the context has room for, up to the cap."""
        if requested is not None:
            return requested
        return room if self.max_completion_tokens is None else min(room, self.max_completion_tokens)
