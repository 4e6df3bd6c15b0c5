"""`statelm chat`: a REPL on a server-side session, or one answer with `-p`."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from statelm.cli.client import ClientError, StatelmClient
from statelm.cli.common import ApiKeyOption, UrlOption, connect, console, fail, reports_errors
from statelm.cli.render import details, history, sessions_table, snapshots_table
from statelm.cli.repl import Command, Repl, UsageError
from statelm.cli.turns import Reply, print_reasoning, run_turn, set_fields
from statelm.paths import default_state_dir

SAMPLING_FIELDS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "seed": int, "max_tokens": int, "stop": str,
}  # fmt: skip


def parse_setting(name: str, value: str) -> Any:
    """A sampling field's value from text; `off` unsets it."""
    if name not in SAMPLING_FIELDS:
        raise UsageError(f"unknown setting {name!r}; settings: {', '.join(SAMPLING_FIELDS)}")
    if value in ("off", "none", "default"):
        return None
    try:
        return SAMPLING_FIELDS[name](value)
    except ValueError:
        raise UsageError(f"{name} takes a {SAMPLING_FIELDS[name].__name__}, not {value!r}") from None


def int_arg(text: str) -> int:
    """A non-negative integer argument of a slash command."""
    if not text.isdigit():
        raise UsageError(f"expected a number, got {text!r}")
    return int(text)


def with_fresh_id(create: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Create a session under a short new id such as `chat-3f2a1b` (easy to type in `--session`), retrying clashes."""
    for _ in range(3):
        try:
            return create(f"chat-{secrets.token_hex(3)}")
        except ClientError as exc:
            if exc.status != 409:
                raise
    return create(f"chat-{secrets.token_hex(8)}")


class ChatRepl:
    """The state of a chat REPL: the current session, sampling settings and the last turn."""

    def __init__(self, client: StatelmClient, session_id: str, settings: dict[str, Any], out: Console) -> None:
        self.client = client
        self.session_id = session_id
        self.settings = settings
        self.console = out
        self.last: Reply | None = None
        self.pending_system: str | None = None

    def commands(self) -> list[Command]:
        """The chat REPL's slash commands."""
        return [
            Command("new", "", "start a new session and switch to it", self.new),
            Command("sessions", "", "list the server's sessions", self.list_sessions),
            Command("switch", "ID", "continue another session", self.switch),
            Command("history", "[N]", "show the transcript (its last N messages)", self.show_history),
            Command("rollback", "N", "keep only the first N messages (numbers as in /history)", self.rollback),
            Command("undo", "", "drop the last turn", self.undo),
            Command("fork", "", "copy this session (sharing its cache) and switch to the copy", self.fork),
            Command("save", "[TITLE]", "snapshot this session to disk", self.save),
            Command("load", "SNAPSHOT", "load a snapshot as a new session and switch to it", self.load),
            Command("snapshots", "", "list snapshots", self.list_snapshots),
            Command("system", "TEXT", "set the system prompt", self.system),
            Command("set", "[FIELD VALUE]", f"set sampling ({', '.join(SAMPLING_FIELDS)}; `off` unsets)", self.set),
            Command("stats", "", "tokens cached, last TTFT and tok/s", self.stats),
            Command(
                "reasoning",
                "",
                "show the last reply's reasoning in full",
                lambda _: print_reasoning(self.console, self.last),
            ),
        ]

    def prompt(self) -> str:
        """The prompt shows the current session."""
        return self.session_id

    # -- messages -------------------------------------------------------------------------------------------

    def turn(self, text: str) -> Reply:
        """Send a user message as the next turn of the session."""
        messages = [{"role": "user", "content": text}]
        if self.pending_system is not None:
            messages.insert(0, {"role": "system", "content": self.pending_system})
        reply = run_turn(
            self.client,
            {"messages": messages, "session_id": self.session_id, **set_fields(self.settings)},
            self.console,
        )
        if not reply.interrupted:
            self.pending_system = None
            self.last = reply
        return reply

    def send(self, text: str) -> bool:
        """The REPL's message handler: a turn and its stats line; True if Ctrl-C interrupted it."""
        reply = self.turn(text)
        if reply.interrupted:
            self.console.print("[dim](interrupted: the turn was discarded, the session is as it was)[/dim]")
        else:
            self.console.print(Text(reply.stats.line(), style="dim"))
        return reply.interrupted

    # -- commands -------------------------------------------------------------------------------------------

    def new(self, _: str) -> None:
        """Start a new session."""
        self._use(with_fresh_id(lambda sid: self.client.create_session(sid))["id"], "new session")

    def list_sessions(self, _: str) -> None:
        """List sessions."""
        self.console.print(sessions_table(self.client.sessions(), current=self.session_id))

    def switch(self, session_id: str) -> None:
        """Switch to another session."""
        if not session_id:
            raise UsageError("which session?")
        self._use(self.client.session(session_id)["id"], "switched to")

    def show_history(self, arg: str) -> None:
        """Show the transcript."""
        last = int_arg(arg) if arg else None
        self.console.print(history(self.client.history(self.session_id), last=last))

    def rollback(self, arg: str) -> None:
        """Keep the first N messages."""
        session = self.client.rollback(self.session_id, int_arg(arg))
        self.console.print(f"rolled back; messages kept: {session['num_messages']}")

    def undo(self, _: str) -> None:
        """Drop the last user message and what followed it."""
        messages = self.client.history(self.session_id)
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise UsageError("nothing to undo")
        self.rollback(str(users[-1]))

    def fork(self, _: str) -> None:
        """Fork the session and switch to the fork."""
        parent = self.session_id
        self._use(with_fresh_id(lambda sid: self.client.fork(parent, sid))["id"], f"forked {parent} into")

    def save(self, title: str) -> None:
        """Snapshot the session."""
        snap = self.client.save_snapshot(self.session_id, title=title or None)
        self.console.print(f"saved snapshot [bold]{snap['id']}[/bold] ({snap['num_tokens']} tokens)", highlight=False)

    def load(self, snapshot_id: str) -> None:
        """Load a snapshot into a new session."""
        if not snapshot_id:
            raise UsageError("which snapshot? (/snapshots lists them)")
        session = with_fresh_id(lambda sid: self.client.load_snapshot(snapshot_id, sid))
        self._use(session["id"], f"loaded {snapshot_id} into")

    def list_snapshots(self, _: str) -> None:
        """List snapshots."""
        self.console.print(snapshots_table(self.client.snapshots()))

    def system(self, text: str) -> None:
        """Set the system prompt: at once on a session without turns, else as a system message with the next one."""
        if not text:
            raise UsageError("what system prompt?")
        if all(m.get("role") == "system" for m in self.client.history(self.session_id)):
            self.client.delete_session(self.session_id)
            self.client.create_session(self.session_id, system=text)
            self.console.print("system prompt set")
        else:
            self.pending_system = text
            self.console.print("the system message goes into the transcript with your next message")

    def set(self, arg: str) -> None:
        """Set or show sampling settings."""
        if not arg:
            shown = {name: self.settings.get(name) for name in SAMPLING_FIELDS}
            self.console.print(details({k: "off" if v is None else v for k, v in shown.items()}))
            return
        name, _, value = arg.partition(" ")
        if not value.strip():
            raise UsageError(f"{name} to what?")
        self.settings[name] = parse_setting(name, value.strip())
        self.console.print(Text(f"{name} = {'off' if self.settings[name] is None else self.settings[name]}"))

    def stats(self, _: str) -> None:
        """Show the session's cache and the last turn's speed."""
        session = self.client.session(self.session_id)
        self.console.print(
            f"session {session['id']} · {session['state']} · {session['num_tokens']} tokens cached · "
            f"{session['num_messages']} messages",
            highlight=False,
        )
        self.console.print(f"last turn: {self.last.stats.line()}" if self.last else "no turn yet", highlight=False)

    def _use(self, session_id: str, what: str) -> None:
        self.session_id = session_id
        self.pending_system = None
        self.last = None
        self.console.print(f"{what} [bold]{session_id}[/bold]", highlight=False)


def read_prompt(prompt: str | None) -> str | None:
    """The one-shot prompt: `-p` text, with piped stdin appended (or stdin alone); None for the REPL."""
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read().strip()
    if prompt is None and not piped:
        return None
    return "\n\n".join(part for part in (prompt, piped) if part)


@reports_errors
def chat(
    prompt: Annotated[
        str | None, typer.Option("-p", "--prompt", help="Answer this once and exit (piped stdin is appended).")
    ] = None,
    session: Annotated[str | None, typer.Option("--session", "-s", help="Resume this session.")] = None,
    load: Annotated[str | None, typer.Option("--load", help="Start from this snapshot (as a new session).")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt of a new session.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Longest reply, in tokens.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Chat with the model in a session that keeps its KV cache on the server between turns.

    Examples:

      statelm chat                                   # new session, interactive

      statelm chat --session chat-1a2b               # resume

      statelm chat -p "What is the capital of France?" --temperature 0

      git diff | statelm chat -p "Write a commit message for this diff"
    """
    if session and load:
        raise fail("--session and --load both choose the session; give one")
    if system and (session or load):
        raise fail("--system sets up a new session; in the chat, /system changes the system prompt")
    client = connect(url, api_key)
    settings: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed}
    text = read_prompt(prompt)
    if text is not None and not session and not load:
        messages = [{"role": "system", "content": system}] if system else []
        reply = run_turn(
            client, {"messages": [*messages, {"role": "user", "content": text}], **set_fields(settings)}, console
        )
        raise typer.Exit(130 if reply.interrupted else 0)
    if load:
        session_info = with_fresh_id(lambda sid: client.load_snapshot(load, sid))
        how = f"loaded from snapshot {load}"
    elif session:
        session_info, how = client.session(session), "resumed"
    else:
        session_info, how = with_fresh_id(lambda sid: client.create_session(sid, system=system)), "new"
    repl = ChatRepl(client, session_info["id"], settings, console)
    if text is not None:
        raise typer.Exit(130 if repl.turn(text).interrupted else 0)
    console.print(
        f"[bold]statelm chat[/bold] · {client.model()['id']} at {client.url} · session [bold]{repl.session_id}[/bold] "
        f"({how}, {session_info['num_messages']} messages)\n[dim]/help for commands · Ctrl-D to quit[/dim]",
        highlight=False,
        soft_wrap=True,
    )
    Repl(console, default_state_dir() / "chat_history", repl.commands(), repl.prompt, repl.send).run()
