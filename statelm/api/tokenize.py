"""POST /tokenize and /detokenize: the model's tokenizer and chat template, as vLLM's server offers them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from statelm.api.errors import APIError
from statelm.api.protocol import ChatMessage, TemplateKwargs, TokenId, ToolDefinition, TypedModel
from statelm.api.serving import ServingContext


class TokenizeRequest(TypedModel):
    """Text (`prompt`) or a conversation (`messages`, rendered by the chat template) to turn into token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt (BOS if the model has one), false for messages
    add_generation_prompt: bool | None = None  # messages only; default true
    tools: list[ToolDefinition] | None = None  # messages only: rendered as a chat request's tools are
    chat_template_kwargs: TemplateKwargs | None = None  # messages only
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The token ids, their count, the context length, and each token's text when asked for."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(TypedModel):
    """Token ids to turn back into text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """The text of the token ids (special tokens included)."""

    prompt: str


def tokenize(context: ServingContext, request: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a text or of a rendered conversation."""
    if request.model is not None:
        context.model.check(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise APIError("send either prompt or messages", param="prompt")
    for name in ("add_generation_prompt", "tools", "chat_template_kwargs"):
        if request.messages is None and getattr(request, name) is not None:
            raise APIError(f"{name} applies to messages only", param=name)
    if request.messages is not None:
        tokens = context.prompter.render(
            request.messages,
            request.tools,
            request.chat_template_kwargs or {},
            add_generation_prompt=request.add_generation_prompt is not False,
            add_special_tokens=bool(request.add_special_tokens),
        ).ids
    else:
        tokens = context.tokenizer.encode(
            request.prompt or "", add_special_tokens=request.add_special_tokens is not False
        )
    strings = [context.strings.text(token) for token in tokens] if request.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=context.model.max_model_len, tokens=tokens, token_strs=strings
    )


def detokenize(context: ServingContext, request: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids."""
    if request.model is not None:
        context.model.check(request.model)
    context.check_token_ids(request.tokens, "tokens")
    return DetokenizeResponse(prompt=context.tokenizer.decode(request.tokens, skip_special_tokens=False))
