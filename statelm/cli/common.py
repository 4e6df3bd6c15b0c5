"""What every client command shares: the server options, the connection, error reporting and JSON output."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console

from statelm.cli.client import ClientError, StatelmClient
from statelm.cli.server_record import recorded_url

DEFAULT_URL = "http://127.0.0.1:8000"

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="STATELM_URL",
        show_default=False,
        help=f"Server URL (default: the server that `statelm server start` runs, else {DEFAULT_URL}).",
    ),
]
ApiKeyOption = Annotated[
    str | None, typer.Option("--api-key", envvar="STATELM_API_KEY", show_default=False, help="API key for the server.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

PIPE_WIDTH = 160  # tables written to a pipe or file are not squeezed into 80 columns

console = Console(highlight=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)

P = ParamSpec("P")
R = TypeVar("R")


def connect(url: str | None, api_key: str | None) -> StatelmClient:
    """A client for the server chosen by --url / STATELM_URL, the started server, or the default URL."""
    return StatelmClient(url or recorded_url() or DEFAULT_URL, api_key)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `statelm: error: message` on stderr; raise the returned Exit."""
    typer.echo(f"statelm: error: {message}", err=True)
    return typer.Exit(code)


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn a ClientError raised by a command into one line on stderr and exit code 1."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except ClientError as exc:
            raise fail(str(exc)) from None

    return run


def print_json(data: Any) -> None:
    """Print data as indented JSON on stdout."""
    typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
