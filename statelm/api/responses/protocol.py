"""Request bodies of /v1/responses: every field OpenAI documents, each honoured or refused with a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from statelm.api.json_schemas import JSONSchema, check_parameters_schema
from statelm.api.protocol import (
    MAX_TOP_LOGPROBS,
    FunctionName,
    JSONObject,
    Metadata,
    ReasoningControls,
    ReasoningEffort,
    SamplingOptions,
    ToolRules,
    TypedModel,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = (  # what OpenAI's `include` may name, as the SDK lists it
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    LOGPROBS_INCLUDE,
)


class InputText(TypedModel):
    """Text a user, system or developer message (or a function's output) gives the model."""

    type: Literal["input_text"]
    text: str


class OutputTextPart(TypedModel):
    """Text of an earlier assistant message, sent back as input; its annotations and logprobs describe that
    output and do not enter the prompt (as at OpenAI)."""

    type: Literal["output_text"]
    text: str
    annotations: list[JSONObject] = Field(default_factory=list)
    logprobs: list[JSONObject] | None = None


class RefusalPart(TypedModel):
    """A refusal of an earlier assistant message, sent back as input: its text is the message's text."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputTextPart | RefusalPart, Field(discriminator="type")]


class MessageItem(TypedModel):
    """A message of the conversation; `type` may be left out (OpenAI's easy input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's label; not in the prompt

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in self.content)


class FunctionCallItem(TypedModel):
    """A function call the model made earlier."""

    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(TypedModel):
    """What a function call returned, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        """The output as one string."""
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class SummaryText(TypedModel):
    """A summary of reasoning."""

    type: Literal["summary_text"]
    text: str


class ReasoningText(TypedModel):
    """Reasoning text."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(TypedModel):
    """Reasoning the model did earlier: its text goes to the next assistant message's reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("statelm never encrypts reasoning; send the reasoning item's content as text")
        return value

    def text(self) -> str:
        """The reasoning as one string: its content, else its summary."""
        parts = self.content if self.content else self.summary
        return "\n".join(part.text for part in parts)


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a message, function_call, function_call_output or reasoning item",
    ),
]


class FunctionTool(TypedModel):
    """A function the model may call (the only kind of tool statelm has)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, schema: JSONObject | None, info: ValidationInfo) -> JSONObject | None:
        return check_parameters_schema(schema, info.data.get("name"))


class FunctionToolChoice(TypedModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    name: FunctionName


class TextFormatText(TypedModel):
    """`text.format` {"type": "text"}: no constraint."""

    type: Literal["text"]


class TextFormatJSONObject(TypedModel):
    """`text.format` {"type": "json_object"}: one JSON object."""

    type: Literal["json_object"]


class TextFormatJSONSchema(TypedModel):
    """`text.format` {"type": "json_schema"}: JSON valid under the schema (`strict` is always the behaviour)."""

    type: Literal["json_schema"]
    name: FunctionName
    schema_: JSONSchema = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(TypedModel):
    """`text`: the output's format; `verbosity` only as `medium` (statelm has no other)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError("statelm has no verbosity control: only 'medium' (the model as it is) is served")
        return value


class ReasoningConfig(TypedModel):
    """`reasoning`: the effort, as chat's `reasoning_effort`; statelm returns the reasoning text, not summaries."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summaries(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("statelm does not summarize reasoning: reasoning items carry the reasoning text itself")
        return value


class ResponsesStreamOptions(TypedModel):
    """`stream_options`: `include_obfuscation` (default true, as at OpenAI) pads delta events with random text."""

    include_obfuscation: bool = True


# Fields OpenAI documents that statelm refuses when set, and why (null or the default is always accepted).
REFUSED = {
    "background": "background responses are not supported: send background false (or leave it out)",
    "conversation": "the Conversations API is not supported; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls limits built-in tools, and statelm has none (only function tools)",
    "truncation": "truncation 'auto' is not supported: a conversation past the context is a 400 "
    "context_length_exceeded (truncation 'disabled', the default)",
    "prompt_cache_retention": "prompts stay in statelm's in-memory prefix cache while the pool has room; "
    "'24h' retention is not offered (send 'in_memory')",
}


class ResponsesRequest(SamplingOptions, ReasoningControls, ToolRules):
    """Body of POST /v1/responses; statelm's sampling and reasoning extensions are those chat takes."""

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    background: bool = False
    conversation: str | JSONObject | None = None
    prompt: JSONObject | None = None
    max_tool_calls: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, "disabled", "in_memory"):
            raise ValueError(REFUSED[info.field_name or ""])
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                raise ValueError(
                    f"tools[{index}] is a {kind!r} tool: statelm has function tools only, not built-in ones"
                )
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind is not None and kind != "function":
            raise ValueError(
                f"tool_choice of type {kind!r} is not supported: send none, auto, required or "
                '{"type": "function", "name": …}'
            )
        return choice

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        for value in include or ():
            if value == "reasoning.encrypted_content":
                raise ValueError(
                    "statelm never encrypts reasoning: reasoning items carry their text in `content`, "
                    "and a stored response's reasoning stays on the server for previous_response_id"
                )
            if value != LOGPROBS_INCLUDE:
                why = "belongs to a built-in tool, which statelm does not have" if value in INCLUDABLE else "is unknown"
                raise ValueError(f"{value!r} {why}; statelm can include {LOGPROBS_INCLUDE!r}")
        return include

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and LOGPROBS_INCLUDE not in (info.data.get("include") or ()):
            raise ValueError(f"top_logprobs needs include ['{LOGPROBS_INCLUDE}']")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, options: ResponsesStreamOptions | None, info: ValidationInfo
    ) -> ResponsesStreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def logprobs(self) -> bool:
        """Whether output text carries its tokens' logprobs."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def obfuscated(self) -> bool:
        """Whether streamed deltas carry random padding (`stream_options.include_obfuscation`, on by default)."""
        return self.stream_options is None or self.stream_options.include_obfuscation
