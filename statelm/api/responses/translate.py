"""/v1/responses in the conversation core's terms: a responses request as the chat request the core serves, and
the core's errors named by the responses fields (the one place that maps them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import ValidationError

from statelm.api.errors import APIError
from statelm.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionChoice,
    FunctionDefinition,
    JSONObjectResponseFormat,
    JSONSchemaResponseFormat,
    JSONSchemaSpec,
    NamedToolChoice,
    ReasoningControls,
    ResponseFormat,
    SamplingOptions,
    TextResponseFormat,
    ToolDefinition,
)
from statelm.api.responses.protocol import (
    FunctionToolChoice,
    ResponsesRequest,
    TextFormat,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)

# The core's (chat's) parameter names and the responses fields they come from
PARAMETERS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
}
SHARED_FIELDS = frozenset(SamplingOptions.model_fields) | frozenset(ReasoningControls.model_fields)


def responses_parameter(param: str | None) -> str | None:
    """A core parameter's name as /v1/responses calls it (`max_tokens` → `max_output_tokens`)."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return PARAMETERS.get(head, head) + dot + rest


@contextmanager
def responses_errors() -> Iterator[None]:
    """Name the parameter of any APIError raised inside by the responses field that set it."""
    try:
        yield
    except APIError as error:
        head = (error.param or "").partition(".")[0]
        if head in PARAMETERS and head != "messages":  # a field name in the message too ("plus max_tokens 9000")
            error.message = error.message.replace(head, PARAMETERS[head])
        error.param = responses_parameter(error.param)
        raise


def chat_request(request: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that generates this response from messages (this turn's, for a session turn)."""
    shared = {name: getattr(request, name) for name in request.model_fields_set & SHARED_FIELDS}
    choice = request.tool_choice
    tools = [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in request.tools or ()
    ]
    text_format = request.text.format if request.text is not None else None
    logprobs = request.logprobs()
    try:
        return ChatCompletionRequest(
            **shared,
            model=request.model,
            messages=messages,
            max_tokens=request.max_output_tokens,
            tools=tools or None,
            tool_choice=NamedToolChoice(type="function", function=FunctionChoice(name=choice.name))
            if isinstance(choice, FunctionToolChoice)
            else choice,
            parallel_tool_calls=request.parallel_tool_calls,
            response_format=response_format(text_format) if text_format is not None else None,
            reasoning_effort=request.reasoning.effort if request.reasoning is not None else None,
            logprobs=logprobs,
            top_logprobs=request.top_logprobs if logprobs else None,
            metadata=request.metadata,
        )
    except ValidationError as exc:  # the responses model checks what chat's does: a translation that fails is a bug
        problem = exc.errors()[0]
        param = responses_parameter(".".join(str(part) for part in problem["loc"]) or None)
        raise APIError(f"Invalid value for '{param}': {problem['msg']}", param=param) from exc


def response_format(text_format: TextFormat) -> ResponseFormat:
    """`text.format` as chat's `response_format`."""
    if isinstance(text_format, TextFormatJSONSchema):
        spec = JSONSchemaSpec(
            name=text_format.name,
            description=text_format.description,
            schema=text_format.schema_,
            strict=text_format.strict,
        )
        return JSONSchemaResponseFormat(type="json_schema", json_schema=spec)
    if isinstance(text_format, TextFormatJSONObject):
        return JSONObjectResponseFormat(type="json_object")
    return TextResponseFormat(type="text")
