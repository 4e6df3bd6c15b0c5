"""Token stream from the engine to text: incremental detokenization, then stop strings."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from statelm.api.parsers.stop import StopStringMatcher
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.sequence import FinishReason, SamplingParams
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
) -> AsyncIterator[TextChunk]:
    """Yield text as it becomes final; no text past a stop string is ever yielded."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stop_strings)
    completion_tokens = 0
    async for output in engine.generate(request_id, prompt_ids, params):
        completion_tokens += len(output.new_token_ids)
        text = matcher.feed("".join(detokenizer.add(t) for t in output.new_token_ids))
        if output.finished and not matcher.stopped:
            text += matcher.feed(detokenizer.flush())
            text += "" if matcher.stopped else matcher.flush()
        finish: str | None = None
        if matcher.stopped:
            finish = FinishReason.STOP.value
        elif output.finished:
            finish = (output.finish_reason or FinishReason.STOP).value
        yield TextChunk(text, finish, output.num_prompt_tokens, output.num_cached_tokens, completion_tokens)
        if finish is not None:
            return  # leaving the engine's generator aborts a request that a stop string ended
