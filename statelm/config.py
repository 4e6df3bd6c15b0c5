"""Flat settings for the engine and the server, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from statelm.paths import default_state_dir


@dataclass
class EngineConfig:
    """How the model is loaded and how the engine schedules and caches."""

    model: str = "default"
    load_format: str = "auto"  # auto | dummy
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = a default that depends on the device
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    batch_invariant: bool = True  # fixed-size matmul row chunks: output independent of batch composition
    max_queue: int = 256  # requests waiting for a slot; more get 429
    seed: int = 0
    threads: int | None = None


@dataclass
class ServerConfig:
    """Where and how the HTTP server listens."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    state_dir: Path = field(default_factory=default_state_dir)  # sessions and snapshots live here
    persist_sessions: bool = True  # save live sessions on shutdown and resume them on start
