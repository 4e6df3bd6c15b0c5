"""How sessions, snapshots, transcripts and streamed replies look in a terminal."""

from __future__ import annotations

import sys
import termios
import time
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from statelm.config import format_size

ROLE_STYLES = {"user": "bold cyan", "assistant": "bold green", "system": "bold magenta", "developer": "bold magenta"}


def ago(timestamp: float | None) -> str:
    """A Unix time as `5s ago`, `3m ago`, `2h ago` or `4d ago`."""
    if not timestamp:
        return "-"
    return f"{duration(max(0.0, time.time() - timestamp))} ago"


def duration(seconds: float) -> str:
    """Seconds as `42s`, `3m 5s`, `2h 10m` or `4d 3h`."""
    seconds = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            return f"{seconds // size}{unit} {seconds % size // sub_size}{sub}"
    return f"{seconds}s"


def size(num_bytes: int | None) -> str:
    """Bytes as `512 B`, `11.2 MiB`…"""
    return "-" if num_bytes is None else format_size(num_bytes)


def clip(text: str | None, width: int) -> str:
    """One line of at most width characters."""
    line = " ".join((text or "").split())
    return line if len(line) <= width else line[: width - 1] + "…"


NUMERIC_COLUMNS = frozenset({"#", "TOKENS", "MESSAGES", "SIZE"})
NAME_COLUMNS = frozenset({"ID", "SESSION", "SOURCE", "FILE"})


def listing(*columns: str) -> Table:
    """An empty borderless table with these column headers; numbers align right, ids are never cut."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:
        name = column in NAME_COLUMNS
        table.add_column(column, justify="right" if column in NUMERIC_COLUMNS else "left", no_wrap=name)
    return table


def add_row(table: Table, *cells: str) -> None:
    """Add a row of plain text: brackets in titles or file names are not read as rich markup."""
    table.add_row(*(Text(cell) for cell in cells))


def sessions_table(sessions: list[dict[str, Any]], current: str | None = None) -> Table:
    """A table of sessions; the current one is marked."""
    table = listing("ID", "STATE", "TOKENS", "MESSAGES", "LAST USED", "SYSTEM")
    for s in sorted(sessions, key=lambda s: s.get("last_used") or 0, reverse=True):
        mark = "* " if s["id"] == current else ""
        add_row(
            table, mark + s["id"], s.get("state", "-"), str(s.get("num_tokens", "-")), str(s.get("num_messages", "-")),
            ago(s.get("last_used")), clip(s.get("system"), 40),
        )  # fmt: skip
    return table


def snapshots_table(snapshots: list[dict[str, Any]]) -> Table:
    """A table of snapshots, newest first."""
    table = listing("ID", "TITLE", "SESSION", "TOKENS", "SIZE", "CREATED", "TAGS")
    for s in sorted(snapshots, key=lambda s: s.get("created") or 0, reverse=True):
        add_row(
            table, s["id"], clip(s.get("title"), 30), s.get("session_id") or "-", str(s.get("num_tokens", "-")),
            size(s.get("size_bytes")), ago(s.get("created")), ", ".join(s.get("tags") or []),
        )  # fmt: skip
    return table


def details(obj: dict[str, Any]) -> Table:
    """A two-column table of an object's fields."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in obj.items():
        if key in ("created", "last_used") and isinstance(value, int | float):
            value = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(value))} ({ago(value)})"
        elif key in ("size_bytes", "kv_bytes"):
            value = size(value)
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        add_row(table, key, "-" if value is None or value == "" else str(value))
    return table


def history(messages: list[dict[str, Any]], last: int | None = None, width: int | None = 300) -> Group:
    """Numbered messages of a transcript (the last `last` of them), each clipped to width characters."""
    first = 0 if last is None else max(0, len(messages) - last)
    lines = []
    for number, message in enumerate(messages[first:], start=first + 1):
        role = message.get("role", "?")
        content = _text(message.get("content"))
        body = content if width is None or len(content) <= width else content[: width - 1] + "…"
        line = Text.assemble((f"{number:>3} ", "dim"), (f"{role}: ", ROLE_STYLES.get(role, "bold")), body)
        lines.append(line)
    return Group(*lines) if lines else Group(Text("(no messages)", style="dim"))


def _text(content: Any) -> str:
    """A message's content as text, whether a string or a list of text parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


class _Tail:
    """Renders only the last lines of a renderable that fit the screen, so a long reply scrolls while it streams."""

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options.update(height=None), pad=False)
        for line in lines[-max(1, console.size.height - 2) :]:
            yield from line
            yield Segment.line()


class ReplyView:
    """Shows a reply while it streams: reasoning dimmed, the answer as Markdown (plain text when not a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.content = ""
        self.reasoning = ""
        self._live: Live | None = None
        self._tty_mode: list[Any] | None = None

    def __enter__(self) -> ReplyView:
        if self.console.is_terminal:
            self._quiet_keyboard()
            self._live = Live(console=self.console, refresh_per_second=8, transient=True)
            self._live.__enter__()
        return self

    def _quiet_keyboard(self) -> None:
        """While the reply streams, keys are not echoed and Ctrl-C does not flush the output queue (NOFLSH).

        Without this, the `^C` echo and the flushed escape codes leave a stale copy of the reply on the screen.
        """
        if not sys.stdin.isatty():
            return
        fd = sys.stdin.fileno()
        self._tty_mode = termios.tcgetattr(fd)
        mode = list(self._tty_mode)
        mode[3] = (mode[3] & ~(termios.ECHO | termios.ECHOCTL)) | termios.NOFLSH
        termios.tcsetattr(fd, termios.TCSANOW, mode)

    def add(self, content: str, reasoning: str) -> None:
        """Show the next pieces of the reply."""
        self.content += content
        self.reasoning += reasoning
        if self._live is not None:
            parts = [Text(self.reasoning.strip(), style="dim italic")] if self.reasoning.strip() else []
            self._live.update(_Tail(Group(*parts, Markdown(self.content))))
        elif content:
            self.console.file.write(content)
            self.console.file.flush()

    def __exit__(self, *exc: object) -> None:
        if self._live is None:
            if self.content and not self.content.endswith("\n"):
                self.console.file.write("\n")
            return
        self._live.__exit__(None, None, None)
        if self._tty_mode is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSANOW, self._tty_mode)
        if self.reasoning.strip():
            words = len(self.reasoning.split())
            self.console.print(Text(f"▸ reasoning, {words} words (/reasoning shows it)", style="dim italic"))
        if self.content.strip():
            self.console.print(Markdown(self.content))
