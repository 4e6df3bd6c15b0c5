"""What /v1/responses answers with: the response object, its output items and usage, and the item lists."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from statelm.api.protocol import ChoiceLogprobs, Timings
from statelm.api.responses.protocol import FunctionTool, FunctionToolChoice, ItemStatus, TextFormat

ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]


class OutputText(BaseModel):
    """The text of an assistant message, with its tokens' logprobs when `include` asks for them."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda value: value is None)


class OutputMessage(BaseModel):
    """An assistant message of the output."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    """A function call of the output."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningTextPart(BaseModel):
    """The text of a reasoning item."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class Reasoning(BaseModel):
    """The model's reasoning (its think block), as text; statelm writes no summaries."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCall | Reasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    """Input tokens served from the session's KV or the prefix cache, and those computed (written to the cache)."""

    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    """Output tokens of the reasoning: those of the think block, its tags included."""

    reasoning_tokens: int


class ResponseUsage(BaseModel):
    """Token accounting of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response stopped short."""

    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed."""

    code: Literal["server_error"] = "server_error"
    message: str


class ReasoningSettings(BaseModel):
    """The reasoning settings a response was made with."""

    effort: str | None = None
    summary: None = None


class TextSettings(BaseModel):
    """The output format a response was made with."""

    format: TextFormat
    verbosity: Literal["medium"] = "medium"


class ResponseObject(BaseModel):
    """A response, as POST /v1/responses, its stream's lifecycle events and GET /v1/responses/{id} give it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None
    output: list[OutputItem]
    output_text: str  # what the SDKs compute from `output`, for clients without one
    previous_response_id: str | None
    store: bool
    background: bool = False
    max_output_tokens: int | None
    max_tool_calls: None = None
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    top_logprobs: int | None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    text: TextSettings
    reasoning: ReasoningSettings
    truncation: Literal["disabled"] = "disabled"
    service_tier: str
    metadata: dict[str, str]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    prompt_cache_retention: Literal["in_memory"] | None
    usage: ResponseUsage | None
    timings: Timings | None = Field(default=None, exclude_if=lambda value: value is None)  # llama.cpp's, as in chat


class DeletedResponse(BaseModel):
    """Body of DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(BaseModel):
    """Body of GET /v1/responses/{id}/input_items: a page of a response's input items, with their ids."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def output_logprobs(logprobs: ChoiceLogprobs) -> list[dict[str, Any]]:
    """Chat's logprobs of some tokens in the shape of `output_text.logprobs` (the same fields)."""
    return [entry.model_dump() for entry in logprobs.content]
