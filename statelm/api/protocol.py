"""Request and response bodies of the OpenAI-compatible API: what the generation routes share, and chat's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator, model_validator

from statelm.engine.logits_processors import LOGIT_BIAS_LIMIT

MAX_STOP_STRINGS = 16
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch generators accept

TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[int, Field(ge=0), Strict(False)]  # JSON object keys are strings


class StrictModel(BaseModel):
    """Rejects unknown fields and non-finite numbers, so nothing a client sends is silently dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TypedModel(StrictModel):
    """A StrictModel that also refuses a value of another JSON type (`true` for a number, `"yes"` for a boolean)."""

    model_config = ConfigDict(strict=True)


class SamplerSettings(TypedModel):
    """Sampling fields a server may default per model (`--default-sampling`, generation_config.json); None = unset."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    repetition_penalty_range: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole context, 0: off


class StreamOptions(TypedModel):
    """Options of a streamed response."""

    include_usage: bool = False


class GenerationRequest(SamplerSettings):
    """The fields chat and text completions share; each one is honoured (an explicit null counts as unset)."""

    model: str
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`"field": null` means the field's default, as in OpenAI's API; unknown fields are still rejected."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The completion length limit the request sets, if any."""
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """How many top alternatives to report with each token's logprob; None when logprobs are off."""
        return None

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class TextContentPart(TypedModel):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(TypedModel):
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


class ChatCompletionRequest(GenerationRequest):
    """Body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    session_id: str | None = None  # statelm: `messages` are this turn's messages, appended to the session

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_length_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_tokens ({other}) and max_completion_tokens ({value}) differ; send one of them")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def requested_max_tokens(self) -> int | None:
        """The completion length limit, under either of its names."""
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """`top_logprobs` (0 if unset) when `logprobs` is true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    """Breakdown of the prompt tokens."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token accounting of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(BaseModel):
    """Where a response's time went, in llama.cpp's `timings` fields (`prompt_n` excludes the cached tokens)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


def _omit_none(value: object) -> bool:
    return value is None


class TopLogprob(BaseModel):
    """A token and its logprob, with the token's UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    """A generated token's logprob and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Logprobs of a choice's tokens, in chat's format."""

    content: list[TokenLogprobInfo]
    refusal: None = None


class AssistantMessage(BaseModel):
    """The generated message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One generated choice."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    session_id: str | None = Field(default=None, exclude_if=_omit_none)


class DeltaMessage(BaseModel):
    """The new part of the message in one stream chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """One choice's delta in a stream chunk."""

    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one before [DONE] carries `timings`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = Field(default=None, exclude_if=_omit_none)
    session_id: str | None = Field(default=None, exclude_if=_omit_none)


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
