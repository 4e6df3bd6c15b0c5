"""Flat settings for the engine and the server, filled from the command line."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statelm.paths import default_state_dir


@dataclass
class EngineConfig:
    """How the model is loaded and how the engine schedules and caches."""

    model: str = "default"
    load_format: str = "auto"  # auto | dummy
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # auto (a GGUF's quantized weights stay packed) | none | int8 | int4
    # packed matmuls: float32 (the float model's arithmetic) | int8 (llama.cpp's; faster) | int8-decode (int8 for
    # generated tokens, as llama.cpp decodes; float32 for prompt tokens, so every first token is the float model's)
    activations: str = "int8-decode"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = a default that depends on the device
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    batch_invariant: bool = True  # fixed-size matmul row chunks: output independent of batch composition
    compute_path: str = "auto"  # auto (the start-up self-check picks) | kernels | torch | torch-per-row
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16 | float16 (CPU kernels path only)
    enforce_eager: bool = False  # CUDA: no graph capture of decode steps (every step runs eagerly)
    max_queue: int = 256  # requests waiting for a slot; more get 429
    seed: int = 0
    threads: int | None = None
    default_sampling: dict[str, Any] = field(default_factory=dict)  # request field defaults over the model's own


class SessionDurability(enum.StrEnum):
    """What of a session survives a crash: every completed turn, what was last spilled or saved, or nothing."""

    TURN = "turn"  # a journal record per change, fsynced before the change is answered
    SPILL = "spill"  # sessions written when spilled and at a graceful stop
    OFF = "off"  # sessions kept in memory only, neither saved nor resumed


@dataclass
class ServerConfig:
    """Where and how the HTTP server listens."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    state_dir: Path = field(default_factory=default_state_dir)  # sessions and snapshots live here
    session_durability: SessionDurability = SessionDurability.TURN
    resume_sessions: bool = True  # take the state dir's sessions at start (a cluster replica adopts them instead)
    api_keys: list[str] = field(default_factory=list)  # none (and no file, no admin key): no authentication
    api_key_file: Path | None = None  # one key a line, read again when it changes
    admin_keys: list[str] = field(default_factory=list)  # may see and manage every key's sessions and snapshots
    metrics_require_key: bool = False  # /metrics is public unless set
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413
    max_messages: int | None = 1024  # per generation request; more get 400
    max_prompt_tokens: int | None = None  # None: the context length
    max_completion_tokens: int | None = 8192  # max_tokens above it gets 400; also the default when none is sent
    max_sessions_per_key: int | None = 256  # more get 429
    snapshot_quota: int | None = 20 * 2**30  # bytes of snapshots per key; past it 507
    drain_timeout: float = 30.0  # seconds running requests may take to finish after SIGTERM
    sse_keepalive: float = 10.0  # seconds between SSE comments on a stream (kept open through a long prefill)
    tool_parser: str | None = None  # tool-call output format; None: read off the chat template
    reasoning_parser: str = "auto"  # think tags: auto (from the template), none, or a parser name
    allowed_origins: list[str] = field(default_factory=list)  # browser origins allowed by CORS; none by default
    max_stored_completions: int = 1000  # `store: true` completions kept in memory, the oldest dropped; 0: refused
    max_stored_responses: int | None = 1000  # stored responses per key, the oldest dropped past it; None: no limit
    response_retention: float | None = 30 * 86400.0  # seconds a stored response is kept; None: no limit


@dataclass
class ClusterConfig:
    """Engine replicas on Ray Serve behind one endpoint (`statelm serve --replicas N`)."""

    replicas: int = 0  # 0: the single-process server, which never imports Ray
    ray_address: str | None = None  # join this Ray cluster; None: start a local Ray instance
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves
    replica_gpus: float = 0.0  # Ray GPUs each replica reserves
    routing: str = "prefix"  # stateless requests: prefix (longest cached prefix, else least loaded) | least-loaded
    # | round-robin
