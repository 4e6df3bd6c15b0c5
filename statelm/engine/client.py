"""The engine's seam: the typed protocol the API and sessions layers drive the engine through, and its values.

`EngineClient` is everything a layer above `engine/` may ask of the engine: add a request (a session turn when it
names a session) and abort it; embed a prompt (its hidden states pooled); commit or discard a session turn; export,
load, fork and release a session's KV; the engine's fixed facts (`EngineInfo`) and its state (`EngineStats`, also
carried on every output). `AsyncEngine` (async_engine.py) implements it in process, on the engine's own thread; an
implementation in another process would carry the same dataclasses. Cache pins travel with a request
(`SamplingParams.cache_pins`).

Above `engine/`, this module is the only one imported (tests/unit/test_import_graph.py checks it); it defines the
protocol and the values new to it, and names the values the protocol carries that are defined where the engine
uses them: sampling parameters, their constraints and finish reasons, token logprobs, session KV, cache pin requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from statelm.attention.kv_format import KVFormat, format_of_rows, kv_format
from statelm.engine.block_pool import common_prefix_length
from statelm.engine.cache_pins import CachePinCounters, CachePinRequest
from statelm.engine.grammar import CompiledGrammar, GrammarBackend, GrammarError, tool_call_schema
from statelm.engine.guidance import ReasoningBudget
from statelm.engine.logits_processors import LOGIT_BIAS_LIMIT
from statelm.engine.repetition import RepetitionConfig
from statelm.engine.sampler import TokenLogprob
from statelm.engine.sequence import FinishReason, SamplingParams
from statelm.engine.session_kv import SessionKVData, SessionKVError, SpillHandler
from statelm.models.pooling import PooledRows

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "CachePinCounters",
    "CachePinRequest",
    "CompiledGrammar",
    "EngineClient",
    "EngineError",
    "EngineInfo",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "GrammarBackend",
    "GrammarError",
    "KVFormat",
    "ReasoningBudget",
    "RepetitionConfig",
    "RequestOutput",
    "SamplingParams",
    "SessionKVData",
    "SessionKVError",
    "SpillHandler",
    "TokenLogprob",
    "common_prefix_length",
    "format_of_rows",
    "kv_format",
    "tool_call_schema",
]


class EngineError(RuntimeError):
    """A request failed inside the engine."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine serves, fixed at start: the context, the KV pool's block size, the request defaults."""

    max_model_len: int
    max_queue: int  # requests that may wait for a slot in the running batch before `queue_is_full`
    block_size: int  # tokens per KV block: the prefix cache (and its pins) hold whole blocks
    prefix_caching: bool
    sampling_defaults: Mapping[str, Any]  # request fields' defaults for this model, by name
    device: str  # where the KV pool lives ("cpu", "cuda"): session KV bound for a GPU goes through pinned host memory
    kv_format: str = "float32"  # the KV pool's storage format (--kv-cache-dtype); sessions' KV rows are in it
    kv_bytes_per_token: int = 0  # a token's K and V, all layers, in that format
    kv_capacity_tokens: int = 0  # tokens the pool holds in all
    batch_invariance: Mapping[str, object] | None = None  # the start-up self-check's report; None: not asked for


@dataclass(frozen=True)
class EngineStats:
    """The engine's state when a step has chosen its batch, or has ended: queues, KV pool, prefix cache, cache pins."""

    running: int = 0  # requests' sequences in the running batch
    waiting: int = 0  # requests' sequences waiting for a slot
    refreshing: int = 0  # K/V refreshes (of a session or a reply: no request's) running or waiting
    kv_blocks_used: int = 0  # held by at least one sequence or session
    kv_blocks_free: int = 0  # held by nobody (some keep reusable cached contents)
    kv_blocks_pinned: int = 0  # of prefixes pinned by cache pins, held or free
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of which found there
    draft_tokens: int = 0  # tokens of drafts (prompt lookup) verified since start
    draft_tokens_accepted: int = 0  # of which the sequences' next tokens
    cache_pins: CachePinCounters = field(default_factory=CachePinCounters)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of queried prompt tokens found in the prefix cache (0 before any query)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


@dataclass(frozen=True)
class EngineRequest:
    """A generation request: its prompt and parameters, and for a session turn the session whose KV it starts from.

    A session turn (session_id, one choice) starts from the session's KV, restored from `restore` if the session
    was spilled, and its KV is parked when it ends until `commit_turn` or `discard_turn`.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    restore: SessionKVData | None = None


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request: new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0  # the choice
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    scheduled_at: float | None = None  # time.perf_counter() when the request's first chunk ran
    produced_at: float = 0.0  # time.perf_counter() when this step's tokens were sampled
    error: str | None = None
    ended_by_token: bool = False  # the last new token ended the choice and is not output text (EOS, stop token)
    repetition_detected: bool = False  # the choice ended because its output fell into a loop
    draft_tokens: int = 0  # tokens of the choice's draft (prompt lookup) this step verified
    draft_tokens_accepted: int = 0  # of which are among new_token_ids
    stats: EngineStats | None = None  # the engine's state after the step that produced it
    embedding: torch.Tensor | None = None  # an embedding request's pooled vector, with its finish


class EngineClient(Protocol):
    """The engine as the layers above it see it; every call returns without waiting for a step to run."""

    @property
    def info(self) -> EngineInfo:
        """What the engine serves."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its choices' outputs until all have finished; leaving early aborts it.

        Raises EngineError when the engine drops the request.
        """
        ...

    async def embed(self, request_id: str, prompt_ids: list[int], pooled: PooledRows) -> RequestOutput:
        """Run a prompt that samples nothing, its hidden states pooled as `pooled` says; the output's `embedding`
        holds the vector. Raises EngineError when the engine drops the request."""
        ...

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or only its choice `index`) at the engine's next step."""
        ...

    def queue_is_full(self) -> bool:
        """True when `info.max_queue` requests already wait for a slot in the running batch."""
        ...

    def is_degraded(self) -> bool:
        """True when the engine cannot serve."""
        ...

    def stats(self) -> EngineStats:
        """The engine's state as of its latest step (commands run between steps)."""
        ...

    def commit_turn(self, request_id: str, session_id: str) -> None:
        """Make a session turn's KV the session's (stopping the turn first if it still runs)."""
        ...

    def discard_turn(self, request_id: str) -> None:
        """Stop a session turn if it still runs and drop its KV; the session keeps what it had."""
        ...

    async def resident_sessions(self, session_ids: list[str]) -> dict[str, int]:
        """The token counts of those sessions whose KV is in the pool."""
        ...

    async def export_session_kv(self, session_id: str) -> SessionKVData | None:
        """A copy of a resident session's KV, taken once a refresh of its decoded tail that is due has run; None if
        it is not resident."""
        ...

    async def load_session_kv(self, session_id: str, data: SessionKVData) -> None:
        """Put a session's KV into the pool, spilling idle sessions if needed; SessionKVError if it cannot fit."""
        ...

    async def fork_session_kv(self, source_id: str, target_id: str) -> bool:
        """Give target the KV of source, sharing its blocks (copied on write); False if source is not resident."""
        ...

    def release_session_kv(self, session_id: str) -> None:
        """Forget a session's KV."""
        ...

    def empty_session_kv(self) -> SessionKVData:
        """The KV of no tokens, shaped as the pool's."""
        ...

    def on_spill(self, handler: SpillHandler | None) -> None:
        """Have the engine hand the KV of sessions it spills under memory pressure to handler, on the caller's event
        loop (None: the engine spills nothing)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine."""
        ...
