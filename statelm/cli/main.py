"""The `statelm` command line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from statelm.cli.chat_repl import chat
from statelm.cli.docs import docs
from statelm.cli.server_control import server_app
from statelm.cli.sessions import session_app, snapshot_app
from statelm.config import ClusterConfig, EngineConfig, ServerConfig, SessionDurability
from statelm.paths import default_state_dir

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="statelm: a stateful LLM inference server.\n\nExample: statelm server start && statelm chat",
)

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from a size such as `2GiB`, `512MB` or `1000000`."""
    match = _SIZE.match(text)
    if not match or (match.group(2) or "").upper() not in _UNITS:
        raise typer.BadParameter(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


_DURATION = re.compile(r"^\s*([0-9.]+)\s*([smhd]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from a duration such as `30d`, `12h`, `90m` or `3600`."""
    match = _DURATION.match(text)
    if not match:
        raise typer.BadParameter(f"not a duration: {text!r} (examples: 30d, 12h, 90m, 3600)")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def with_keys_from_environment(keys: list[str] | None, variable: str) -> list[str]:
    """The keys given as flags plus those in an environment variable (several may be separated by spaces)."""
    return [*(keys or []), *os.environ.get(variable, "").split()]


def parse_sampling_defaults(text: str) -> dict[str, Any]:
    """The --default-sampling JSON object, checked as request fields are."""
    from pydantic import ValidationError

    from statelm.api.protocol import SamplerSettings

    try:
        return SamplerSettings.model_validate_json(text).model_dump(exclude_none=True)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        raise typer.BadParameter(f"{problems} (fields: {', '.join(SamplerSettings.model_fields)})") from None


def session_durability(chosen: SessionDurability | None, persist_sessions: bool) -> SessionDurability:
    """--session-durability (default turn); --no-persist-sessions is `off`, and contradicts any other choice."""
    if persist_sessions:
        return chosen or SessionDurability.TURN
    if chosen not in (None, SessionDurability.OFF):
        raise typer.BadParameter(f"--no-persist-sessions means off; it contradicts --session-durability {chosen}")
    return SessionDurability.OFF


@app.callback()
def main() -> None:
    """Serve a model with stateful sessions behind an OpenAI-compatible API."""


app.command()(chat)
app.command()(docs)
app.add_typer(server_app, name="server")
app.add_typer(session_app, name="session")
app.add_typer(snapshot_app, name="snapshot")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Model dir, .gguf file, hub id (org/name), or `default`.")] = "default",
    host: Annotated[str, typer.Option(help="Interface to bind; loopback unless told otherwise.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    quantization: Annotated[
        str,
        typer.Option(
            help="auto (a GGUF's quantized weights stay packed) | none (dequantize) | int8 | int4 (quantize float "
            "weights at load)"
        ),
    ] = "auto",
    load_format: Annotated[str, typer.Option(help="auto | dummy (random weights, for benchmarks)")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(help="Context length cap (default: the model's).")] = None,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(help="KV cache budget, e.g. 2GiB (default: 2GiB on CPU, 80% of free GPU memory)."),
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV cache block.")] = 16,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences running at once.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one engine step.")] = 512,
    prefix_cache: Annotated[bool, typer.Option(help="Reuse cached KV blocks of shared prompt prefixes.")] = True,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for a slot; more get 429.")] = 256,
    batch_invariant: Annotated[
        bool, typer.Option(help="Same output for a request whatever else runs (fixed-size matmul chunks).")
    ] = True,
    compute_path: Annotated[
        str,
        typer.Option(
            help="auto (a start-up self-check picks the fastest batch-invariant one) | kernels | torch | torch-per-row."
        ),
    ] = "auto",
    activations: Annotated[
        str,
        typer.Option(
            help="Packed (quantized) matmuls: float32 (the float model's arithmetic) | int8 (activations quantized"
            " per 32 values, as llama.cpp computes: 2.5-3x faster on many rows, about 3% of next tokens differ) |"
            " int8-decode (int8 for generated tokens, float32 for prompt tokens and so for every first token)."
        ),
    ] = "int8-decode",
    kv_cache_dtype: Annotated[
        str,
        typer.Option(
            help="auto (the model's dtype) | float32 | bfloat16 | float16 (narrower caches: CPU kernels path only;"
            " half the bytes attention reads)."
        ),
    ] = "auto",
    enforce_eager: Annotated[
        bool, typer.Option(help="CUDA: run every step eagerly (no CUDA graphs of decode steps).")
    ] = False,
    served_model_name: Annotated[str | None, typer.Option(help="Name clients use in `model`.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for dummy weights.")] = 0,
    threads: Annotated[int | None, typer.Option(help="Torch CPU threads (default: all cores).")] = None,
    default_sampling: Annotated[
        str | None,
        typer.Option(help='Sampling defaults over the model\'s own, as JSON: \'{"temperature": 0.7, "top_k": 40}\'.'),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
    state_dir: Annotated[
        Path | None, typer.Option(help="Where sessions and snapshots are kept (default: the user state dir).")
    ] = None,
    session_durability_choice: Annotated[
        SessionDurability | None,
        typer.Option(
            "--session-durability",
            show_default=False,
            help="What a crash may lose: turn (nothing answered: every change is journalled and fsynced first;"
            " default) | spill (changes since a session was last spilled or saved at a graceful stop) | off"
            " (every session: kept in memory only, neither saved nor resumed).",
        ),
    ] = None,
    persist_sessions: Annotated[
        bool,
        typer.Option(
            help="Save sessions and resume them on the next start; --no-persist-sessions is the same as"
            " --session-durability off."
        ),
    ] = True,
    api_key: Annotated[
        list[str] | None,
        typer.Option(show_default=False, help="A key clients may send (repeatable); STATELM_API_KEY adds more."),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="File of keys clients may send, one a line; read again when it changes.")
    ] = None,
    admin_key: Annotated[
        list[str] | None,
        typer.Option(show_default=False, help="A key that manages every key's state; STATELM_ADMIN_KEY adds more."),
    ] = None,
    metrics_require_key: Annotated[bool, typer.Option(help="Ask for a key on /metrics as well.")] = False,
    max_request_bytes: Annotated[str, typer.Option(help="Largest request body; a larger one gets 413.")] = "16MiB",
    max_messages: Annotated[int, typer.Option(help="Most messages in one request (0: no limit).")] = 1024,
    max_prompt_tokens: Annotated[int, typer.Option(help="Most prompt tokens in one request (0: the context).")] = 0,
    max_completion_tokens: Annotated[
        int, typer.Option(help="Cap on max_tokens, and its value when a request sends none (0: the context).")
    ] = 8192,
    max_sessions_per_key: Annotated[int, typer.Option(help="Most sessions one key may hold (0: no limit).")] = 256,
    snapshot_quota: Annotated[
        str, typer.Option(help="Bytes of snapshots one key may keep on disk, e.g. 20GiB (0: no limit).")
    ] = "20GiB",
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds that running requests get to finish after SIGTERM.")
    ] = 30.0,
    sse_keepalive: Annotated[
        float,
        typer.Option(min=0.01, help="Seconds between keep-alive comments on a stream (e.g. during a long prefill)."),
    ] = 10.0,
    tool_parser: Annotated[
        str | None,
        typer.Option(
            help="Tool-call format: hermes | qwen3_coder | llama3_json | mistral (default: from the template)."
        ),
    ] = None,
    reasoning_parser: Annotated[
        str,
        typer.Option(help="Think tags: auto (from the template) | none | deepseek_r1 | qwen3 | seed_oss | mistral."),
    ] = "auto",
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-origins",
            show_default=False,
            help="A browser origin (e.g. http://localhost:5173, or *) whose pages may call the API, by CORS "
            "(repeatable; none by default).",
        ),
    ] = None,
    max_stored_completions: Annotated[
        int, typer.Option(help="Chat completions kept for `store: true`, in memory, oldest dropped (0: refused).")
    ] = 1000,
    max_stored_responses: Annotated[
        int, typer.Option(help="Stored responses (/v1/responses) one key keeps, oldest dropped (0: no limit).")
    ] = 1000,
    response_retention: Annotated[
        str, typer.Option(help="How long a stored response is kept, e.g. 30d, 12h, 90m (0: no limit).")
    ] = "30d",
    replicas: Annotated[
        int,
        typer.Option(
            min=0,
            help="Engine replicas on Ray Serve behind this one endpoint (needs statelm[cluster]; 0: one process,"
            " no Ray). --state-dir must be a directory every replica reaches.",
        ),
    ] = 0,
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster to join with --replicas (default: start a local Ray instance).")
    ] = None,
    replica_cpus: Annotated[float, typer.Option(help="Ray CPUs each replica reserves.")] = 1.0,
    replica_gpus: Annotated[float, typer.Option(help="Ray GPUs each replica reserves.")] = 0.0,
    routing: Annotated[
        str,
        typer.Option(
            help="Where stateless requests go with --replicas: prefix (the replica with the longest cached prefix,"
            " else the least loaded) | least-loaded | round-robin. Session turns always go to their replica."
        ),
    ] = "prefix",
) -> None:
    """Start the OpenAI-compatible server.

    Example: statelm serve --model default --port 8000
    """
    engine_config = EngineConfig(
        model=model,
        load_format=load_format,
        device=device,
        dtype=dtype,
        quantization=quantization,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory=parse_size(kv_cache_memory) if kv_cache_memory else None,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=prefix_cache,
        max_queue=max_queue,
        batch_invariant=batch_invariant,
        compute_path=compute_path,
        activations=activations,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        seed=seed,
        threads=threads,
        default_sampling=parse_sampling_defaults(default_sampling) if default_sampling else {},
    )
    server_config = ServerConfig(
        host=host,
        port=port,
        served_model_name=served_model_name,
        log_level=log_level,
        state_dir=state_dir or default_state_dir(),
        session_durability=session_durability(session_durability_choice, persist_sessions),
        api_keys=with_keys_from_environment(api_key, "STATELM_API_KEY"),
        api_key_file=api_key_file,
        admin_keys=with_keys_from_environment(admin_key, "STATELM_ADMIN_KEY"),
        metrics_require_key=metrics_require_key,
        max_request_bytes=parse_size(max_request_bytes),
        max_messages=max_messages or None,
        max_prompt_tokens=max_prompt_tokens or None,
        max_completion_tokens=max_completion_tokens or None,
        max_sessions_per_key=max_sessions_per_key or None,
        snapshot_quota=parse_size(snapshot_quota) or None,
        drain_timeout=drain_timeout,
        sse_keepalive=sse_keepalive,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        allowed_origins=allowed_origins or [],
        max_stored_completions=max_stored_completions,
        max_stored_responses=max_stored_responses or None,
        response_retention=parse_duration(response_retention) or None,
    )
    from statelm.server.launch import LaunchError, run_server

    cluster_config = ClusterConfig(replicas, ray_address, replica_cpus, replica_gpus, routing)
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
