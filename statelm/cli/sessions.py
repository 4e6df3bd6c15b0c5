"""`statelm session …` and `statelm snapshot …`: manage what the server keeps, from the shell."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.table import Table

from statelm.cli.common import ApiKeyOption, JsonOption, UrlOption, connect, console, print_json, reports_errors
from statelm.cli.render import details, history, sessions_table, snapshots_table

session_app = typer.Typer(
    no_args_is_help=True,
    help="Sessions: conversations whose KV cache stays on the server.\n\nExample: statelm session ls",
)
snapshot_app = typer.Typer(
    no_args_is_help=True,
    help="Snapshots: sessions saved to the server's disk.\n\nExample: statelm snapshot save chat-1a2b --title 'draft'",
)

SessionArg = Annotated[str, typer.Argument(help="Session id.", show_default=False)]
SnapshotArg = Annotated[str, typer.Argument(help="Snapshot id.", show_default=False)]
TagOption = Annotated[list[str] | None, typer.Option("--tag", help="A tag (repeat for several).")]


def show_listing(rows: list[dict[str, Any]], as_json: bool, table: Callable[[list], Table], empty: str) -> None:
    """Print rows as JSON, as a table, or say that there are none."""
    if as_json:
        print_json(rows)
    elif rows:
        console.print(table(rows))
    else:
        console.print(empty)


def show_item(item: dict[str, Any], as_json: bool) -> None:
    """Print one session or snapshot as JSON or as a details panel."""
    if as_json:
        print_json(item)
    else:
        console.print(details(item))


def emit(obj: dict[str, Any], as_json: bool, message: str) -> None:
    """Print the API object as JSON, or a one-line message."""
    if as_json:
        print_json(obj)
    else:
        console.print(message, highlight=False)


# -- sessions -------------------------------------------------------------------------------------------------


@session_app.command("new")
@reports_errors
def session_new(
    session_id: Annotated[
        str | None, typer.Argument(help="Id of the new session (default: chosen by the server).")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create a session.

    Example: statelm session new work --system "You are terse."
    """
    session = connect(url, api_key).create_session(session_id, system=system)
    emit(session, as_json, f"created session [bold]{session['id']}[/bold]")


@session_app.command("ls")
@reports_errors
def session_ls(as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List sessions, most recently used first.

    Example: statelm session ls --json
    """
    sessions = connect(url, api_key).sessions()
    show_listing(sessions, as_json, sessions_table, "no sessions; start one with `statelm chat`")


@session_app.command("show")
@reports_errors
def session_show(
    session_id: SessionArg, as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None
) -> None:
    """Show a session.

    Example: statelm session show chat-1a2b
    """
    show_item(connect(url, api_key).session(session_id), as_json)


@session_app.command("rm")
@reports_errors
def session_rm(
    session_ids: Annotated[list[str], typer.Argument(help="Session ids.", show_default=False)],
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Delete sessions (their snapshots stay).

    Example: statelm session rm chat-1a2b chat-3c4d
    """
    client = connect(url, api_key)
    for session_id in session_ids:
        client.delete_session(session_id)
        console.print(f"deleted session {session_id}", highlight=False)


@session_app.command("history")
@reports_errors
def session_history(
    session_id: SessionArg,
    last: Annotated[int | None, typer.Option("--last", "-n", help="Only the last N messages.")] = None,
    full: Annotated[bool, typer.Option(help="Show long messages in full.")] = False,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Show a session's transcript, messages numbered from 1.

    Example: statelm session history chat-1a2b -n 4
    """
    messages = connect(url, api_key).history(session_id)
    if as_json:
        print_json(messages[-last:] if last else messages)
    else:
        console.print(history(messages, last=last, width=None if full else 300))


@session_app.command("rollback")
@reports_errors
def session_rollback(
    session_id: SessionArg,
    keep: Annotated[int, typer.Argument(min=0, help="Messages to keep (numbers as in `history`).", show_default=False)],
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Cut a session back to its first KEEP messages; the cache keeps the matching prefix.

    Example: statelm session rollback chat-1a2b 2
    """
    session = connect(url, api_key).rollback(session_id, keep)
    emit(session, as_json, f"{session['id']}: {session['num_messages']} messages, {session['num_tokens']} tokens")


@session_app.command("fork")
@reports_errors
def session_fork(
    session_id: SessionArg,
    new_id: Annotated[str | None, typer.Argument(help="Id of the copy (default: chosen by the server).")] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Copy a session; the copy shares the parent's cache until they differ.

    Example: statelm session fork chat-1a2b experiment
    """
    session = connect(url, api_key).fork(session_id, new_id)
    emit(session, as_json, f"forked {session_id} into [bold]{session['id']}[/bold]")


# -- snapshots ------------------------------------------------------------------------------------------------


@snapshot_app.command("save")
@reports_errors
def snapshot_save(
    session_id: SessionArg,
    title: Annotated[str | None, typer.Option(help="A title.")] = None,
    description: Annotated[str | None, typer.Option(help="A description.")] = None,
    tag: TagOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Save a session (KV cache and transcript) to the server's disk.

    Example: statelm snapshot save chat-1a2b --title "before refactor" --tag work
    """
    snap = connect(url, api_key).save_snapshot(session_id, title=title, description=description, tags=tag)
    emit(snap, as_json, f"saved snapshot [bold]{snap['id']}[/bold] ({snap['num_tokens']} tokens)")


@snapshot_app.command("ls")
@reports_errors
def snapshot_ls(
    tag: Annotated[str | None, typer.Option("--tag", help="Only snapshots with this tag.")] = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List snapshots, newest first.

    Example: statelm snapshot ls --tag work
    """
    snaps = [s for s in connect(url, api_key).snapshots() if tag is None or tag in (s.get("tags") or [])]
    show_listing(snaps, as_json, snapshots_table, "no snapshots; save one with `statelm snapshot save SESSION`")


@snapshot_app.command("show")
@reports_errors
def snapshot_show(
    snapshot_id: SnapshotArg, as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None
) -> None:
    """Show a snapshot.

    Example: statelm snapshot show snap-3f2a
    """
    show_item(connect(url, api_key).snapshot(snapshot_id), as_json)


@snapshot_app.command("load")
@reports_errors
def snapshot_load(
    snapshot_id: SnapshotArg,
    session_id: Annotated[str | None, typer.Option("--as", help="Id of the new session.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a session that has that id.")] = False,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Load a snapshot as a live session.

    Example: statelm snapshot load snap-3f2a --as work && statelm chat --session work
    """
    session = connect(url, api_key).load_snapshot(snapshot_id, session_id, overwrite)
    emit(
        session,
        as_json,
        f"loaded {snapshot_id} into session [bold]{session['id']}[/bold] ({session['num_tokens']} tokens); "
        f"continue with `statelm chat --session {session['id']}`",
    )


@snapshot_app.command("rm")
@reports_errors
def snapshot_rm(
    snapshot_ids: Annotated[list[str], typer.Argument(help="Snapshot ids.", show_default=False)],
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Delete snapshots from the server's disk.

    Example: statelm snapshot rm snap-3f2a
    """
    client = connect(url, api_key)
    for snapshot_id in snapshot_ids:
        client.delete_snapshot(snapshot_id)
        console.print(f"deleted snapshot {snapshot_id}", highlight=False)


@snapshot_app.command("edit")
@reports_errors
def snapshot_edit(
    snapshot_id: SnapshotArg,
    title: Annotated[str | None, typer.Option(help="New title ('' clears it).")] = None,
    description: Annotated[str | None, typer.Option(help="New description ('' clears it).")] = None,
    tag: TagOption = None,
    clear_tags: Annotated[bool, typer.Option("--clear-tags", help="Remove all tags.")] = False,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Change a snapshot's title, description or tags (--tag replaces the tags).

    Example: statelm snapshot edit snap-3f2a --title "final" --tag work --tag done
    """
    changes: dict[str, Any] = {
        k: v or None for k, v in (("title", title), ("description", description)) if v is not None
    }
    if tag or clear_tags:
        changes["tags"] = None if clear_tags else tag
    if not changes:
        raise typer.BadParameter("nothing to change: give --title, --description, --tag or --clear-tags")
    snap = connect(url, api_key).edit_snapshot(snapshot_id, changes)
    emit(snap, as_json, f"updated snapshot [bold]{snap['id']}[/bold]")
