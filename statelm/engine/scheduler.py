"""Chooses which tokens of which sequences go into each engine step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from statelm.engine.block_pool import common_prefix_length
from statelm.engine.kv_manager import KVManager
from statelm.engine.sequence import FinishReason, Sequence, SequenceStatus
from statelm.engine.session_kv import SessionKVStore


@dataclass
class ScheduledChunk:
    """num_tokens uncomputed tokens of seq to run through the model this step (its draft's tokens last, if any)."""

    seq: Sequence
    num_tokens: int


def chunk_tokens(seq: Sequence, budget: int) -> int:
    """How many of seq's uncomputed tokens a step with `budget` rows left gives it."""
    return min(seq.num_uncomputed_tokens, budget, seq.max_chunk_tokens or budget)


def computes_every_row(seq: Sequence) -> bool:
    """An embedding that pools every token's state: no prompt token comes from the prefix cache."""
    return seq.pooled is not None and seq.pooled.pooling.needs_every_row


class Scheduler:
    """Waiting and running queues; each step packs running sequences first, then new prefill chunks."""

    def __init__(
        self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, sessions: SessionKVStore | None = None
    ) -> None:
        self.kv = kv
        self.sessions = sessions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every waiting one of its priority or a higher one."""
        position = len(self.waiting)
        while position and self.waiting[position - 1].params.priority < seq.params.priority:
            position -= 1
        self.waiting.insert(position, seq)

    def has_work(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def add_ahead(self, seqs: list[Sequence]) -> None:
        """Queue work that others wait for (a request's other choices, a session's refresh) ahead of every waiting
        sequence, whatever its priority."""
        self.waiting.extendleft(reversed(seqs))

    def abort(self, request_id: str, index: int | None = None) -> list[Sequence]:
        """Remove a request's sequences (or only choice `index`) wherever they are and free their blocks."""
        aborted = [
            seq
            for queue in (self.waiting, self.running)
            for seq in queue
            if seq.request_id == request_id and index in (None, seq.index)
        ]
        for seq in aborted:
            (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
            self._retire(seq)
            seq.finish(FinishReason.ABORT)
        return aborted

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's work: every running sequence, then waiting ones while budget and blocks last."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier iteration
                continue
            count = chunk_tokens(seq, budget)
            if not self._reserve(seq, count):
                continue
            count += self._keep_draft(seq, count, budget - count)
            chunks.append(ScheduledChunk(seq, count))
            budget -= count
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.sessions is not None and self.sessions.holds_back(seq):
                continue  # a turn waits for its session's refresh (queued behind it if the turn has a higher priority)
            if not seq.block_table.blocks:
                if self._awaits_shared_prefix(seq):
                    continue
                self._reuse_cached_prefix(seq)
            count = chunk_tokens(seq, budget)
            # it starts only if its whole prompt fits: one that would be preempted halfway would be recomputed in vain
            fits = self._make_room(seq, seq.num_tokens)
            if not (fits and self.kv.grow(seq.block_table, seq.num_computed_tokens + count)):
                self.kv.free(seq.block_table)
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, count))
            budget -= count
        return chunks

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running queue and free (or, for a session turn, park) its blocks."""
        if seq in self.running:  # a fork that ends at its first token was never queued
            self.running.remove(seq)
        self._retire(seq)

    def _awaits_shared_prefix(self, seq: Sequence) -> bool:
        """Whether a new sequence's prompt shares whole blocks with a running one that has yet to compute them: it
        waits for them to reach the prefix cache instead of computing them too (many requests with one system prompt
        at once, as SGLang's in-batch prefix caching). Not a session turn (its own KV serves it) nor a pooling that
        takes no prefix from the cache."""
        if not self.kv.pool.enable_prefix_caching or seq.session_id is not None or computes_every_row(seq):
            return False
        size = self.kv.block_size
        for other in self.running:
            if other.num_computed_tokens >= len(other.prompt_ids):
                continue
            # tokens the cache could serve (at least one is left to compute): whole blocks past those computed
            shared = min(common_prefix_length(seq.prompt_ids, other.prompt_ids), len(seq.prompt_ids) - 1)
            if shared // size > other.num_computed_tokens // size:
                return True
        return False

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """Start a sequence from its session's KV or the prefix cache, whichever serves more tokens (an embedding
        that pools every token's state starts from nothing)."""
        if computes_every_row(seq):
            return
        cached = self.kv.start_from_cache(seq.block_table, seq.tokens, counted=not seq.prefill_only)
        session_length = self.sessions.reusable_length(seq) if self.sessions is not None else 0
        if session_length > cached:
            self.kv.free(seq.block_table)
            cached = self.sessions.attach(seq, session_length)
        seq.num_computed_tokens = cached
        if seq.num_output_tokens == 0:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens

    def _reserve(self, seq: Sequence, count: int) -> bool:
        """Make room for count more tokens of a running seq, preempting the newest others if needed."""
        while not self._grow(seq, seq.num_computed_tokens + count):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _keep_draft(self, seq: Sequence, count: int, budget: int) -> int:
        """How many rows of a running seq's draft follow its `count` rows: as many as the step's budget and the free
        blocks hold (a draft preempts nothing and spills no session), and none unless its last token is computed too."""
        draft = seq.draft[:budget] if count == seq.num_uncomputed_tokens else []
        if draft and not self.kv.grow(seq.block_table, seq.num_tokens + len(draft)):
            draft = []
        seq.draft = draft
        return len(draft)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it to be recomputed first."""
        self.running.remove(seq)
        self.kv.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table hold num_tokens, spilling idle sessions if the pool is short."""
        return self._make_room(seq, num_tokens) and self.kv.grow(seq.block_table, num_tokens)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """True if the pool has the blocks seq lacks to hold num_tokens, once idle sessions are spilled if need be."""
        missing = self.kv.missing_blocks(seq.block_table, num_tokens)
        return missing <= self.kv.num_free_blocks or (self.sessions is not None and self.sessions.reclaim(missing))

    def _retire(self, seq: Sequence) -> None:
        """Let go of an ended sequence's blocks: a session turn parks them, anything else frees them."""
        if seq.session_id is not None and self.sessions is not None:
            self.sessions.park(seq)
        else:
            self.kv.free(seq.block_table)
