"""/v1/responses in the conversation core's terms: a responses request as the chat request the core serves, and
the core's errors named by the responses fields (the one place that maps them)."""

from __future__ import annotations

from contextlib import AbstractContextManager

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
from statelm.api.translation import chat_request as chat_request_of
from statelm.api.translation import renamed_parameters

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


def responses_errors() -> AbstractContextManager[None]:
    """Name the parameter of any APIError raised inside by the responses field that set it."""
    return renamed_parameters(PARAMETERS, keep_in_message=frozenset({"messages"}))


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
    return chat_request_of(
        dict(
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
        ),
        PARAMETERS,
    )


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
