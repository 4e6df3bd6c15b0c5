"""Token stream from the engine to text: per choice, incremental detokenization, stop strings and logprobs."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from statelm.api.parsers.stop import StopStringMatcher
from statelm.engine.client import (
    EngineClient,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SessionKVData,
    TokenLogprob,
)
from statelm.metrics import ServingMetrics
from statelm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class ReleasedToken:
    """A generated token whose text has been given out, at `offset` characters into its choice's text."""

    logprob: TokenLogprob
    offset: int


@dataclass(frozen=True)
class GenerationStats:
    """Token counts and engine times (time.perf_counter) of a finished generation."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    started_at: float  # its first prompt chunk ran
    prefilled_at: float  # every prompt had its first token
    ended_at: float  # the last token was sampled
    draft_tokens: int = 0  # tokens of drafts (prompt lookup) verified
    draft_tokens_accepted: int = 0  # of which generated

    @classmethod
    def merge(cls, parts: list[GenerationStats]) -> GenerationStats:
        """The stats of several generations served as one response."""
        return cls(
            prompt_tokens=sum(part.prompt_tokens for part in parts),
            cached_tokens=sum(part.cached_tokens for part in parts),
            completion_tokens=sum(part.completion_tokens for part in parts),
            started_at=min(part.started_at for part in parts),
            prefilled_at=max(part.prefilled_at for part in parts),
            ended_at=max(part.ended_at for part in parts),
            draft_tokens=sum(part.draft_tokens for part in parts),
            draft_tokens_accepted=sum(part.draft_tokens_accepted for part in parts),
        )


@dataclass
class TextDelta:
    """New text of one choice; its last delta has the finish reason, the generation's last also the stats."""

    index: int
    text: str
    tokens: list[ReleasedToken] = field(default_factory=list)  # with logprobs on: the tokens whose text starts here
    finish_reason: str | None = None
    repetition_detected: bool = False  # with the finish reason: a loop in the output ended it
    stats: GenerationStats | None = None
    token_ids: list[int] = field(default_factory=list)  # with the finish reason: every token the choice generated
    stop_string: str | None = None  # with the finish reason: the stop string that ended the choice


class ChoiceText:
    """One choice's tokens as text: nothing past a stop string, and the logprobs of exactly the tokens given out.

    Stop strings are looked for in the text after the first `min_tokens` tokens. The token that ends a
    choice (EOS or a stop token) is not part of its text, nor is a stop string. Special tokens are left out
    of the text unless `keep_special_tokens` (a tool or reasoning parser reads markers that are special).
    With `align_to_tokens` (logprobs), text is given out at token boundaries, so that each delta's tokens are
    exactly its text (a token holding part of a character goes with the token that completes it); only the
    tokens of the last delta before a stop string may hold more than its text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_strings: list[str],
        min_tokens: int,
        keep_special_tokens: bool = False,
        align_to_tokens: bool = False,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=not keep_special_tokens)
        self.matcher = StopStringMatcher(stop_strings)
        self.align_to_tokens = align_to_tokens  # logprobs are on: text goes out with whole tokens
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.decoded = 0  # characters the detokenizer has produced
        self.released = 0  # characters given out
        self.ready = ""  # with logprobs: text past the stop strings, held until its tokens are complete
        self.pending: deque[tuple[ReleasedToken, int]] = deque()  # with the offset where each token's text ends
        self.finish_reason: str | None = None
        self.repetition_detected = False

    @property
    def num_tokens(self) -> int:
        """Tokens the choice has generated so far."""
        return len(self.token_ids)

    def add(self, output: RequestOutput) -> TextDelta:
        """The text (and tokens) one engine output adds to this choice."""
        last = len(output.new_token_ids) - 1
        ended_by_token = output.finished and output.ended_by_token
        for position, token_id in enumerate(output.new_token_ids):
            if self.matcher.stopped:
                break  # a verified draft's tokens after a stop string were never the reply's, as one at a time
            self.token_ids.append(token_id)
            if ended_by_token and position == last:
                break
            start = self.decoded
            self.ready += self._text(self.detokenizer.add(token_id))
            if output.logprobs is not None:
                self.pending.append((ReleasedToken(output.logprobs[position], start), self.decoded))
        if output.finished and not self.matcher.stopped:
            self.ready += self._text(self.detokenizer.flush())
            self.ready += "" if self.matcher.stopped else self.matcher.flush()
        if self.matcher.stopped:
            self.finish_reason = FinishReason.STOP.value
        elif output.finished:
            self.finish_reason = (output.finish_reason or FinishReason.STOP).value
            self.repetition_detected = output.repetition_detected
        tokens, cut = self._release()
        text, self.ready = self.ready[:cut], self.ready[cut:]
        self.released += len(text)
        finished = self.finish_reason is not None
        ids = list(self.token_ids) if finished else []
        return TextDelta(
            output.index,
            text,
            tokens,
            self.finish_reason,
            self.repetition_detected,
            token_ids=ids,
            stop_string=self.matcher.matched,
        )

    def _text(self, piece: str) -> str:
        """Text that may be given out now, once the stop strings have seen it."""
        self.decoded += len(piece)
        if self.num_tokens <= self.min_tokens and not self.matcher.stopped:
            return piece
        return self.matcher.feed(piece)

    def _release(self) -> tuple[list[ReleasedToken], int]:
        """The tokens to give out now, and how much of the ready text goes with them.

        Without logprobs all ready text goes. At a finish everything does, except (after a stop string) the
        tokens whose text is not in the reply at all. Otherwise the complete tokens whose text is ready go,
        and the text up to the end of the last of them.
        """
        ready_end = self.released + len(self.ready)
        if self.finish_reason is not None:
            tokens = [token for token, _ in self.pending if not self.matcher.stopped or token.offset < ready_end]
            self.pending.clear()
            return tokens, len(self.ready)
        if not self.align_to_tokens:
            return [], len(self.ready)
        count = cut = 0
        for position, (token, end) in enumerate(self.pending):
            if end > ready_end:
                break
            if end > token.offset:  # a token with text of its own closes the group before it
                count, cut = position + 1, end
        tokens = [self.pending.popleft()[0] for _ in range(count)]
        return tokens, cut - self.released if count else 0


@dataclass
class CollectedChoice:
    """A whole choice: its text, the tokens given out with it (when logprobs are on) and its finish reason."""

    text: str = ""
    tokens: list[ReleasedToken] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(deltas: AsyncIterator[TextDelta], count: int) -> tuple[list[CollectedChoice], GenerationStats]:
    """Every choice of a generation in full, and its stats."""
    choices = [CollectedChoice() for _ in range(count)]
    stats: GenerationStats | None = None
    async for delta in deltas:
        choice = choices[delta.index]
        choice.text += delta.text
        choice.tokens += delta.tokens
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        stats = delta.stats or stats
    if stats is None:
        raise RuntimeError("the generation ended before all its choices finished")
    return choices, stats


async def generate_text(
    engine: EngineClient,
    tokenizer: Tokenizer,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_strings: list[str],
    metrics: ServingMetrics,
    session_id: str | None = None,
    restore: SessionKVData | None = None,
    keep_special_tokens: bool = False,
) -> AsyncIterator[TextDelta]:
    """Yield each choice's text as it becomes final; the very last delta carries the generation's stats.

    A choice that meets a stop string is stopped in the engine at once. A session turn (session_id) starts
    from the session's KV, restored from `restore` if it was spilled.
    """
    aligned = params.logprobs is not None
    choices = [
        ChoiceText(tokenizer, stop_strings, params.min_tokens, keep_special_tokens, aligned) for _ in range(params.n)
    ]
    first_token_at: dict[int, float] = {}
    arrived_at = time.perf_counter()
    last_arrival: dict[int, float] = {}  # per choice
    scheduled_at = ended_at = 0.0
    prompt_tokens = cached_tokens = 0
    draft_tokens = draft_tokens_accepted = 0  # verified, and taken
    done = 0
    try:
        request = EngineRequest(request_id, prompt_ids, params, session_id, restore)
        async for output in engine.generate(request):
            choice = choices[output.index]
            if choice.finish_reason is not None:
                continue  # sampled before a stop string's abort reached the engine
            now = time.perf_counter()
            if not last_arrival:
                metrics.time_to_first_token.observe(now - arrived_at)
            elif output.index in last_arrival:
                metrics.inter_token_latency.observe(now - last_arrival[output.index])
            last_arrival[output.index] = now
            first_token_at.setdefault(output.index, output.produced_at)
            scheduled_at, ended_at = output.scheduled_at or output.produced_at, output.produced_at
            prompt_tokens, cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
            draft_tokens += output.draft_tokens
            draft_tokens_accepted += output.draft_tokens_accepted
            delta = choice.add(output)
            if delta.finish_reason is not None:
                done += 1
                if not output.finished and done < len(choices):
                    engine.abort(request_id, output.index)  # a stop string ended it
            if done == len(choices):
                delta.stats = GenerationStats(
                    prompt_tokens=prompt_tokens,
                    cached_tokens=cached_tokens,
                    completion_tokens=sum(choice.num_tokens for choice in choices),
                    started_at=scheduled_at,
                    prefilled_at=max(first_token_at.values()),
                    ended_at=ended_at,
                    draft_tokens=draft_tokens,
                    draft_tokens_accepted=draft_tokens_accepted,
                )
                reasons = [choice.finish_reason or FinishReason.STOP.value for choice in choices]
                metrics.record_finished(reasons, prompt_tokens, cached_tokens, delta.stats.completion_tokens)
            if delta.text or delta.tokens or delta.finish_reason is not None:
                yield delta
            if done == len(choices):
                return  # leaving the engine's generator aborts choices that stop strings ended
    finally:
        if done < len(choices):  # the client went away or the engine failed
            metrics.finished_requests.labels(FinishReason.ABORT.value).inc()


async def merge_generations(
    streams: list[AsyncIterator[TextDelta]], choices_per_stream: int
) -> AsyncIterator[TextDelta]:
    """Several generations as one: stream k's choice i becomes choice k * choices_per_stream + i; stats merged."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue[tuple[int, TextDelta | BaseException | None]] = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[TextDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((position, delta))
        except Exception as exc:
            queue.put_nowait((position, exc))
        else:
            queue.put_nowait((position, None))

    tasks = [asyncio.create_task(pump(position, stream)) for position, stream in enumerate(streams)]
    stats: list[GenerationStats] = []
    try:
        remaining = len(streams)
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            delta = dataclasses.replace(item, index=position * choices_per_stream + item.index, stats=None)
            if item.stats is not None:
                stats.append(item.stats)
                if len(stats) == len(streams):
                    delta.stats = GenerationStats.merge(stats)
            yield delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
