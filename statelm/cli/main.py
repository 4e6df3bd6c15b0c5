"""The `statelm` command line."""

from __future__ import annotations

import gc
from typing import Any

import typer

from statelm.cli.cache import cache_app
from statelm.cli.chat_repl import chat
from statelm.cli.docs import docs
from statelm.cli.server_control import server_app
from statelm.cli.sessions import session_app, snapshot_app
from statelm.cli.settings import config_from, configs, with_setting_options
from statelm.config import ClusterConfig, EngineConfig, ServerConfig

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="statelm: a stateful LLM inference server.\n\nExample: statelm server start && statelm chat",
)


@app.callback()
def main() -> None:
    """Serve a model with stateful sessions behind an OpenAI-compatible API."""


app.command()(chat)
app.command()(docs)
app.add_typer(server_app, name="server")
app.add_typer(session_app, name="session")
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(cache_app, name="cache")


@app.command()
@with_setting_options
def serve(ctx: typer.Context, **settings: Any) -> None:
    """Start the OpenAI-compatible server.

    Example: statelm serve --model default --port 8000
    """
    engine_config, server_config = configs(settings, ctx)
    gc.disable()  # the server's imports (torch) make a million objects it keeps: collecting as they come took 0.35 s
    try:
        from statelm.server.launch import LaunchError, run_server
    finally:
        gc.enable()

    cluster_config = config_from(ClusterConfig, settings, ctx)
    try:
        if cluster_config.replicas:
            run_cluster(engine_config, server_config, cluster_config)
        else:
            run_server(engine_config, server_config)
    except LaunchError as exc:
        typer.echo(f"statelm: error: {exc}", err=True)
        raise typer.Exit(2) from None


def run_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster_config: ClusterConfig) -> None:
    """Serve replicas on Ray Serve (imported only here), or say how to install it."""
    try:
        from statelm.cluster.launch import run_cluster as run
    except ImportError as exc:
        typer.echo(f"statelm: error: --replicas needs Ray Serve: pip install 'statelm[cluster]' ({exc})", err=True)
        raise typer.Exit(2) from None
    run(engine_config, server_config, cluster_config)
