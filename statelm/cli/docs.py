"""`statelm docs NAME`: questions about documents held in a session's context, with excerpts beyond it found by
BM25, or by BM25 and embeddings together when the server serves an embedding model."""

from __future__ import annotations

import functools
import math
import shlex
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.text import Text

from statelm.cli.client import ClientError, Embeddings, StatelmClient
from statelm.cli.common import ApiKeyOption, UrlOption, connect, console, fail, reports_errors
from statelm.cli.extract import ExtractError, display_name, expand, extract_text
from statelm.cli.render import add_row, ago, details, listing
from statelm.cli.repl import Command, Repl, UsageError
from statelm.cli.retrieval import EmbeddingFailed, HybridIndex, PassageIndex, PassageVectors
from statelm.cli.turns import Reply, print_reasoning, run_turn, set_fields
from statelm.cli.workspace import Workspace
from statelm.paths import default_state_dir

SYSTEM_PROMPT = (
    "You answer questions about the documents the user shares with you. Base each answer on those documents, "
    "quote them where it helps and name the document you used. If they do not say, answer that they do not."
)
ANSWER_RESERVE = 1024  # context kept free for a question and its answer
ANSWER_MAX_TOKENS = 512
ESTIMATE_MARGIN = 1.15
MAX_EXCERPTS = 8  # token estimates from characters are padded by this much


def document_message(source: str, text: str) -> str:
    """The user message that puts a document into the context."""
    return f"Document: {source}\n\n{text}"


def excerpts_message(question: str, excerpts: list[tuple[str, str]]) -> str:
    """A question preceded by excerpts of documents that are not in the context."""
    quoted = "\n\n".join(f"[{source}]\n{text}" for source, text in excerpts)
    return f"Excerpts from the documents:\n\n{quoted}\n\nQuestion: {question}"


class DocsSession:
    """A workspace bound to its server session: ingest, ask, save, reset."""

    def __init__(self, client: StatelmClient, workspace: Workspace, settings: dict[str, Any], out: Console) -> None:
        self.client = client
        self.ws = workspace
        self.settings = settings
        self.console = out
        self.capacity = int(client.model()["max_model_len"])
        self.last: Reply | None = None
        self._index: PassageIndex | None = None

    @property
    def budget(self) -> int:
        """Tokens the documents may fill, leaving room for a question and its answer."""
        return max(0, self.capacity - ANSWER_RESERVE)

    def index(self) -> PassageIndex:
        """The index over every document's passages, built on first use: hybrid when the server has an embedding
        model, BM25 alone otherwise."""
        if self._index is None:
            model = self.embedding_model
            if model is None:
                self._index = PassageIndex(self.ws.texts())
            else:
                vectors = PassageVectors(self.ws.vectors_file)
                self._index = HybridIndex(self.ws.texts(), functools.partial(self._embed, model), vectors)
        return self._index

    def _embed(self, model: str, texts: list[str]) -> Embeddings:
        """The server's embeddings of texts; a refusal is reported once and retrieval goes on with BM25 alone."""
        try:
            return self.client.embed(model, texts)
        except ClientError as exc:
            self.console.print(Text(f"embeddings failed ({exc}); retrieval goes on with BM25 alone", style="yellow"))
            raise EmbeddingFailed(str(exc)) from None

    @functools.cached_property
    def embedding_model(self) -> str | None:
        """The server's embedding model that retrieval uses with BM25, or None."""
        return self.client.embedding_model()

    def retrieval(self) -> str:
        """How excerpts are found, in words."""
        model, index = self.embedding_model, self._index
        if model is None or (isinstance(index, HybridIndex) and index.failure is not None):
            return "BM25"
        return f"BM25 + embeddings of {model}, fused by reciprocal rank"

    # -- the server session ---------------------------------------------------------------------------------

    def attach(self) -> str:
        """Make sure the session exists: resume it, restore the saved snapshot, or rebuild it from the kept texts."""
        sid = self.ws.session_id
        try:
            self.client.session(sid)
            return "resumed"
        except ClientError as exc:
            if exc.status != 404:
                raise
        if self.ws.snapshot_id:
            started = time.perf_counter()
            try:
                self.client.load_snapshot(self.ws.snapshot_id, sid)
                return f"restored from snapshot {self.ws.snapshot_id} in {time.perf_counter() - started:.2f}s"
            except ClientError as exc:
                if exc.status not in (404, 409, 422):
                    raise
                self.console.print(Text(f"snapshot {self.ws.snapshot_id} is unusable ({exc})", style="yellow"))
                self.ws.snapshot_id = None
        self.client.create_session(sid, system=SYSTEM_PROMPT)
        self.ws.docs_messages = self.client.session(sid)["num_messages"]
        resident = [d for d in self.ws.documents if d.resident]
        if resident:
            with self._progress() as progress:
                task = progress.add_task("", total=len(resident), tokens=0)
                for document in resident:
                    progress.update(task, description=document.source)
                    document.tokens = self._prefill(document.source, self.ws.text(document))
                    progress.update(task, advance=1, tokens=self.ws.resident_tokens())
            self.ws.docs_messages = self.client.session(sid)["num_messages"]
        self.ws.save()
        return f"rebuilt from {len(resident)} kept documents" if resident else "new"

    def _progress(self) -> Progress:
        """A progress bar over files with the running token count."""
        return Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", style="bold"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tokens]:,} tokens in context"),
            console=self.console,
            transient=True,
        )

    def _prefill(self, source: str, text: str) -> int:
        """Append a document to the session as one short turn; the tokens it added to the context."""
        body = {
            "session_id": self.ws.session_id,
            "messages": [{"role": "user", "content": document_message(source, text)}],
            "max_tokens": 1,
            "temperature": 0,
        }
        usage: dict[str, Any] = {}
        for chunk in self.client.stream_chat(body):
            usage = chunk.usage or usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage.get("prompt_tokens", 0) - cached + usage.get("completion_tokens", 0)

    def drop_questions(self) -> bool:
        """Roll the session back to just its documents; True if there were questions to drop."""
        if self.client.session(self.ws.session_id)["num_messages"] <= self.ws.docs_messages:
            return False
        self.client.rollback(self.ws.session_id, self.ws.docs_messages)
        return True

    # -- commands -------------------------------------------------------------------------------------------

    def add(self, arg: str) -> None:
        """The /add command: ingest files, globs and folders (quote names with spaces)."""
        try:
            specs = shlex.split(arg)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not specs:
            raise UsageError("add what? (paths, globs or folders)")
        self.add_paths(specs)

    def add_paths(self, specs: list[str]) -> None:
        """Ingest files, globs and folders into the context, or keep them for excerpts when they do not fit."""
        files, unmatched = expand(specs)
        for spec in unmatched:
            self.console.print(Text(f"nothing matches {spec}", style="yellow"))
        if not files:
            return
        if self.drop_questions():
            self.console.print("[dim](earlier questions dropped so that the documents stay together)[/dim]")
        used = self.ws.resident_tokens()
        known = {d.source for d in self.ws.documents}
        rows: list[tuple[str, str, str]] = []
        try:
            with self._progress() as progress:
                task = progress.add_task("", total=len(files), tokens=used)
                for path in files:
                    source = display_name(path)
                    progress.update(task, description=source)
                    rows.append((source, *self._add_one(path, source, known, used, progress)))
                    used = self.ws.resident_tokens()
                    progress.update(task, advance=1, tokens=used)
        except KeyboardInterrupt:
            self.console.print(f"[dim](stopped after {len(rows)} of {len(files)} files)[/dim]")
        finally:
            self.ws.docs_messages = self.client.session(self.ws.session_id)["num_messages"]
            self.ws.save()
            self._index = None
        self._print_added(rows, used)
        self.index_passages()

    def index_passages(self) -> None:
        """Embed the passages that have no kept vector yet, when the server has an embedding model."""
        if self.embedding_model is None:
            return
        index = self.index()
        if not isinstance(index, HybridIndex):
            return
        with self.console.status(f"embedding passages with {self.embedding_model}"):
            index.prepare()
        if index.embedded:
            self.console.print(
                f"[dim]({index.embedded} passages embedded with {self.embedding_model}, kept with the workspace)[/dim]"
            )

    def _add_one(self, path: Path, source: str, known: set[str], used: int, progress: Progress) -> tuple[str, str]:
        """Ingest one file into the context, or keep it for retrieval when it would overflow; (tokens, where)."""
        if source in known:
            return "-", "skipped: already added"
        try:
            text = extract_text(path)
        except ExtractError as exc:
            return "-", f"skipped: {exc}"
        known.add(source)
        estimate = math.ceil(len(text) / self.ws.chars_per_token() * ESTIMATE_MARGIN)
        if used + estimate > self.budget:
            progress.console.print(
                Text(
                    f"⚠ {source} (~{estimate:,} tokens) would overflow the context ({used:,} of {self.budget:,} "
                    "tokens used); it is kept for excerpt retrieval instead",
                    style="yellow",
                )
            )
            self.ws.add(source, text, resident=False, tokens=None)
            return f"~{estimate:,}", "excerpts"
        tokens = self._prefill(source, text)
        self.ws.add(source, text, resident=True, tokens=tokens)
        self.ws.save()
        return f"{tokens:,}", "context"

    def _print_added(self, rows: list[tuple[str, str, str]], used: int) -> None:
        """A table of what /add did and the context's fill."""
        table = listing("FILE", "TOKENS", "WHERE")
        for row in rows:
            add_row(table, *row)
        self.console.print(table)
        self.console.print(
            f"context: {used:,} of {self.capacity:,} tokens · /save keeps this state for next time", highlight=False
        )

    def ask(self, question: str) -> bool:
        """Answer a question from the context (plus excerpts of documents outside it); True if interrupted."""
        if not self.ws.documents:
            self.console.print("[dim](no documents yet: /add PATHS; answering without them)[/dim]")
        if any(not d.resident for d in self.ws.documents):
            self.drop_questions()  # excerpts need the room: with them, every question starts from the documents
        excerpts = self._excerpts(question)
        if excerpts:
            self.console.print(f"[dim]({len(excerpts)} excerpts found by {self.retrieval()})[/dim]", highlight=False)
        content = excerpts_message(question, excerpts) if excerpts else question
        body = {
            "session_id": self.ws.session_id,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": ANSWER_MAX_TOKENS,
            **set_fields(self.settings),
        }
        try:
            reply = run_turn(self.client, body, self.console)
        except ClientError as exc:
            if exc.code != "context_length_exceeded" or not self.drop_questions():
                raise
            self.console.print("[dim](context full: earlier questions dropped)[/dim]")
            reply = run_turn(self.client, body, self.console)
        if reply.interrupted:
            self.console.print("[dim](interrupted: the question was discarded)[/dim]")
            return True
        self.last = reply
        cited = list(dict.fromkeys([s for s, _ in excerpts] + self.index().sources(f"{question} {reply.content}")))
        if cited:
            self.console.print(Text.assemble(("Sources: ", "bold"), ", ".join(cited[:3])))
        return False

    def _excerpts(self, question: str) -> list[tuple[str, str]]:
        """The best-matching passages of documents outside the context, as many as fit."""
        outside = {d.source for d in self.ws.documents if not d.resident}
        if not outside:
            return []
        room = (self.budget - self.ws.resident_tokens()) * self.ws.chars_per_token() / ESTIMATE_MARGIN
        chosen = []
        for passage, _ in self.index().search(question, k=MAX_EXCERPTS):
            if passage.source in outside and len(passage.text) <= room:
                chosen.append((passage.source, passage.text))
                room -= len(passage.text) + len(passage.source) + 4
        return chosen

    def save(self, _: str) -> None:
        """Snapshot the documents (without the questions) so that the next start is instant."""
        fork = self.client.fork(self.ws.session_id)["id"]
        try:
            self.client.rollback(fork, self.ws.docs_messages)
            snap = self.client.save_snapshot(fork, title=f"statelm docs {self.ws.name}", tags=["statelm-docs"])
        finally:
            self.client.delete_session(fork)
        old, self.ws.snapshot_id = self.ws.snapshot_id, snap["id"]
        self.ws.save()
        if old and old != snap["id"]:
            try:
                self.client.delete_snapshot(old)
            except ClientError as exc:
                if exc.status != 404:
                    raise
        self.console.print(
            f"saved snapshot [bold]{snap['id']}[/bold] ({len(self.ws.documents)} documents); "
            f"`statelm docs {self.ws.name}` starts from it",
            highlight=False,
        )

    def sources(self, _: str) -> None:
        """List the workspace's documents."""
        if not self.ws.documents:
            self.console.print("no documents yet: /add PATHS")
            return
        table = listing("#", "SOURCE", "TOKENS", "WHERE", "ADDED")
        for number, d in enumerate(self.ws.documents, start=1):
            tokens = f"{d.tokens:,}" if d.tokens else f"~{math.ceil(d.chars / self.ws.chars_per_token()):,}"
            add_row(table, str(number), d.source, tokens, "context" if d.resident else "excerpts", ago(d.added))
        self.console.print(table)

    def reset(self, arg: str) -> None:
        """Forget the questions; with `all`, the documents too."""
        if arg not in ("", "all"):
            raise UsageError(f"unknown argument {arg!r}")
        if arg == "all":
            self.client.delete_session(self.ws.session_id)
            if self.ws.snapshot_id:
                self.client.delete_snapshot(self.ws.snapshot_id)
            self.ws.clear()
            self._index = None
            self.attach()
            self.console.print("workspace emptied")
        else:
            self.drop_questions()
            self.console.print(f"back to the {len(self.ws.documents)} documents, no questions")

    def info(self, _: str) -> None:
        """Show the workspace and its session."""
        session = self.client.session(self.ws.session_id)
        outside = sum(1 for d in self.ws.documents if not d.resident)
        self.console.print(
            details(
                {
                    "workspace": self.ws.name,
                    "folder": str(self.ws.root),
                    "session": f"{session['id']} ({session['state']}, {session['num_messages']} messages)",
                    "model": f"{self.client.model()['id']} at {self.client.url}",
                    "context": f"{session['num_tokens']:,} of {self.capacity:,} tokens",
                    "documents": f"{len(self.ws.documents) - outside} in context, {outside} by excerpts",
                    "snapshot": self.ws.snapshot_id,
                    "retrieval": self.retrieval(),
                }
            )
        )

    def commands(self) -> list[Command]:
        """The docs REPL's slash commands."""
        return [
            Command("add", "PATHS|GLOBS|DIRS", "ingest text, Markdown, code and PDF files", self.add),
            Command("sources", "", "list the documents", self.sources),
            Command("save", "", "snapshot the documents so the next start is instant", self.save),
            Command("reset", "[all]", "forget the questions (all: the documents too)", self.reset),
            Command("info", "", "workspace, session and context use", self.info),
            Command(
                "reasoning", "", "show the last answer's reasoning", lambda _: print_reasoning(self.console, self.last)
            ),
        ]


@reports_errors
def docs(
    name: Annotated[str, typer.Argument(help="Workspace name; its documents are kept under the state dir.")],
    add: Annotated[list[str] | None, typer.Option("--add", help="Ingest these paths, globs or folders first.")] = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Answer this question once and exit.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Longest answer, in tokens.")] = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Ask questions about documents: they sit in a session's context, so each question costs only itself.

    Examples:

      statelm docs papers                  # then: /add ~/papers/*.pdf, ask, /save

      statelm docs notes --add notes/ -p "Where is the deploy checklist?"
    """
    try:
        workspace = Workspace.open(name)
    except ValueError as exc:
        raise fail(str(exc)) from None
    settings = {"temperature": temperature, "max_tokens": max_tokens}
    session = DocsSession(connect(url, api_key), workspace, settings, console)
    how = session.attach()
    session.index_passages()
    if add:
        session.add_paths(add)
    if prompt is not None:
        raise typer.Exit(130 if session.ask(prompt) else 0)
    outside = sum(1 for d in workspace.documents if not d.resident)
    console.print(
        f"[bold]statelm docs {name}[/bold] · {len(workspace.documents)} documents "
        f"({workspace.resident_tokens():,} tokens in context, {outside} by excerpts) · session "
        f"{workspace.session_id} ({how})\n[dim]/add PATHS to ingest · ask anything · /help for commands[/dim]",
        highlight=False,
        soft_wrap=True,
    )
    Repl(console, default_state_dir() / "docs_history", session.commands(), lambda: f"docs:{name}", session.ask).run()
