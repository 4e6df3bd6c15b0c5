"""Token stream from the engine to text: incremental detokenization, then stop strings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from statelm.api.parsers.stop import StopStringMatcher
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.sequence import FinishReason, SamplingParams
from statelm.engine.session_kv import SessionKVData
from statelm.metrics import ServingMetrics
from statelm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextChunk:
    """New text of a generation; the last chunk carries the finish reason and final counts."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def generate_text(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_strings: list[str],
    metrics: ServingMetrics,
    session_id: str | None = None,
    restore: SessionKVData | None = None,
) -> AsyncIterator[TextChunk]:
    """Yield text as it becomes final; no text past a stop string is ever yielded.

    A session turn (session_id) starts from the session's KV, restored from `restore` if it was spilled.
    """
    detokenizer = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stop_strings)
    completion_tokens = 0
    finish: str | None = None
    last_arrival = time.perf_counter()
    try:
        async for output in engine.generate(request_id, prompt_ids, params, session_id, restore):
            now = time.perf_counter()
            latency = metrics.time_to_first_token if completion_tokens == 0 else metrics.inter_token_latency
            latency.observe(now - last_arrival)
            last_arrival = now
            completion_tokens += len(output.new_token_ids)
            text = matcher.feed("".join(detokenizer.add(t) for t in output.new_token_ids))
            if output.finished and not matcher.stopped:
                text += matcher.feed(detokenizer.flush())
                text += "" if matcher.stopped else matcher.flush()
            if matcher.stopped:
                finish = FinishReason.STOP.value
            elif output.finished:
                finish = (output.finish_reason or FinishReason.STOP).value
            chunk = TextChunk(text, finish, output.num_prompt_tokens, output.num_cached_tokens, completion_tokens)
            if finish is not None:
                metrics.record_finished(finish, chunk.prompt_tokens, chunk.cached_tokens, completion_tokens)
            yield chunk
            if finish is not None:
                return  # leaving the engine's generator aborts a request that a stop string ended
    finally:
        if finish is None:  # the client went away or the engine failed
            metrics.finished_requests.labels(FinishReason.ABORT.value).inc()
