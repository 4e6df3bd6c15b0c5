"""The synchronous engine: one step schedules, runs the model once and samples for every running sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from statelm.engine.block_pool import BlockPool
from statelm.engine.runner import ModelRunner
from statelm.engine.sampler import make_generator, sample
from statelm.engine.scheduler import Scheduler
from statelm.engine.sequence import FinishReason, SamplingParams, Sequence
from statelm.engine.session_kv import SessionKVData, SessionKVStore

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None


class Engine:
    """Owns the scheduler, block pool and model runner; knows nothing of HTTP."""

    def __init__(
        self,
        runner: ModelRunner,
        pool: BlockPool,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sessions = SessionKVStore(pool, runner.kv_cache)
        self.scheduler = Scheduler(pool, max_num_seqs, max_num_batched_tokens, self.sessions)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        restore: SessionKVData | None = None,
    ) -> None:
        """Queue a request; the caller has checked that it fits the context.

        A session turn (session_id given) starts from the session's KV, restored from `restore` if the
        session was spilled, and parks its KV when it ends, for `sessions.commit` or `sessions.discard`.
        """
        if session_id is not None:
            self.sessions.acquire(session_id, restore)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=self.max_model_len,
            session_id=session_id,
            generator=None if params.greedy else make_generator(params.seed, self.runner.device),
        )
        self.scheduler.add(seq)

    def commit_turn(self, request_id: str, session_id: str) -> int | None:
        """Make a turn's KV the session's and start refreshing its decoded tail; the token count or None.

        A turn that a stop string ended may still be running here: it is stopped (and parked) first.
        """
        self.scheduler.abort(request_id)
        count = self.sessions.commit(request_id, session_id)
        refresh = self.sessions.refresh_sequence(session_id)
        if refresh is not None:
            self.scheduler.add(refresh)
        return count

    def discard_turn(self, request_id: str) -> None:
        """Stop a session turn if it still runs and drop its KV; the session keeps what it had."""
        self.scheduler.abort(request_id)
        self.sessions.discard(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is not known (already finished)."""
        return self.scheduler.abort(request_id) is not None

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one scheduling step; on a model error, fail the requests of that step only."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        try:
            result = self.runner.execute(chunks)
            new_tokens = sample(result.logits, result.sampling_seqs)
        except Exception as exc:  # a failing step must not take the engine down
            log.exception("engine step failed")
            return [self._fail(chunk.seq, f"engine error: {exc}") for chunk in chunks]
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            # only prompt rows are published: decoded K/V round differently from a prefill of the same tokens
            published = min(seq.num_computed_tokens, len(seq.prompt_ids))
            self.pool.register_full_blocks(seq.tokens, seq.block_table, seq.block_hashes, published)
            if seq.prefill_only and seq.num_uncomputed_tokens == 0:
                seq.finish(FinishReason.STOP)
                self.scheduler.finish(seq)
                self.sessions.finish_refresh(seq)
        outputs = []
        for seq, token in zip(result.sampling_seqs, new_tokens, strict=True):
            seq.append_token(token)
            if seq.is_finished:
                self.scheduler.finish(seq)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        self.scheduler.abort(seq.request_id)
        if seq.prefill_only:
            self.sessions.finish_refresh(seq)
        output = self._output(seq, [])
        output.error = message
        return output

    @staticmethod
    def _output(seq: Sequence, new_tokens: list[int]) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_prompt_tokens,
        )
