"""`statelm cache ls|rm`: the model cache on this machine (converted models every local server shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from statelm.cli.common import JsonOption, console, fail, print_json
from statelm.cli.render import ago, size

if TYPE_CHECKING:
    from statelm.models.model_cache import CacheEntry, ModelCache

cache_app = typer.Typer(
    no_args_is_help=True,
    help="The model cache: converted models, kept on disk so a start skips the conversion"
    " ($STATELM_CACHE_DIR/models, else the user cache dir).\n\nExample: statelm cache ls",
)
KEY_SHOWN = 12  # characters of a key a table shows; rm takes any unique prefix


def model_cache() -> ModelCache:
    """The cache servers of this user share (its cap is a server option and does not matter here)."""
    from statelm.models.model_cache import ModelCache

    return ModelCache(max_bytes=None)


@cache_app.command("ls")
def cache_ls(as_json: JsonOption = False) -> None:
    """List the cache's entries, most recently used first, and their total size.

    Example: statelm cache ls
    """
    cache = model_cache()
    entries = cache.entries()
    if as_json:
        print_json([{**vars(entry), "path": str(entry.path)} for entry in entries])
        return
    if entries:
        console.print(entries_table(entries))
    total = sum(entry.size for entry in entries)
    console.print(f"{count(len(entries))}, {size(total)} in {cache.root}", highlight=False)


@cache_app.command("rm")
def cache_rm(
    keys: Annotated[list[str] | None, typer.Argument(help="Keys (or unique prefixes) of entries to remove.")] = None,
    remove_all: Annotated[bool, typer.Option("--all", help="Remove every entry.")] = False,
) -> None:
    """Remove entries (a server using one keeps reading it; the next start converts its model again).

    Example: statelm cache rm 3f9a1c   or   statelm cache rm --all
    """
    cache = model_cache()
    if remove_all == bool(keys):
        raise fail("name the entries to remove (statelm cache ls shows their keys), or pass --all")
    if remove_all:
        console.print(f"removed {count(cache.clear())} from {cache.root}", highlight=False)
        return
    known = [entry.key for entry in cache.entries()]
    chosen = []
    for prefix in keys or []:
        matches = [key for key in known if key.startswith(prefix)]
        if len(matches) != 1:
            raise fail(f"{prefix!r} names {'no' if not matches else len(matches)} cache entries")
        chosen.append(matches[0])
    for key in chosen:
        cache.remove(key)
        console.print(f"removed {key}", highlight=False)


def count(entries: int) -> str:
    """`1 entry`, `3 entries`."""
    return f"{entries} {'entry' if entries == 1 else 'entries'}"


def entries_table(entries: list[CacheEntry]) -> Table:
    """The entries as a table: key, size, last use, variant and source file."""
    table = Table(box=None, header_style="bold")
    for column in ("KEY", "SIZE", "USED", "VARIANT", "SOURCE"):
        table.add_column(column, no_wrap=column != "SOURCE")
    for entry in entries:
        table.add_row(entry.key[:KEY_SHOWN], size(entry.size), ago(entry.last_used), entry.variant, entry.source)
    return table
