"""The served model's chat format: rendering a conversation with tools and reasoning controls, and reading its output.

`ChatPrompter` knows what the model's template supports (native tools, `enable_thinking`, `reasoning_effort`),
which think tags and which tool-call format its output uses (from the template, or `--reasoning-parser` and
`--tool-parser`), and builds each choice's output parser and reasoning budget to match.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from statelm.api.chat_output import ChoiceOutputParser
from statelm.api.chat_template_input import FALLBACK_TOOL_PARSER, TemplateFeatures, template_messages
from statelm.api.errors import APIError
from statelm.api.parsers.reasoning import (
    ReasoningParser,
    ReasoningSpan,
    ReasoningTags,
    prompt_opens_reasoning,
    reasoning_tags_for,
)
from statelm.api.parsers.tools import ForcedToolParser, ToolParser, get_tool_parser
from statelm.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolDefinition
from statelm.engine.client import ReasoningBudget
from statelm.tokenizer import ChatTemplateError, Tokenizer

_EFFORTS_WITHOUT_THINKING = frozenset({"none", "minimal"})


@dataclass(frozen=True)
class RenderedPrompt:
    """A conversation rendered by the template, as text and token ids, and whether it ends inside a think block."""

    text: str
    ids: list[int]
    opens_reasoning: bool = False  # the output starts with reasoning


class ChatPrompter:
    """Renders conversations for one model and says how to read its output."""

    def __init__(self, tokenizer: Tokenizer, *, tool_parser: str | None = None, reasoning_parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.features = TemplateFeatures.of(tokenizer.chat_template)
        self.reasoning_tags: ReasoningTags | None = reasoning_tags_for(reasoning_parser, tokenizer.chat_template)
        fallback = None if self.features.native_tools else FALLBACK_TOOL_PARSER
        name = tool_parser or self.features.tool_parser or fallback
        self.tool_parser: type[ToolParser] | None = get_tool_parser(name) if name else None
        markers = [*(self.tool_parser.openers if self.tool_parser else ())]
        if self.reasoning_tags is not None:
            markers += [self.reasoning_tags.start, self.reasoning_tags.end]
        self.keep_special_tokens = any(
            tokenizer.is_special(token) for marker in markers for token in tokenizer.encode(marker)
        )
        tags = self.reasoning_tags
        self._tag_ids = (
            None if tags is None else (tuple(tokenizer.encode(tags.start)), tuple(tokenizer.encode(tags.end)))
        )

    def template_kwargs(self, request: ChatCompletionRequest, base: Mapping[str, Any]) -> dict[str, Any]:
        """The template variables of a request: `base` (a session's), its chat_template_kwargs, reasoning_effort."""
        kwargs = {**base, **(request.chat_template_kwargs or {})}
        effort = request.reasoning_effort
        if effort is not None:
            if self.features.reasoning_effort:
                kwargs.setdefault("reasoning_effort", effort)
            elif self.features.enable_thinking:
                kwargs.setdefault("enable_thinking", effort not in _EFFORTS_WITHOUT_THINKING)
            else:
                raise APIError(
                    "this model's chat template has no reasoning control (reasoning_effort or enable_thinking)",
                    param="reasoning_effort",
                )
        return kwargs

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[ToolDefinition] | None,
        kwargs: Mapping[str, Any],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        check_text: Callable[[str], None] | None = None,
        prefill: str = "",
    ) -> RenderedPrompt:
        """The conversation (and tools) as the template renders it; 400 if the template refuses it.

        `prefill` is the start of the reply, which the output continues (after the generation prompt).
        `check_text` sees the rendered text before it is tokenized (and may refuse it by raising).
        """
        prepared = template_messages(messages, tools, self.features)
        try:
            text = self.tokenizer.apply_chat_template(
                prepared.messages, add_generation_prompt=add_generation_prompt, tools=prepared.tools, **kwargs
            )
        except ChatTemplateError as exc:
            raise APIError(f"cannot render the conversation: {exc}", param="messages") from exc
        text += prefill
        if check_text is not None:
            check_text(text)
        opens = self.reasoning_tags is not None and prompt_opens_reasoning(text, self.reasoning_tags)
        return RenderedPrompt(text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens), opens)

    def reasoning_budget(self, request: ChatCompletionRequest, prompt: RenderedPrompt) -> ReasoningBudget | None:
        """The engine's budget for max_reasoning_tokens / thinking_budget; 400 for a model that does not reason."""
        budget = request.reasoning_budget()
        if budget is None:
            return None
        if self._tag_ids is None:
            raise APIError(
                "this model has no reasoning block to budget (no think tags in its template; see --reasoning-parser)",
                param="max_reasoning_tokens" if request.max_reasoning_tokens is not None else "thinking_budget",
            )
        start_ids, end_ids = self._tag_ids
        return ReasoningBudget(budget, start_ids, end_ids, opened_by_prompt=prompt.opens_reasoning)

    def reasoning_end_ids(self, prompt: RenderedPrompt) -> tuple[int, ...]:
        """Where an output constraint starts: after the think block the prompt opened, else at once (empty)."""
        return self._tag_ids[1] if self._tag_ids is not None and prompt.opens_reasoning else ()

    def output_parsers(self, request: ChatCompletionRequest, prompt: RenderedPrompt) -> list[ChoiceOutputParser]:
        """One parser per choice: reasoning if the model reasons, tool calls as tool_choice asks (400 if unreadable)."""
        tool_dicts = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
        tool_parser: type[ToolParser] | None = None
        if forces_tool_call(request):
            tool_parser = ForcedToolParser
        elif request.tools and request.tool_choice != "none":
            if self.tool_parser is None:
                raise APIError(
                    "this model's chat template has no tool-call format statelm recognises; start the server "
                    "with --tool-parser",
                    param="tools",
                )
            tool_parser = self.tool_parser
        tags = self.reasoning_tags
        span = None if self._tag_ids is None else ReasoningSpan(*self._tag_ids, prompt.opens_reasoning)
        return [
            ChoiceOutputParser(
                None if tags is None else ReasoningParser(tags, in_reasoning=prompt.opens_reasoning),
                None if tool_parser is None else tool_parser(tool_dicts),
                single_call=not request.parallel_tool_calls,
                span=span,
            )
            for _ in range(request.n)
        ]


def forces_tool_call(request: ChatCompletionRequest) -> bool:
    """Whether tool_choice makes a call obligatory (`required`, or a named function)."""
    return bool(request.tools) and (
        request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
    )
