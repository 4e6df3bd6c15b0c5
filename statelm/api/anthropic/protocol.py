"""Request and response bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from statelm.api.json_schemas import JSONSchema, check_parameters_schema
from statelm.api.protocol import MAX_TAG_LENGTH, FunctionName, JSONObject, TypedModel

MIN_THINKING_BUDGET = 1024  # Anthropic's least `thinking.budget_tokens`
NO_IMAGES = "this model takes no images or documents (statelm serves text-only models for now); send text"


class CacheControl(TypedModel):
    """A prompt-caching breakpoint: the prefix up to its block is kept for `ttl`."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(TypedModel):
    """A `text` content block."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # statelm cites nothing; a response's text block sent back carries null


class ToolUseBlock(TypedModel):
    """A `tool_use` block of an assistant message: a call the model made."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=MAX_TAG_LENGTH)]
    name: FunctionName
    input: JSONObject
    cache_control: CacheControl | None = None


class MediaBlock(TypedModel):
    """An `image` or `document` block, which statelm's text-only models refuse."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image", "document"]

    @model_validator(mode="after")
    def _refused(self) -> MediaBlock:
        raise ValueError(NO_IMAGES)


class ToolResultBlock(TypedModel):
    """A `tool_result` block of a user message: what a call returned (`is_error`: it failed)."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=MAX_TAG_LENGTH)]
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The result as one string (text blocks joined)."""
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)  # type: ignore[union-attr]


class ThinkingBlock(TypedModel):
    """A `thinking` block: the model's reasoning, sent back by clients in later turns."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(TypedModel):
    """A `redacted_thinking` block, which statelm never makes (so one sent is from another server)."""

    type: Literal["redacted_thinking"]
    data: str

    @model_validator(mode="after")
    def _refused(self) -> RedactedThinkingBlock:
        raise ValueError("statelm never redacts thinking: this redacted_thinking block comes from another server")


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class InputMessage(TypedModel):
    """One message of `messages`: a user or assistant turn, as a string or content blocks."""

    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    def blocks(self) -> list[Any]:
        """The content as blocks (a string is one text block)."""
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(TypedModel):
    """A client tool the model may call: its name, what it does, and a JSON schema of its input."""

    type: Literal["custom"] | None = None  # Anthropic's server tools (bash, web search …) are not served
    name: FunctionName
    description: str | None = None
    input_schema: JSONObject
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _input_schema(cls, schema: JSONObject, info: ValidationInfo) -> JSONObject | None:
        return check_parameters_schema(schema, info.data.get("name"))


class ToolChoiceAuto(TypedModel):
    """`tool_choice` auto: the model decides."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(TypedModel):
    """`tool_choice` any: the model must call some tool."""

    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(TypedModel):
    """`tool_choice` tool: the model must call the named tool."""

    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(TypedModel):
    """`tool_choice` none: the model calls no tool."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(TypedModel):
    """`thinking` enabled: the model reasons first, for at most `budget_tokens` tokens (at least 1024, as Anthropic)."""

    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)]


class ThinkingDisabled(TypedModel):
    """`thinking` disabled: the model answers without reasoning."""

    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class JSONOutputFormat(TypedModel):
    """`output_config.format`: the reply is JSON valid under `schema`."""

    type: Literal["json_schema"]
    json_schema: JSONSchema = Field(alias="schema")


class OutputConfig(TypedModel):
    """`output_config`: the reply's format and how much the model reasons."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(TypedModel):
    """`metadata`: the end user's id, logged with the request."""

    user_id: Annotated[str, Field(max_length=MAX_TAG_LENGTH)] | None = None


class MessagesInput(TypedModel):
    """What a Messages request and a token count share: the model, the conversation, the tools and thinking."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the whole conversation

    def system_blocks(self) -> list[TextBlock]:
        """`system` as text blocks."""
        if self.system is None:
            return []
        return [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else list(self.system)


class CountTokensRequest(MessagesInput):
    """Body of POST /v1/messages/count_tokens."""


class MessagesRequest(MessagesInput):
    """Body of POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise ValueError(
                f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens ({self.max_tokens})"
            )
        return self


class Usage(BaseModel):
    """Token accounting in Anthropic's terms: `input_tokens` counts only the prompt tokens not read from the cache."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    """Body of a non-streamed reply (and the `message` of a stream's `message_start`)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    """Body of a token count."""

    input_tokens: int
