"""Request and response bodies of the legacy text completions API (POST /v1/completions)."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from statelm.api.protocol import GenerationRequest, Timings, TokenId, TopLogprobs, Usage

NonEmptyText = Annotated[list[str], Field(min_length=1)]
NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    """Body of POST /v1/completions: one or more prompts, as text or token ids, continued as they are."""

    prompt: str | NonEmptyText | NonEmptyIds | Annotated[list[NonEmptyIds], Field(min_length=1)]
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("echo"):
            raise ValueError("logprobs together with echo (logprobs of the prompt) is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill in the middle) is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of must equal n: every generated choice is returned")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [cast(list[int], prompt)]
        return list(prompt)  # texts, or token id lists

    def top_logprobs_count(self) -> int | None:
        """`logprobs`: the number of top alternatives to report with each token; None when off."""
        return self.logprobs


class CompletionLogprobs(BaseModel):
    """Logprobs of a choice's tokens in the legacy format; top_logprobs also holds the chosen token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One generated choice; in a stream, its new text."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings
    system_fingerprint: str
    service_tier: str


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed text completion; the last one before [DONE] carries `timings`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = Field(default=None, exclude_if=lambda value: value is None)
    system_fingerprint: str
    service_tier: str
