"""The synchronous engine: one step schedules, runs the model once and samples for every running sequence."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from statelm.engine.block_pool import BlockPool
from statelm.engine.client import EngineStats, RequestOutput
from statelm.engine.kv_manager import KVManager
from statelm.engine.prompt_lookup import PromptLookup
from statelm.engine.runner import ModelRunner
from statelm.engine.sampler import Sampled, TokenLogprob, make_generator, sample
from statelm.engine.scheduler import ScheduledChunk, Scheduler
from statelm.engine.sequence import FinishReason, SamplingParams, Sequence
from statelm.engine.session_kv import SessionKVData, SessionKVStore
from statelm.models.pooling import PooledRows

log = logging.getLogger(__name__)
# finished replies whose decoded tokens wait for idle time to be prefilled into the prefix cache, newest kept
REPLY_REFRESHES = 4
# idle time before one starts: a client's next request (a benchmark's, an agent's tool call answered at once) comes
# sooner and is not kept waiting behind it; a person reading the reply, or a tool running, takes longer
REPLY_REFRESH_IDLE_S = 0.25
# how long one step of it may keep a request that comes meanwhile waiting: it is stopped only between steps, and a
# whole step's budget of prompt rows takes seconds on a model of billions of weights
IDLE_STEP_S = 0.05
# sequences running at most for drafts to be verified: a larger batch's step already serves its weights to many rows
SPECULATION_MAX_RUNNING = 4


class Engine:
    """Owns the scheduler, the KV manager (over the block pool) and the model runner; knows nothing of HTTP."""

    def __init__(
        self,
        runner: ModelRunner,
        pool: BlockPool,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        sampling_defaults: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
        decoded_kv_exact: bool = False,
        refresh_replies: bool = True,
        speculative_tokens: int = 0,
    ) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # ids the tokenizer knows; logit columns past them (padding) are never sampled
        self.pool = pool  # read for stats; its blocks change only through self.kv
        self.kv = KVManager(pool, runner.kv_cache)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampling_defaults = dict(sampling_defaults or {})  # request fields' defaults for this model, by name
        # decoded tokens' K/V are a prefill's (compute_path.decoded_kv_exact): published and kept by sessions as
        # they are; else only prompt rows' are, and a session's decoded tail is computed again as prompt rows
        self.decoded_kv_exact = decoded_kv_exact
        self.sessions = SessionKVStore(self.kv, decoded_kv_exact)
        self.speculative_tokens = speculative_tokens  # a draft's most tokens (prompt lookup); 0: none
        self.draft_tokens = self.draft_tokens_accepted = 0  # verified since start, and taken
        self.failed_steps_in_a_row = 0  # forward passes that raised since the last one that worked
        self.generator = make_generator(None, runner.device)  # unseeded rows' draws, one call per step
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, self.sessions)
        # --refresh-replies, where decoded K/V are not published as they are (see _refresh_reply)
        self.refresh_replies = refresh_replies and pool.enable_prefix_caching and not decoded_kv_exact
        self.reply_refreshes: deque[Sequence] = deque(maxlen=REPLY_REFRESHES)  # see _refresh_reply
        self.refreshing_reply: Sequence | None = None  # the one running, in idle time only
        self.prompt_row_seconds: float | None = None  # a row's share of the latest step of two blocks' rows or more
        self.idle_since = time.monotonic()  # when the scheduler last ran out of work (inf while it has some)
        self.latest_stats = self.stats()  # replaced by every step (read by other threads)
        # the last step ran a forward; one that had work but could schedule none of it (the pool short of blocks)
        # changes nothing until a command (a request ends, a session is released) or a cache pin's expiry
        self.last_step_ran = False

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        restore: SessionKVData | None = None,
    ) -> None:
        """Queue a request; the caller has checked that it fits the context.

        Its `params.n` choices share the prompt: the first computes it, the others start from its KV when it
        samples its first token. A session turn (session_id given, one choice) starts from the session's KV,
        restored from `restore` if the session was spilled, and parks its KV when it ends, for
        `sessions.commit` or `sessions.discard`.
        """
        if session_id is not None:
            if params.n != 1:
                raise ValueError("a session turn has exactly one choice")
            self.sessions.acquire(session_id, restore)
        first, *forks = [
            Sequence(
                request_id=request_id,
                prompt_ids=list(prompt_ids),
                params=params,
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=self.max_model_len,
                session_id=session_id,
                index=index,
                generator=self._seeded_generator(params, index),
                lookup=PromptLookup(self.speculative_tokens) if self.speculative_tokens else None,
            )
            for index in range(params.n)
        ]
        first.forks = forks
        first.pending_cache_pins = sorted(params.cache_pins, key=lambda pin: pin.num_tokens)
        self.scheduler.add(first)

    def add_embedding(self, request_id: str, prompt_ids: list[int], pooled: PooledRows) -> None:
        """Queue a prompt whose hidden states are pooled into one vector; it samples nothing, and its KV is freed
        when it ends (its full blocks stay in the prefix cache)."""
        params = SamplingParams(max_tokens=1)
        seq = Sequence(request_id, list(prompt_ids), params, self.eos_token_ids, self.max_model_len, pooled=pooled)
        self.scheduler.add(seq)

    def _seeded_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Choice `index`'s own generator when the request has a seed (and samples); unseeded rows use the engine's."""
        seed = params.choice_seed(index)
        return None if params.greedy or seed is None else make_generator(seed, self.runner.device)

    def commit_turn(self, request_id: str, session_id: str) -> int | None:
        """Make a turn's KV the session's and start refreshing its decoded tail; the token count or None.

        A turn that a stop string ended may still be running here: it is stopped (and parked) first.
        """
        self.scheduler.abort(request_id)
        count = self.sessions.commit(request_id, session_id)
        refresh = self.sessions.refresh_sequence(session_id)
        if refresh is not None:  # the session's next turn waits for it, so nothing may overtake it
            self.scheduler.add_ahead([refresh])
        return count

    def discard_turn(self, request_id: str) -> None:
        """Stop a session turn if it still runs and drop its KV; the session keeps what it had."""
        self.scheduler.abort(request_id)
        self.sessions.discard(request_id)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Stop a request (or only its choice `index`) and free its blocks; False if nothing was running."""
        return bool(self.scheduler.abort(request_id, index))

    def has_work(self) -> bool:
        """True while any request waits or runs, or a reply waits to be prefilled into the prefix cache."""
        return self.scheduler.has_work() or bool(self.reply_refreshes)

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV pool, the prefix cache and the cache pins."""
        pool = self.pool
        running, waiting = self.scheduler.running, self.scheduler.waiting
        running_refreshes = sum(seq.prefill_only for seq in running)
        waiting_refreshes = sum(seq.prefill_only for seq in waiting)
        return EngineStats(
            running=len(running) - running_refreshes,
            waiting=len(waiting) - waiting_refreshes,
            refreshing=running_refreshes + waiting_refreshes,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_pinned=pool.cache_pins.num_pinned_blocks,
            prefix_queried_tokens=pool.queried_tokens,
            prefix_hit_tokens=pool.hit_tokens,
            draft_tokens=self.draft_tokens,
            draft_tokens_accepted=self.draft_tokens_accepted,
            cache_pins=dataclasses.replace(pool.cache_pins.counters),
        )

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; a model error fails that step's requests, a sampling error only its request.

        `latest_stats` is taken once the step's batch is chosen (its sequences count as running during the
        forward) and again at its end, which every output carries.
        """
        self.kv.expire_cache_pins()
        self._refresh_replies_when_idle()
        self._propose_drafts()
        chunks = self.scheduler.schedule()
        self.last_step_ran = bool(chunks)
        self.latest_stats = self.stats()
        if not chunks:
            return []
        outputs = self._run(chunks)
        self.idle_since = math.inf if self.scheduler.has_work() else time.monotonic()
        self.latest_stats = stats = self.stats()
        for output in outputs:
            output.stats = stats
        return outputs

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Run the chunks through the model and sample where a token is due."""
        started = time.perf_counter()
        try:
            result = self.runner.execute(chunks)
        except Exception as exc:  # a failing step must not take the engine down
            log.exception("engine step failed")
            self.failed_steps_in_a_row += 1
            return [self._fail(chunk.seq, f"engine error: {exc}") for chunk in chunks]
        self.failed_steps_in_a_row = 0
        if self.refresh_replies:  # the rate sizes a reply refresh's steps (_idle_chunk_tokens)
            computed = sum(chunk.num_tokens for chunk in chunks)
            if computed >= 2 * self.pool.block_size:
                self.prompt_row_seconds = (time.perf_counter() - started) / computed
        for chunk in chunks:
            seq = chunk.seq
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = started
            seq.num_computed_tokens += chunk.num_tokens - len(seq.draft)  # a draft's rows count once verified
            self.kv.publish(seq.block_table, seq.tokens, seq.num_exact_tokens(self.decoded_kv_exact))
            if seq.pending_cache_pins:
                self.kv.pin_published(seq.block_table, seq.pending_cache_pins)
            if seq.prefill_only and seq.num_uncomputed_tokens == 0:
                seq.finish(FinishReason.STOP)
                self.scheduler.finish(seq)
                self.sessions.finish_refresh(seq)
        embedded = [self._embedded(chunk.seq) for chunk in chunks if chunk.seq.pooled is not None]
        rows = [row for row, seq in enumerate(result.sampling_seqs) for _ in range(1 + len(seq.forks))]
        seqs = [choice for seq in result.sampling_seqs for choice in (seq, *seq.forks)]
        logits = result.logits[: len(result.sampling_seqs), : self.vocab_size]
        logits = logits[rows] if len(rows) > len(result.sampling_seqs) else logits
        drafts = {seq: draft_rows[:, : self.vocab_size] for seq, draft_rows in result.draft_logits().items()}
        recorded = self._record(seqs, sample(logits, seqs, self.generator), time.perf_counter(), drafts)
        return [output for output in embedded if output is not None] + recorded

    def _propose_drafts(self) -> None:
        """Give each decoding sequence a draft of its next tokens from its own text, while few sequences run; a draft
        never runs past the sequence's max_tokens or context."""
        running = self.scheduler.running
        for seq in running:
            seq.draft = []
            if seq.lookup is None or seq.forks or seq.num_uncomputed_tokens != 1 or not seq.num_output_tokens:
                continue
            if len(running) <= SPECULATION_MAX_RUNNING:
                room = min(seq.params.max_tokens - seq.num_output_tokens, seq.max_total_tokens - seq.num_tokens)
                seq.draft = seq.lookup.propose(seq.tokens, room - 1)

    def _take_draft(
        self, seq: Sequence, logits: torch.Tensor, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> tuple[int, int]:
        """Verify seq's draft after its step's token: while the token just sampled is the draft's next one, that draft
        token's K/V (computed this step) are the sequence's and its row samples the token after it, as the next step
        would have (batch invariance: a row's logits do not depend on the rows beside it); its tokens join `tokens`.
        The draft's length and how many of its tokens were taken."""
        draft, seq.draft = seq.draft, []
        taken = 0
        while taken < len(draft) and not seq.is_finished and seq.tokens[-1] == draft[taken]:
            (outcome,) = sample(logits[taken : taken + 1], [seq], self.generator)
            if outcome.error is not None:
                break  # the next step samples this row again, and reports its error
            seq.num_computed_tokens += 1
            taken += 1
            seq.append_token(outcome.token_id)
            tokens.append(outcome.token_id)
            if logprobs is not None and outcome.logprob is not None:
                logprobs.append(outcome.logprob)
        assert seq.lookup is not None
        seq.lookup.record(len(draft), taken)
        self.draft_tokens += len(draft)
        self.draft_tokens_accepted += taken
        self.kv.trim(seq.block_table, seq.num_tokens)
        if taken:
            self.kv.publish(seq.block_table, seq.tokens, seq.num_exact_tokens(self.decoded_kv_exact))
        return len(draft), taken

    def _embedded(self, seq: Sequence) -> RequestOutput | None:
        """An embedding's output once its whole prompt has run (its vector pooled), else None."""
        if seq.num_uncomputed_tokens or seq.pooled is None:
            return None
        seq.finish(FinishReason.STOP)
        self.scheduler.finish(seq)
        output = self._output(seq, [], None, time.perf_counter())
        output.embedding = seq.pooled.result()
        return output

    def _record(
        self,
        seqs: list[Sequence],
        sampled: list[Sampled],
        produced_at: float,
        drafts: Mapping[Sequence, torch.Tensor],
    ) -> list[RequestOutput]:
        """Append sampled tokens (and what each draft, given its rows' logits, adds) and start the forks of first
        samples; a row that failed fails its request."""
        outputs: list[RequestOutput] = []
        failed: set[str] = set()
        for seq, outcome in zip(seqs, sampled, strict=True):
            if outcome.error is not None and seq.request_id not in failed:
                failed.add(seq.request_id)
                outputs.append(self._fail(seq, outcome.error))
        forks = [fork for seq in seqs if seq.request_id not in failed for fork in self._start_forks(seq)]
        for seq, outcome in zip(seqs, sampled, strict=True):
            if seq.request_id in failed:
                continue
            seq.append_token(outcome.token_id)
            tokens, logprobs = [outcome.token_id], None if outcome.logprob is None else [outcome.logprob]
            drafted = self._take_draft(seq, drafts[seq], tokens, logprobs) if seq in drafts else (0, 0)
            if seq.is_finished:
                self.scheduler.finish(seq)
                self._refresh_reply(seq)
            output = self._output(seq, tokens, logprobs, produced_at)
            output.draft_tokens, output.draft_tokens_accepted = drafted
            outputs.append(output)
        self.scheduler.add_ahead([fork for fork in forks if not fork.is_finished])
        return outputs

    def _refresh_reply(self, seq: Sequence) -> None:
        """Queue a prefill of a finished stateless reply's tokens as prompt rows, for idle time, where its decoded K/V
        are not a prefill's and so were not published: the prefix cache then serves the reply's full blocks to a
        follow-up that resends the conversation, as it serves the prompt's (a session turn has its own refresh)."""
        if not self.refresh_replies or seq.session_id is not None:
            return
        size = self.pool.block_size
        if len(seq.tokens) // size <= len(seq.prompt_ids) // size:
            return  # no full block beyond the prompt's
        self.reply_refreshes.append(Sequence.refresh(f"reply:{seq.request_id}:{seq.index}", seq.tokens))

    def _refresh_replies_when_idle(self) -> None:
        """Start the newest queued reply refresh when nothing else runs or waits; stop the one running as soon as a
        request waits (the blocks it has computed stay in the prefix cache)."""
        reply = self.refreshing_reply
        if reply is not None and (reply.is_finished or any(seq is not reply for seq in self.scheduler.waiting)):
            if not reply.is_finished:
                self.scheduler.abort(reply.request_id)
            self.refreshing_reply = reply = None
        if reply is None and not self.scheduler.has_work() and self.seconds_to_idle_work() == 0:
            self.refreshing_reply = reply = self.reply_refreshes.pop()
            self.scheduler.add(reply)
        if reply is not None:
            reply.max_chunk_tokens = self._idle_chunk_tokens()

    def _idle_chunk_tokens(self) -> int:
        """Rows of idle-time work a step: whole blocks that take about IDLE_STEP_S at the latest prompt rows' rate
        (one block at least; two before any is measured, and their step measures it)."""
        size = self.pool.block_size
        if not self.prompt_row_seconds:  # None, or a step faster than the clock
            return 2 * size
        return max(1, int(IDLE_STEP_S / self.prompt_row_seconds) // size) * size

    def seconds_to_idle_work(self) -> float | None:
        """How long until a queued reply refresh may start, the engine staying idle (0: now); None without one."""
        if not self.reply_refreshes:
            return None
        return max(0.0, self.idle_since + REPLY_REFRESH_IDLE_S - time.monotonic())

    def _start_forks(self, seq: Sequence) -> list[Sequence]:
        """Give seq's pending forks its prompt KV: full blocks shared, the partly filled last one copied."""
        forks, seq.forks = seq.forks, []
        for fork in forks:
            fork.num_computed_tokens = self.kv.start_from(fork.block_table, seq.block_table, len(seq.prompt_ids))
            fork.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
            fork.first_scheduled_at = seq.first_scheduled_at
        return forks

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End seq's whole request with an error."""
        self.scheduler.abort(seq.request_id)
        if seq.prefill_only:
            self.sessions.finish_refresh(seq)
        output = self._output(seq, [], None, time.perf_counter())
        output.error = message
        return output

    @staticmethod
    def _output(
        seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprob] | None, produced_at: float
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_prompt_tokens,
            index=seq.index,
            logprobs=logprobs,
            scheduled_at=seq.first_scheduled_at,
            produced_at=produced_at,
            ended_by_token=seq.ended_by_token,
            repetition_detected=seq.repetition_detected,
        )
