"""Request and response bodies of the OpenAI-compatible API, as pydantic models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16


class StrictModel(BaseModel):
    """Rejects unknown fields and non-finite numbers, so nothing a client sends is silently dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextContentPart(StrictModel):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_transcript(self) -> dict[str, Any]:
        """The message as a session's transcript keeps it: as sent, without unset fields."""
        return self.model_dump(exclude_none=True)

    def for_template(self) -> dict[str, str]:
        """The message as a chat template expects it; `developer` is the newer name of `system`."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class StreamOptions(StrictModel):
    """Options of a streamed response."""

    include_usage: bool = False


class ChatCompletionRequest(StrictModel):
    """Body of POST /v1/chat/completions; every field here is honoured."""

    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=1, description="only n=1 is supported")] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    session_id: str | None = None  # statelm: `messages` are this turn's messages, appended to the session

    @model_validator(mode="after")
    def _check_consistency(self) -> ChatCompletionRequest:
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if any(s == "" for s in self.stop_strings()):
            raise ValueError("stop strings must not be empty")
        return self

    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The completion length limit, under either of its names."""
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token accounting of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One generated choice."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    session_id: str | None = Field(default=None, exclude_if=lambda value: value is None)


class DeltaMessage(BaseModel):
    """The new part of the message in one stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """One choice's delta in a stream chunk."""

    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    session_id: str | None = Field(default=None, exclude_if=lambda value: value is None)


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "statelm"
    max_model_len: int


class ModelList(BaseModel):
    """Body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
