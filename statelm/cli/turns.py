"""One streamed chat turn: reply text, reasoning, timing and token counts; Ctrl-C cancels it cleanly."""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.text import Text

from statelm.cli.client import StatelmClient
from statelm.cli.render import ReplyView

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class TurnStats:
    """Measurements of the last turn."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str | None = None

    def line(self) -> str:
        """A one-line summary such as `37 prompt (0 cached) · 8 generated · TTFT 0.31s · 24.0 tok/s`."""
        parts = [f"{self.prompt_tokens} prompt ({self.cached_tokens} cached)", f"{self.completion_tokens} generated"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s:.2f}s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.finish_reason not in (None, "stop"):
            parts.append(f"finish: {self.finish_reason}")
        return " · ".join(parts)


@dataclass
class Reply:
    """What a turn produced; an interrupted turn was discarded by the server."""

    content: str = ""
    reasoning: str = ""
    stats: TurnStats = field(default_factory=TurnStats)
    interrupted: bool = False


class ThinkSplitter:
    """Separates `<think>…</think>` reasoning from the answer in streamed text, tags split across chunks included."""

    def __init__(self) -> None:
        self.thinking = False
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(answer, reasoning) text that is certain so far."""
        text, self._pending = self._pending + text, ""
        answer, reasoning = [], []
        while text:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            out = reasoning if self.thinking else answer
            index = text.find(tag)
            if index >= 0:
                out.append(text[:index])
                text = text[index + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)
            out.append(text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
            break
        return "".join(answer), "".join(reasoning)

    def flush(self) -> tuple[str, str]:
        """(answer, reasoning) held back at the end of the stream because it looked like the start of a tag."""
        pending, self._pending = self._pending, ""
        return ("", pending) if self.thinking else (pending, "")


def set_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings that have a value, for a request body."""
    return {k: v for k, v in settings.items() if v is not None}


def print_reasoning(console: Console, reply: Reply | None) -> None:
    """Show a reply's reasoning in full (the REPLs collapse it after the reply)."""
    reasoning = reply.reasoning.strip() if reply else ""
    console.print(Text(reasoning, style="dim italic") if reasoning else "(the last reply had no reasoning)")


def run_turn(client: StatelmClient, body: dict[str, Any], console: Console) -> Reply:
    """Stream one chat completion to the console and measure it; Ctrl-C stops it and marks it interrupted."""
    reply, splitter = Reply(), ThinkSplitter()
    started = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    with ReplyView(console) as view, closing(client.stream_chat(body)) as chunks:
        try:
            for chunk in chunks:
                answer, thought = splitter.feed(chunk.content)
                thought += chunk.reasoning
                if answer or thought:
                    last = time.perf_counter()
                    first = first or last
                    view.add(answer, thought)
                reply.stats.finish_reason = chunk.finish_reason or reply.stats.finish_reason
                usage = chunk.usage or usage
            view.add(*splitter.flush())
        except KeyboardInterrupt:
            reply.interrupted = True
    reply.content, reply.reasoning = view.content, view.reasoning
    stats = reply.stats
    stats.prompt_tokens = usage.get("prompt_tokens", 0)
    stats.completion_tokens = usage.get("completion_tokens", 0)
    stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if first is not None:
        stats.ttft_s = first - started
        if last is not None and last > first and stats.completion_tokens > 1:
            stats.tokens_per_s = (stats.completion_tokens - 1) / (last - first)
    return reply
