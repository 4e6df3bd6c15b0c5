"""The interactive loop shared by `statelm chat` and `statelm docs`: line editing, history, slash commands, Ctrl-C."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.history import FileHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Console
from rich.table import Table
from rich.text import Text

from statelm.cli.client import ClientError
from statelm.cli.render import add_row


class UsageError(Exception):
    """A slash command was given arguments it cannot use; the message says how to call it."""


@dataclass
class Command:
    """A slash command: its name, argument synopsis, one-line help and handler (given the argument text)."""

    name: str
    args: str
    help: str
    run: Callable[[str], None]


class ExitRepl(Exception):
    """Raised by a command to leave the REPL."""


class _CommandCompleter(Completer):
    """Completes slash command names at the start of the line."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        text = document.text_before_cursor
        if text.startswith("/") and " " not in text:
            for name in self.names:
                if name.startswith(text[1:]):
                    yield Completion(f"/{name}", start_position=-len(text))


def _key_bindings() -> KeyBindings:
    """Alt-Enter (or Esc then Enter) inserts a newline; Enter sends."""
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return bindings


class Repl:
    """Reads lines until /exit, Ctrl-D or two Ctrl-C in a row; `/name args` runs a command, other text is a message.

    The message handler returns True when Ctrl-C interrupted it, which arms the second Ctrl-C.
    """

    def __init__(
        self,
        console: Console,
        history_file: Path,
        commands: list[Command],
        prompt: Callable[[], str],
        on_message: Callable[[str], bool],
    ) -> None:
        self.console = console
        self.prompt = prompt
        self.on_message = on_message
        builtins = [
            Command("help", "", "show this help", lambda _: self.console.print(self.help_table())),
            Command("exit", "", "leave (also Ctrl-D, or Ctrl-C twice)", self._exit),
        ]
        self.commands = {c.name: c for c in [*commands, *builtins]}
        self.commands.setdefault("quit", self.commands["exit"])
        history_file.parent.mkdir(parents=True, exist_ok=True)
        self.session: PromptSession[str] = PromptSession(
            history=FileHistory(str(history_file)),
            completer=_CommandCompleter(sorted(self.commands)),
            complete_while_typing=True,
            key_bindings=_key_bindings(),
        )

    @staticmethod
    def _exit(_: str) -> None:
        raise ExitRepl

    def help_table(self) -> Table:
        """The slash commands with their arguments and help."""
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for name, command in self.commands.items():
            if name == command.name:
                add_row(table, f"/{command.name} {command.args}".rstrip(), command.help)
        add_row(table, "Alt-Enter", "new line in a message; Ctrl-C stops a reply, twice in a row exits")
        return table

    def run(self) -> None:
        """The loop."""
        armed = False  # the last thing that happened was a Ctrl-C
        while True:
            try:
                line = self.session.prompt(FormattedText([("ansibrightblack", self.prompt()), ("", " › ")]))
                armed = self._dispatch(line.strip())
                continue
            except KeyboardInterrupt:  # at the prompt, or in the moment between a command and the next prompt
                if armed:
                    return
            except (EOFError, ExitRepl):
                return
            armed = True
            try:
                self.console.print("[dim](Ctrl-C again, Ctrl-D or /exit to quit)[/dim]")
            except KeyboardInterrupt:
                return

    def _dispatch(self, line: str) -> bool:
        """Run a command or send a message; True if Ctrl-C interrupted it."""
        if not line:
            return False
        if not line.startswith("/"):
            return self._guarded(lambda: self.on_message(line))
        name, _, args = line[1:].partition(" ")
        command = self.commands.get(name)
        if command is None:
            self.console.print(Text.assemble((f"unknown command /{name}", "red"), "; /help lists them"))
            return False
        return self._guarded(lambda: command.run(args.strip()), command)

    def _guarded(self, action: Callable[[], bool | None], command: Command | None = None) -> bool:
        """Run an action, printing API and usage errors instead of leaving the REPL."""
        try:
            return bool(action())
        except ClientError as exc:
            self.console.print(Text.assemble(("error: ", "red"), str(exc)))
        except UsageError as exc:
            usage = f" (usage: /{command.name} {command.args})" if command else ""
            self.console.print(Text.assemble((str(exc), "red"), usage))
        return False
