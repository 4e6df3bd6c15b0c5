"""Reasoning split from the answer in streamed model text, and think-tag detection in chat templates."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from statelm.api.parsers.partial import partial_marker_suffix


@dataclass(frozen=True)
class ReasoningTags:
    """The strings that open and close a model's reasoning block."""

    start: str = "<think>"
    end: str = "</think>"


THINK_TAGS = ReasoningTags()
# Qwen3/DeepSeek-R1/GLM and most others, Seed-OSS, Magistral, Command-A Reasoning.
KNOWN_REASONING_TAGS = (
    ReasoningTags("<seed:think>", "</seed:think>"),
    THINK_TAGS,
    ReasoningTags("[THINK]", "[/THINK]"),
    ReasoningTags("<|START_THINKING|>", "<|END_THINKING|>"),
)


# --reasoning-parser names (vLLM's where they exist) and the tags each one reads
REASONING_PARSERS = {
    "deepseek_r1": THINK_TAGS,
    "qwen3": THINK_TAGS,
    "think": THINK_TAGS,
    "seed_oss": KNOWN_REASONING_TAGS[0],
    "mistral": KNOWN_REASONING_TAGS[2],
    "command_a": KNOWN_REASONING_TAGS[3],
}


def reasoning_tags_for(parser: str, template: str | None) -> ReasoningTags | None:
    """The tags a `--reasoning-parser` value stands for: `auto` reads them off the template, `none` turns it off."""
    if parser == "auto":
        return detect_reasoning_tags(template)
    if parser == "none":
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; choose auto, none or one of {', '.join(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[parser]


class ReasoningDelta(NamedTuple):
    """New reasoning text and new answer text from one chunk of output."""

    reasoning: str
    content: str


class _Phase(enum.Enum):
    OPENING = "opening"  # not yet known whether the output opens a think block
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """Routes streamed output to reasoning (inside the think block) or content (the answer), across any chunking.

    The block is either opened by the prompt (`in_reasoning=True`, see `prompt_opens_reasoning`) or by the
    start tag at the very beginning of the output; output that does not open one is all content. Tags are
    dropped, and so is whitespace around the reasoning and before the answer that follows it.
    """

    def __init__(self, tags: ReasoningTags = THINK_TAGS, *, in_reasoning: bool = False) -> None:
        self.tags = tags
        self._phase = _Phase.REASONING if in_reasoning else _Phase.OPENING
        self._held = ""
        self._trim = True  # strip the whitespace that starts the reasoning or the answer after it
        self._closed = False

    @property
    def in_reasoning(self) -> bool:
        """True while output goes to reasoning (for a reasoning budget: count tokens while this holds)."""
        return self._phase is _Phase.REASONING

    @property
    def reasoning_ended(self) -> bool:
        """True once the end tag has been seen."""
        return self._closed

    def feed(self, text: str) -> ReasoningDelta:
        """Add output text; return the reasoning and content that are certain now (a partial tag is held back)."""
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """Release held text at the end of the output (an unclosed block is all reasoning)."""
        held, self._held = self._held, ""
        if self._phase is _Phase.OPENING:
            return ReasoningDelta("", held)
        if self._phase is _Phase.REASONING:
            return ReasoningDelta(held.rstrip(), "")
        return ReasoningDelta("", "")  # content is never held, except whitespace before the answer

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current phase can; True when the phase changed and there may be more to do."""
        start, end = self.tags.start, self.tags.end
        if self._phase is _Phase.OPENING:
            body = self._held.lstrip()
            if body.startswith(start):
                self._held = body[len(start) :]
                self._phase, self._trim = _Phase.REASONING, True
                return True
            if not start.startswith(body):
                self._phase, self._trim = _Phase.CONTENT, False
                return True
            return False
        if self._trim:
            self._held = self._held.lstrip()
            if not self._held:
                return False
            self._trim = False
        if self._phase is _Phase.CONTENT:
            content.append(self._held)
            self._held = ""
            return False
        index = self._held.find(end)
        if index >= 0:
            reasoning.append(self._held[:index].rstrip())
            self._held = self._held[index + len(end) :]
            self._phase, self._trim, self._closed = _Phase.CONTENT, True, True
            return True
        ready = self._held[: len(self._held) - partial_marker_suffix(self._held, (end,))].rstrip()
        reasoning.append(ready)
        self._held = self._held[len(ready) :]
        return False


def detect_reasoning_tags(template: str | None) -> ReasoningTags | None:
    """The think tags a chat template's source uses, or None when it uses none of the known pairs."""
    if not template:
        return None
    return next((tags for tags in KNOWN_REASONING_TAGS if tags.start in template and tags.end in template), None)


def prompt_opens_reasoning(prompt: str, tags: ReasoningTags) -> bool:
    """Whether a rendered prompt ends by opening a think block, so the output starts inside it."""
    return prompt.rstrip().endswith(tags.start)


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a think block is in an output's token ids: from its start tag (or from the first token, when the
    prompt opened it) up to and including its end tag, each tag as the tokenizer encodes it alone."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    opened_by_prompt: bool

    def count(self, token_ids: list[int]) -> int:
        """How many of the output's tokens the think block takes, its tags included (all of them if unclosed)."""
        begin = 0
        if not self.opened_by_prompt:
            if tuple(token_ids[: len(self.start)]) != self.start:
                return 0
            begin = len(self.start)
        width = len(self.end)
        for position in range(begin, len(token_ids) - width + 1):
            if tuple(token_ids[position : position + width]) == self.end:
                return position + width
        return len(token_ids)
