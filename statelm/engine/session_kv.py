"""KV caches that sessions hold between turns: attach to a turn by longest common prefix, park, commit, spill.

A session's KV is described by its token list and the blocks that hold those tokens, nothing else. A
turn's sequence starts from the longest common prefix (LCP) of its prompt with the session's tokens:
full blocks are shared (referenced once more), and a partly filled last block is copied, so a turn
never writes into a block that a session (or a fork of it) holds. When the sequence ends, its KV is
parked under the request id until the API layer commits it to the session or discards it; a
session therefore changes only when the API layer says the turn completed.

Only K/V exactly what a prefill of the same tokens computes are reused or saved: those of prompt rows
(batch-invariant kernels), and those of generated rows where the model computes both kinds of row alike
(statelm.models.compute_path.decoded_kv_exact: the kernels path with one arithmetic for both). Elsewhere
decoded tokens went through the matmuls in decode-sized chunks or another arithmetic, which round
differently: after a turn commits, a refresh prefills the decoded tail (a few milliseconds per token, in
the background). Either way the next turn reuses the whole conversation and gives the very reply a
stateless request with the full history gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from statelm.attention.kv_format import KVFormat, format_of_rows
from statelm.engine.block_pool import common_prefix_length
from statelm.engine.kv_manager import BlockTable, KVManager
from statelm.engine.sequence import Sequence


class SessionKVData:
    """A session's KV outside the pool: its tokens and, per layer, K and V rows [tokens, heads, width] in the pool's
    format (statelm.attention.kv_format: [tokens, heads, head_dim] of a float dtype, or q8_0 blocks as uint8).

    K and V exported from a GPU are still being copied to pinned host memory when export returns; `ready`
    fires when they are complete. Reading `keys` or `values` waits for it, so nothing sees half-copied
    data: the snapshot and spill writers read them in worker threads, and only `load` (through in_flight)
    takes them unwaited, making the GPU wait for `ready` instead of the engine thread.
    """

    def __init__(
        self,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ready: torch.cuda.Event | None = None,
    ) -> None:
        self.tokens = tokens
        self.ready = ready  # None once keys and values are complete (always on the CPU)
        self._keys = keys
        self._values = values

    @property
    def keys(self) -> list[torch.Tensor]:
        """K per layer, once complete (blocks until an asynchronous copy has finished)."""
        self.wait()
        return self._keys

    @property
    def values(self) -> list[torch.Tensor]:
        """V per layer, once complete (blocks until an asynchronous copy has finished)."""
        self.wait()
        return self._values

    @property
    def kv_format(self) -> KVFormat | None:
        """The format of the rows (known before they are complete); None without layers."""
        return format_of_rows(self._keys[0]) if self._keys else None

    def wait(self) -> None:
        """Block until keys and values are complete; returns at once for CPU data or a finished copy."""
        ready = self.ready
        if ready is not None:
            ready.synchronize()
            self.ready = None

    def in_flight(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event | None]:
        """K, V and the event that completes them, without waiting: for a GPU stream that waits on the event."""
        return self._keys, self._values, self.ready

    def pin_host_memory(self) -> None:
        """Move keys and values into pinned host memory, so that loading them onto a GPU copies asynchronously."""
        if all(tensor.is_pinned() for tensor in (*self._keys, *self._values)):
            return  # a GPU export's are: nothing to copy, nor to wait for
        self.wait()
        self._keys = [tensor.pin_memory() for tensor in self._keys]
        self._values = [tensor.pin_memory() for tensor in self._values]


@dataclass
class SessionBlocks:
    """Tokens whose K/V a session holds, and the table of blocks (each referenced once by it) that hold them."""

    tokens: list[int]
    table: BlockTable
    exact: int  # leading tokens whose K/V are a prefill's (Sequence.num_exact_tokens); the rest await a refresh
    last_used: float = field(default_factory=time.monotonic)
    users: int = 0  # sequences of running turns attached to it; only unused sessions may spill


class SessionKVError(RuntimeError):
    """A session's KV cannot be placed in the pool."""


SpillHandler = Callable[[str, SessionKVData], None]


class SessionKVStore:
    """The KV blocks of every resident session, plus the parked KV of turns that have ended."""

    def __init__(self, kv: KVManager, decoded_kv_exact: bool = False) -> None:
        self.kv = kv
        self.decoded_kv_exact = decoded_kv_exact  # generated rows' K/V are a prefill's (no refresh is ever due)
        self.resident: dict[str, SessionBlocks] = {}
        self.parked: dict[str, SessionBlocks] = {}
        self.spill_handler: SpillHandler | None = None  # receives the KV of sessions spilled under pressure
        self.refreshing: dict[str, tuple[Sequence, SessionBlocks]] = {}  # session → refresh and the KV it extends
        self.refresh_waiters: dict[str, list[Callable[[], None]]] = {}  # session → what runs once its refresh ends

    def num_tokens(self, session_id: str) -> int | None:
        """Tokens a resident session holds; None if it is not resident."""
        held = self.resident.get(session_id)
        return None if held is None else len(held.tokens)

    def acquire(self, session_id: str, restore: SessionKVData | None) -> None:
        """Mark a resident session as used by a new turn; restore spilled KV first if it is given."""
        if session_id not in self.resident and restore is not None:
            try:
                self.load(session_id, restore)
            except SessionKVError:
                return  # the turn recomputes the prefix instead; nothing is lost
        held = self.resident.get(session_id)
        if held is not None:
            held.users += 1
            held.last_used = time.monotonic()

    def reusable_length(self, seq: Sequence) -> int:
        """Tokens of seq its session's KV can serve: the LCP, keeping at least one token to compute."""
        held = self.resident.get(seq.session_id or "")
        if held is None:
            return 0
        return min(common_prefix_length(held.tokens, seq.tokens), held.exact, seq.num_tokens - 1)

    def attach(self, seq: Sequence, length: int) -> int:
        """Start seq from the first length tokens of its session's KV; returns the tokens actually attached."""
        held = self.resident[seq.session_id or ""]
        if length % self.kv.block_size and not self.kv.num_free_blocks:
            self.reclaim(1, keep=seq.session_id)  # room for the copy of the partly filled block, if a spill makes it
        seq.num_computed_tokens = self.kv.start_from(seq.block_table, held.table, length)
        return seq.num_computed_tokens

    def park(self, seq: Sequence) -> None:
        """Keep the KV of a session turn that ended (finished, stopped or aborted) until commit or discard."""
        held = self.resident.get(seq.session_id or "")
        if held is not None:
            held.users -= 1
        computed = seq.num_computed_tokens
        table = self.kv.park(seq.block_table, computed)
        self.parked[seq.request_id] = SessionBlocks(
            seq.tokens[:computed], table, seq.num_exact_tokens(self.decoded_kv_exact)
        )

    def commit(self, request_id: str, session_id: str) -> int | None:
        """Make a parked turn's KV the session's; returns the session's token count, None if nothing was parked."""
        parked = self.parked.pop(request_id, None)
        if parked is None:
            return None
        previous = self.resident.get(session_id)
        if previous is not None:
            parked.users = previous.users
            self.kv.free(previous.table, exported=True)
        self.resident[session_id] = parked
        return len(parked.tokens)

    def refresh_sequence(self, session_id: str) -> Sequence | None:
        """A prefill-only sequence that recomputes the session's decoded tail as prompt rows; None if none is due."""
        held = self.resident.get(session_id)
        if held is None or held.exact >= len(held.tokens) or session_id in self.refreshing:
            return None
        seq = Sequence.refresh(f"refresh:{session_id}:{len(held.tokens)}", held.tokens, session_id)
        self.acquire(session_id, None)
        self.refreshing[session_id] = (seq, held)
        return seq

    def finish_refresh(self, seq: Sequence) -> None:
        """Adopt a finished (or aborted) refresh's parked KV, unless the session changed meanwhile; nothing for a
        reply's refresh (no session: its blocks went to the prefix cache as it ran)."""
        session_id = seq.session_id
        if session_id is None:
            return
        _, base = self.refreshing.pop(session_id)
        parked = self.parked.get(seq.request_id)
        if parked is not None and self.resident.get(session_id) is base and parked.exact == len(base.tokens):
            self.commit(seq.request_id, session_id)
        else:
            self.discard(seq.request_id)
        for action in self.refresh_waiters.pop(session_id, []):
            action()

    def after_refresh(self, session_id: str, action: Callable[[], None]) -> None:
        """Run action now, or once the refresh of the session's decoded tail that is running or waiting has ended."""
        if session_id in self.refreshing:
            self.refresh_waiters.setdefault(session_id, []).append(action)
        else:
            action()

    def holds_back(self, seq: Sequence) -> bool:
        """True for a turn whose session is being refreshed: it starts once the refresh is done."""
        return not seq.prefill_only and seq.session_id in self.refreshing

    def discard(self, request_id: str) -> None:
        """Free a parked turn's KV; the session keeps what it had."""
        parked = self.parked.pop(request_id, None)
        if parked is not None:
            self.kv.free(parked.table)

    def release(self, session_id: str) -> None:
        """Forget a session's KV (its full blocks stay in the prefix cache until reused)."""
        held = self.resident.pop(session_id, None)
        if held is not None:
            self.kv.free(held.table, exported=True)  # an export of them may still be copying (a spill's is)

    def fork(self, source_id: str, target_id: str) -> bool:
        """Give target the same KV as source, sharing its blocks; False if source is not resident."""
        source = self.resident.get(source_id)
        if source is None:
            return False
        self.release(target_id)
        self.resident[target_id] = SessionBlocks(list(source.tokens), self.kv.share(source.table), source.exact)
        return True

    def export(self, session_id: str) -> SessionKVData | None:
        """Copy a resident session's exact K/V (not a decoded tail awaiting refresh) out of the pool; None if absent."""
        held = self.resident.get(session_id)
        if held is None:
            return None
        keys, values, ready = self.kv.gather(held.table, held.exact)
        return SessionKVData(held.tokens[: held.exact], keys, values, ready)

    def load(self, session_id: str, data: SessionKVData) -> None:
        """Write a session's K/V into newly allocated blocks, spilling idle sessions if the pool is short."""
        needed = self.kv.blocks_needed(len(data.tokens))
        if needed > self.kv.num_free_blocks and not self.reclaim(needed):
            raise SessionKVError(f"the KV pool has {self.kv.num_free_blocks} free blocks; this session needs {needed}")
        self.release(session_id)
        table = self.kv.load(data.tokens, *data.in_flight())
        self.resident[session_id] = SessionBlocks(list(data.tokens), table, len(data.tokens))

    def reclaim(self, needed_blocks: int, keep: str | None = None) -> bool:
        """Spill least recently used idle sessions (but keep) until needed_blocks are free; False if impossible."""
        if self.spill_handler is None:
            return needed_blocks <= self.kv.num_free_blocks
        idle = sorted((p.last_used, sid) for sid, p in self.resident.items() if p.users == 0 and sid != keep)
        for _, session_id in idle:
            if self.kv.num_free_blocks >= needed_blocks:
                break
            if not self.kv.num_sole_references(self.resident[session_id].table):
                continue  # every block is shared with a fork or a running turn: spilling frees nothing
            data = self.export(session_id)
            self.release(session_id)  # on a GPU, later forwards wait for the export's copy before reusing the blocks
            if data is not None:
                self.spill_handler(session_id, data)
        return self.kv.num_free_blocks >= needed_blocks
