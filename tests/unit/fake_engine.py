"""An EngineClient without a model, for testing the API and sessions layers against the engine seam alone.

Each request's reply is the fake's `reply` token ids (cut at `max_tokens`), one per output; the request is recorded,
and so is its abort when the caller leaves the generation before it ends.
A session's KV is kept as SessionKVData whose K and V hold the token ids, so where KV goes can be read back. A session
turn starts from its session's KV (or the spilled KV it is given), its longest common prefix with the prompt counted
as cached, and parks the KV of its prompt and reply when it ends (or is stopped by `commit_turn` or `discard_turn`,
which then take it), as the real engine does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import torch

from statelm.engine.client import (
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SessionKVData,
    SessionKVError,
    SpillHandler,
    common_prefix_length,
)
from statelm.models.loader import ModelFingerprint
from statelm.models.pooling import PooledRows

LAYERS = 2
# the fingerprint of the fake's model, which the sessions layer writes into bundles and checks when it reads them
FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "float32", "tokenizer": "t"})


def token_kv(tokens: list[int]) -> SessionKVData:
    """KV of tokens whose every value is the token's id (V: the id plus a half)."""
    keys = [torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 2).clone() for _ in range(LAYERS)]
    return SessionKVData(list(tokens), keys, [k + 0.5 for k in keys])


@dataclass
class FakeEngine:
    """The engine seam with scripted replies; records what the layers above asked of it."""

    reply: list[int]
    info: EngineInfo = field(
        default_factory=lambda: EngineInfo(
            max_model_len=4096,
            max_queue=4,
            block_size=16,
            prefix_caching=True,
            sampling_defaults={},
            device="cpu",
        )
    )
    capacity: int | None = None  # the most tokens of session KV the pool holds (None: no limit)
    fail_with: str | None = None  # every request fails in the engine with this message
    full: bool = False  # queue_is_full() answers this
    requests: list[EngineRequest] = field(default_factory=list)
    aborted: list[tuple[str, int | None]] = field(default_factory=list)
    committed: list[tuple[str, str]] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    resident: dict[str, SessionKVData] = field(default_factory=dict)
    parked: dict[str, SessionKVData] = field(default_factory=dict)
    shut_down: bool = False
    running: dict[str, list[int]] = field(default_factory=dict)  # session turns' tokens so far, by request id
    _spill: SpillHandler | None = None
    _stats: EngineStats = field(default_factory=EngineStats)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The reply's tokens, one output each; a session turn parks its KV at the end."""
        self.requests.append(request)
        ended = False  # its last output was yielded, or the engine dropped it
        try:
            await asyncio.sleep(0)  # queued until the engine's next step
            if self.fail_with is not None:
                ended = True
                raise EngineError(self.fail_with)
            prompt = request.prompt_ids
            cached = 0
            if request.session_id is not None:
                if request.session_id not in self.resident and request.restore is not None:
                    self.resident[request.session_id] = request.restore
                held = self.resident.get(request.session_id)
                cached = min(common_prefix_length(held.tokens, prompt), len(prompt) - 1) if held is not None else 0
            tokens = self.reply[: request.params.max_tokens]
            end = FinishReason.LENGTH if len(tokens) < len(self.reply) else FinishReason.STOP
            self._stats = replace(self._stats, running=1)
            computed = self.running[request.request_id] = list(prompt)
            for position, token in enumerate(tokens):
                computed.append(token)
                ended = position == len(tokens) - 1
                reason = end if ended else None
                yield RequestOutput(request.request_id, [token], ended, reason, len(prompt), cached, stats=self._stats)
                await asyncio.sleep(0)
        finally:
            if not ended:  # left early (a client gone, a stop string): aborted, as AsyncEngine does
                self.aborted.append((request.request_id, None))
            self._stats = replace(self._stats, running=0)
            if request.session_id is not None:
                self._park(request.request_id)
            self.running.pop(request.request_id, None)

    async def embed(self, request_id: str, prompt_ids: list[int], pooled: PooledRows) -> RequestOutput:
        """The prompt pooled as though each position's hidden state were [id, -id, 1] (fed in two chunks where it has
        two tokens or more, as a prompt longer than a step's budget is); recorded as a request."""
        self.requests.append(EngineRequest(request_id, list(prompt_ids), SamplingParams(max_tokens=1)))
        await asyncio.sleep(0)
        if self.fail_with is not None:
            raise EngineError(self.fail_with)
        ids = torch.tensor(prompt_ids, dtype=torch.float32)
        hidden = torch.stack([ids, -ids, torch.ones_like(ids)], dim=1)
        for start, end in ((0, (len(prompt_ids) + 1) // 2), ((len(prompt_ids) + 1) // 2, len(prompt_ids))):
            if end > start:
                pooled.add(hidden[start:end], start)
        output = RequestOutput(request_id, [], True, FinishReason.STOP, len(prompt_ids), 0, stats=self._stats)
        output.embedding = pooled.result()
        return output

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Recorded."""
        self.aborted.append((request_id, index))

    def queue_is_full(self) -> bool:
        """As set."""
        return self.full

    def is_degraded(self) -> bool:
        """Never."""
        return False

    def stats(self) -> EngineStats:
        """The latest stats."""
        return self._stats

    def commit_turn(self, request_id: str, session_id: str) -> None:
        """The turn's KV (parked now if it still runs) becomes the session's."""
        self.committed.append((request_id, session_id))
        self._park(request_id)
        parked = self.parked.pop(request_id, None)
        if parked is not None:
            self.resident[session_id] = parked

    def discard_turn(self, request_id: str) -> None:
        """The turn's KV is dropped."""
        self.discarded.append(request_id)
        self._park(request_id)
        self.parked.pop(request_id, None)

    def _park(self, request_id: str) -> None:
        """Park a running turn's KV (once)."""
        computed = self.running.pop(request_id, None)
        if computed is not None:
            self.parked[request_id] = token_kv(computed)

    async def resident_sessions(self, session_ids: list[str]) -> dict[str, int]:
        """Token counts of the resident ones."""
        return {sid: len(self.resident[sid].tokens) for sid in session_ids if sid in self.resident}

    async def export_session_kv(self, session_id: str) -> SessionKVData | None:
        """The resident KV."""
        return self.resident.get(session_id)

    async def load_session_kv(self, session_id: str, data: SessionKVData) -> None:
        """Resident from now on, unless it is over capacity."""
        if self.capacity is not None and len(data.tokens) > self.capacity:
            raise SessionKVError(f"the pool holds {self.capacity} tokens; this session needs {len(data.tokens)}")
        self.resident[session_id] = data

    async def fork_session_kv(self, source_id: str, target_id: str) -> bool:
        """target shares source's KV."""
        if source_id not in self.resident:
            return False
        self.resident[target_id] = self.resident[source_id]
        return True

    def release_session_kv(self, session_id: str) -> None:
        """Forgotten."""
        self.resident.pop(session_id, None)

    def empty_session_kv(self) -> SessionKVData:
        """No tokens."""
        return token_kv([])

    def on_spill(self, handler: SpillHandler | None) -> None:
        """Kept for `spill`."""
        self._spill = handler

    def spill(self, session_id: str) -> None:
        """Spill a resident session as memory pressure would: out of the pool, handed to the spill handler."""
        data = self.resident.pop(session_id)
        assert self._spill is not None
        self._spill(session_id, data)

    def shutdown(self) -> None:
        """Recorded."""
        self.shut_down = True
