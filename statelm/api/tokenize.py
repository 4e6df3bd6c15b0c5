"""POST /tokenize and /detokenize: the model's tokenizer and chat template, as vLLM's server offers them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from statelm.api.errors import APIError
from statelm.api.protocol import ChatMessage, TemplateKwargs, TokenId, ToolDefinition, TypedModel
from statelm.api.serving import ServingContext


class TokenizeRequest(TypedModel):
    """Text (`prompt`, llama.cpp's `content`) or a conversation (`messages`, rendered by the template) to tokenize."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama.cpp's name of prompt
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt (BOS if the model has one), false for messages
    add_generation_prompt: bool | None = None  # messages only; default true
    tools: list[ToolDefinition] | None = None  # messages only: rendered as a chat request's tools are
    chat_template_kwargs: TemplateKwargs | None = None  # messages only
    return_token_strs: bool = False
    add_special: bool | None = None  # llama.cpp's name of add_special_tokens
    with_pieces: bool = False  # llama.cpp: tokens as {"id", "piece"} objects

    @model_validator(mode="after")
    def _one_name_each(self) -> TokenizeRequest:
        """llama.cpp's names stand for statelm's; a request may send one name of each field."""
        for ours, theirs in (("prompt", "content"), ("add_special_tokens", "add_special")):
            if getattr(self, ours) is not None and getattr(self, theirs) is not None:
                raise ValueError(f"{ours} and {theirs} are the same field (statelm's and llama.cpp's name); send one")
        return self

    def text(self) -> str | None:
        """The text to tokenize, under either name."""
        return self.prompt if self.prompt is not None else self.content

    def special_tokens(self) -> bool | None:
        """Whether to add the model's special tokens, under either name (None: the default)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.add_special


class TokenPiece(BaseModel):
    """llama.cpp's `with_pieces` form of a token: its id and its text (its bytes when they are not UTF-8)."""

    id: int
    piece: str | list[int]


class TokenizeResponse(BaseModel):
    """The token ids, their count, the context length, and each token's text when asked for."""

    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]
    token_strs: list[str] | None = None


class DetokenizeRequest(TypedModel):
    """Token ids to turn back into text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """The text of the token ids (special tokens included), as `prompt` (vLLM) and `content` (llama.cpp)."""

    prompt: str
    content: str


async def tokenize(context: ServingContext, request: TokenizeRequest) -> TokenizeResponse:
    """Token ids of a text or of a rendered conversation (rendered and tokenized off the event loop)."""
    if request.model is not None:
        context.model.check(request.model)
    text, special = request.text(), request.special_tokens()
    text_param = "content" if request.content is not None else "prompt"
    if (text is None) == (request.messages is None):
        raise APIError("send either prompt (or content) or messages", param=text_param)
    for name in ("add_generation_prompt", "tools", "chat_template_kwargs"):
        if request.messages is None and getattr(request, name) is not None:
            raise APIError(f"{name} applies to messages only", param=name)
    if request.messages is not None:
        prompt = await context.render(
            request.messages,
            request.tools,
            request.chat_template_kwargs or {},
            add_generation_prompt=request.add_generation_prompt is not False,
            add_special_tokens=bool(special),
        )
        tokens = prompt.ids
    else:
        tokens = await context.encode(text or "", text_param, add_special_tokens=special is not False)
    strings = [context.strings.text(token) for token in tokens] if request.return_token_strs else None
    listed: list[int] | list[TokenPiece] = (
        [_piece(context, token) for token in tokens] if request.with_pieces else tokens
    )
    return TokenizeResponse(
        count=len(tokens), max_model_len=context.model.max_model_len, tokens=listed, token_strs=strings
    )


def _piece(context: ServingContext, token_id: int) -> TokenPiece:
    """A token as llama.cpp's `with_pieces` shows it."""
    raw = bytes(context.strings.bytes(token_id))
    try:
        return TokenPiece(id=token_id, piece=raw.decode("utf-8"))
    except UnicodeDecodeError:
        return TokenPiece(id=token_id, piece=list(raw))


def detokenize(context: ServingContext, request: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids."""
    if request.model is not None:
        context.model.check(request.model)
    context.check_token_ids(request.tokens, "tokens")
    text = context.tokenizer.decode(request.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text, content=text)
