"""Flat settings for the engine and the server.

Each field is also a `statelm serve` option: `name: type = setting(default, help="...")` is `--name` with that default
and help (statelm/cli/settings.py makes the options), so a new setting is one field here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from statelm.paths import default_state_dir

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}  # fmt: skip
_DURATION = re.compile(r"^\s*([0-9.]+)\s*([smhd]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str) -> int:
    """Bytes from a size such as `2GiB`, `512MB` or `1000000`."""
    match = _SIZE.match(text)
    if not match or (match.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def format_size(num_bytes: int) -> str:
    """Bytes as `512 B`, `11.2 MiB`…"""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def parse_duration(text: str) -> float:
    """Seconds from a duration such as `30d`, `12h`, `90m` or `3600`."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (examples: 30d, 12h, 90m, 3600)")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def parse_sampling_defaults(text: str) -> dict[str, Any]:
    """Sampling defaults from a JSON object, checked as request fields are."""
    from pydantic import ValidationError

    from statelm.sampler_settings import SamplerSettings

    try:
        return SamplerSettings.model_validate_json(text).model_dump(exclude_none=True)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{problems} (fields: {', '.join(SamplerSettings.model_fields)})") from None


@dataclass(frozen=True)
class Switch:
    """A second spelling of one value of a setting: a bool option whose `--no-` form sets that value."""

    flag: str  # e.g. --persist-sessions, whose --no-persist-sessions sets `off`
    off: Any
    help: str

    @property
    def off_flag(self) -> str:
        """The spelling that sets `off`."""
        return f"--no-{self.flag.removeprefix('--')}"


@dataclass(frozen=True)
class Setting:
    """How `statelm serve` sets a config field: the option's help, name, text form and default as typed."""

    help: str
    flag: str | None = None  # None: --field-name (and --no-field-name for a bool)
    parse: Callable[[str], Any] | None = None  # reads the option's text; None: the field's own type
    text_default: str | None = None  # the default as typed, where parse reads it (e.g. "16MiB")
    zero_is_none: bool = False  # the option's 0 is the field's None (e.g. no limit)
    env: str | None = None  # an environment variable whose space-separated words are added to a list
    minimum: float | None = None
    maximum: float | None = None
    cli: bool = True  # False: not a `statelm serve` option
    switch: Switch | None = None  # another option that sets one of the field's values


SETTING = "statelm.setting"  # the key of a field's Setting in its metadata


def setting(
    default: Any = MISSING,
    *,
    help: str,
    factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    text_default: str | None = None,
    zero_is_none: bool = False,
    env: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    cli: bool = True,
    switch: Switch | None = None,
) -> Any:
    """A dataclass field with a default (or a factory of one) and the `statelm serve` option that sets it."""
    metadata = {SETTING: Setting(help, flag, parse, text_default, zero_is_none, env, minimum, maximum, cli, switch)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class Pooling(enum.StrEnum):
    """How a sequence's final hidden states become one embedding vector."""

    MEAN = "mean"  # the average of every token's state
    LAST = "last"  # the last token's state (decoder embedders: Qwen3-Embedding, e5-mistral)
    CLS = "cls"  # the first token's state (BERT's [CLS]: BGE)

    @property
    def needs_every_row(self) -> bool:
        """True when every token's state counts, so no prompt token may be served by the prefix cache."""
        return self is not Pooling.LAST


@dataclass
class EngineConfig:
    """How the model is loaded and how the engine schedules and caches."""

    model: str = setting("default", help="Model dir, .gguf file, hub id (org/name), or `default`.")
    load_format: str = setting("auto", help="auto | dummy (random weights, for benchmarks)")
    device: str = setting("auto", help="auto | cpu | cuda")
    dtype: str = setting("auto", help="auto | float32 | bfloat16 | float16")
    quantization: str = setting(
        "auto",
        help="auto (a GGUF's quantized weights stay packed) | none (dequantize) | int8 | int4 (quantize float weights"
        " at load)",
    )
    activations: str = setting(
        "auto",
        help="Packed (quantized) matmuls, prompt tokens' rows / generated tokens' rows: auto (int8 for models of about"
        " 1B parameters and up, int16-prompt below) | int8 (both quantized per 32 values, per 256 on K-quant blocks,"
        " as llama.cpp computes: about 3% of next tokens differ from float32's) | int16-prompt (int16 / int8:"
        " float32's next tokens in 99.9% of positions, prompts at about half int8's rate) | int8-decode (float32 /"
        " int8) | float32 (both).",
    )
    repack: bool = setting(
        True,
        help="CPU kernels: copy a GGUF's blocks once at load, in memory, into the kernel's interleaved layout (decode"
        " reads them 1.3-1.8x faster; results bit-identical) | --no-repack: read the mapped file in place (about"
        " the file's size less memory, pages shared with other processes).",
        flag="--repack",
    )
    max_model_len: int | None = setting(None, help="Context length cap (default: the model's).")
    block_size: int = setting(16, help="Tokens per KV cache block.")
    kv_cache_memory: int | None = setting(  # bytes
        None,
        help="KV cache budget, e.g. 2GiB (default: on CPU 2GiB, or a quarter of the available memory where that is"
        " less; on a GPU 80% of its free memory).",
        parse=parse_size,
    )
    max_num_seqs: int = setting(64, help="Most sequences running at once.")
    max_num_batched_tokens: int | None = setting(
        None,
        help="Token budget of one engine step (default: 256 on CPU, where a step's float32 activations set the"
        " server's peak memory, 512 on a GPU).",
        minimum=1,
    )
    enable_prefix_caching: bool = setting(
        True, help="Reuse cached KV blocks of shared prompt prefixes.", flag="--prefix-cache"
    )
    refresh_replies: bool = setting(
        True,
        help="Where generated tokens' K/V are not a prefill's (--activations int16-prompt or int8-decode, the torch"
        " paths), prefill a finished stateless reply into the prefix cache once the engine has idled 0.25 s, so that"
        " a follow-up resending the conversation finds it | --no-refresh-replies: no such background work.",
        flag="--refresh-replies",
    )
    speculative_tokens: int | None = setting(
        None,
        help="Most tokens of a draft a decoding sequence verifies in a step: the tokens that followed the latest"
        " earlier occurrence of its last 3 (or 2) tokens in its own text (prompt lookup); a reply that quotes its"
        " prompt (a document, code being edited) gets up to N+1 tokens a step, the same tokens and logprobs as"
        " one at a time where the compute path is batch-invariant. Drafts run while at most 4 sequences do"
        " (default: 4 on a CPU whose compute path the self-check verified, else 0; 0: off).",
        minimum=0,
    )
    pinned_kv_fraction: float = setting(
        0.5, help="Share of the KV cache that cache_control pins may hold, all keys (0: no pins).", minimum=0, maximum=1
    )
    pinned_kv_fraction_per_key: float = setting(
        0.25, help="Share of the KV cache that one key's cache_control pins may hold.", minimum=0, maximum=1
    )
    batch_invariant: bool = setting(
        True, help="Same output for a request whatever else runs (fixed-size matmul chunks)."
    )
    compute_path: str = setting(
        "auto",
        help="auto (a start-up self-check picks the fastest batch-invariant one) | kernels | torch | torch-per-row.",
    )
    kv_cache_dtype: str = setting(
        "auto",
        help="auto (16-bit: a 16-bit model's own dtype, else float16) | float32 | float16 | bfloat16 | q8_0 (8-bit"
        " values with a float16 scale per 32, as llama.cpp's: about half the bytes of 16-bit).",
    )
    enforce_eager: bool = setting(False, help="CUDA: run every step eagerly (no CUDA graphs of decode steps).")
    max_queue: int = setting(256, help="Requests that may wait for a slot; more get 429.")
    seed: int = setting(0, help="Seed for dummy weights.")
    threads: int | None = setting(None, help="Torch CPU threads (default: all cores).")
    model_cache_size: int | None = setting(  # bytes
        8 * 2**30,
        help="Disk the model cache (converted models, shared by every server of this user) may use, e.g. 8GiB;"
        " past it the least recently used entries go (0: no limit). `statelm cache ls|rm` shows and clears it.",
        parse=parse_size,
        text_default="8GiB",
        zero_is_none=True,
    )
    default_sampling: dict[str, Any] = setting(  # request field defaults over the model's own
        factory=dict,
        help='Sampling defaults over the model\'s own, as JSON: \'{"temperature": 0.7, "top_k": 40}\'.',
        parse=parse_sampling_defaults,
    )
    pooling: Pooling = setting(
        Pooling.LAST,
        help="How /v1/embeddings pools the served model's final hidden states: last (token) | mean | cls (first"
        " token); the vector is normalised.",
    )
    embedding_models: list[str] = setting(
        factory=list,
        help="An encoder model to serve beside --model at /v1/embeddings, /v1/rerank and /v1/score, routed by the"
        " request's `model` (repeatable): a BERT or nomic-bert embedder (BGE, E5, all-MiniLM, nomic-embed-text)"
        " or cross-encoder (reranker), as a folder, .gguf file or hub id.",
        flag="--embedding-model",
    )


class SessionDurability(enum.StrEnum):
    """What of a session survives a crash: every completed turn, what was last spilled or saved, or nothing."""

    TURN = "turn"  # a journal record per change, fsynced before the change is answered
    SPILL = "spill"  # sessions written when spilled and at a graceful stop
    OFF = "off"  # sessions kept in memory only, neither saved nor resumed


@dataclass
class ServerConfig:
    """Where and how the HTTP server listens."""

    host: str = setting("127.0.0.1", help="Interface to bind; loopback unless told otherwise.")
    port: int = setting(8000, help="TCP port.")
    served_model_name: str | None = setting(None, help="Name clients use in `model`.")
    log_level: str = setting("info", help="debug | info | warning | error")
    state_dir: Path = setting(
        factory=default_state_dir, help="Where sessions and snapshots are kept (default: the user state dir)."
    )
    session_durability: SessionDurability = setting(
        SessionDurability.TURN,
        help="What a crash may lose: turn (nothing answered: every change is journalled and fsynced first) | spill"
        " (changes since a session was last spilled or saved at a graceful stop) | off (every session: kept in memory"
        " only, neither saved nor resumed).",
        switch=Switch(
            "--persist-sessions",
            SessionDurability.OFF,
            help="Save sessions and resume them on the next start; --no-persist-sessions is the same as"
            " --session-durability off.",
        ),
    )
    persist_idle_after: float | None = setting(  # seconds
        None,
        help="Save a session, its KV included, once it has been idle this long after a change, e.g. 30s, 5m: after a"
        " crash its KV need not be recomputed, and under spill durability its turns are kept (default: saved when"
        " spilled and at a graceful stop only).",
        parse=parse_duration,
    )
    resume_sessions: bool = setting(
        True,
        help="Take the state dir's sessions at start (a cluster replica adopts them one by one instead).",
        cli=False,
    )
    api_keys: list[str] = setting(  # none (and no file, no admin key): no authentication
        factory=list,
        help="A key clients may send (repeatable); STATELM_API_KEY adds more.",
        flag="--api-key",
        env="STATELM_API_KEY",
    )
    api_key_file: Path | None = setting(
        None, help="File of keys clients may send, one a line; read again when it changes."
    )
    admin_keys: list[str] = setting(
        factory=list,
        help="A key that manages every key's state; STATELM_ADMIN_KEY adds more.",
        flag="--admin-key",
        env="STATELM_ADMIN_KEY",
    )
    metrics_require_key: bool = setting(False, help="Ask for a key on /metrics as well.")
    max_request_bytes: int = setting(
        16 * 2**20, help="Largest request body; a larger one gets 413.", parse=parse_size, text_default="16MiB"
    )
    max_messages: int | None = setting(  # more get 400
        1024, help="Most messages in one request (0: no limit).", zero_is_none=True
    )
    max_prompt_tokens: int | None = setting(
        None, help="Most prompt tokens in one request (0: the context).", zero_is_none=True
    )
    max_completion_tokens: int | None = setting(  # max_tokens above it gets 400
        8192, help="Cap on max_tokens, and its value when a request sends none (0: the context).", zero_is_none=True
    )
    max_sessions_per_key: int | None = setting(  # more get 429
        256, help="Most sessions one key may hold (0: no limit).", zero_is_none=True
    )
    snapshot_quota: int | None = setting(  # bytes; past it 507
        20 * 2**30,
        help="Bytes of snapshots one key may keep on disk, e.g. 20GiB (0: no limit).",
        parse=parse_size,
        text_default="20GiB",
        zero_is_none=True,
    )
    drain_timeout: float = setting(30.0, help="Seconds that running requests get to finish after SIGTERM.")
    sse_keepalive: float = setting(
        10.0, help="Seconds between keep-alive comments on a stream (e.g. during a long prefill).", minimum=0.01
    )
    tool_parser: str | None = setting(
        None, help="Tool-call format: hermes | qwen3_coder | llama3_json | mistral (default: from the template)."
    )
    reasoning_parser: str = setting(
        "auto", help="Think tags: auto (from the template) | none | deepseek_r1 | qwen3 | seed_oss | mistral."
    )
    allowed_origins: list[str] = setting(
        factory=list,
        help="A browser origin (e.g. http://localhost:5173, or *) whose pages may call the API, by CORS (repeatable;"
        " none by default).",
    )
    max_stored_completions: int = setting(
        1000, help="Chat completions kept for `store: true`, in memory, oldest dropped (0: refused)."
    )
    max_stored_responses: int | None = setting(
        1000, help="Stored responses (/v1/responses) one key keeps, oldest dropped (0: no limit).", zero_is_none=True
    )
    response_retention: float | None = setting(  # seconds
        30 * 86400.0,
        help="How long a stored response is kept, e.g. 30d, 12h, 90m (0: no limit).",
        parse=parse_duration,
        text_default="30d",
        zero_is_none=True,
    )
    webui: bool = setting(True, help="Serve the web UI (a chat page on the public API) at `/`.")


@dataclass
class ClusterConfig:
    """Engine replicas on Ray Serve behind one endpoint (`statelm serve --replicas N`)."""

    replicas: int = setting(
        0,
        help="Engine replicas on Ray Serve behind this one endpoint (needs statelm[cluster]; 0: one process, no Ray)."
        " --state-dir must be a directory every replica reaches.",
        minimum=0,
    )
    ray_address: str | None = setting(
        None, help="Ray cluster to join with --replicas (default: start a local Ray instance)."
    )
    replica_cpus: float = setting(1.0, help="Ray CPUs each replica reserves.")
    replica_gpus: float = setting(0.0, help="Ray GPUs each replica reserves.")
    routing: str = setting(
        "prefix",
        help="Where stateless requests go with --replicas: prefix (the replica with the longest cached prefix, else"
        " the least loaded) | least-loaded | round-robin. Session turns always go to their replica.",
    )
