"""/v1/completions: continue one or more raw prompts (text or token ids), in OpenAI's legacy format."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from statelm.api.access_log import log_request
from statelm.api.errors import APIError
from statelm.api.generation import ReleasedToken, TextDelta, collect, merge_generations
from statelm.api.logprobs import TokenStrings
from statelm.api.openai.completions_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from statelm.api.protocol import Timings, Usage
from statelm.api.serving import ServingContext, served_tier, stream_events, timings_of, usage_of


class CompletionService:
    """Serves text completions; with several prompts, choice `p * n + i` is prompt p's choice i."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def complete(self, request: CompletionRequest) -> CompletionResponse:
        """Generate every choice in full."""
        request_id, echoes, deltas = await self._start(request)
        choices, stats = await collect(deltas, len(echoes))
        return CompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=request.model,
            choices=[
                CompletionChoice(
                    index=index,
                    text=echoes[index] + choice.text,
                    logprobs=self._logprobs(request, choice.tokens),
                    finish_reason=choice.finish_reason,
                )
                for index, choice in enumerate(choices)
            ],
            usage=usage_of(stats),
            timings=timings_of(stats),
            system_fingerprint=self.context.model.system_fingerprint,
            service_tier=served_tier(request),
        )

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Generate the choices as chunks; validation errors are raised before the first chunk."""
        request_id, echoes, deltas = await self._start(request)
        return self._chunks(request, request_id, echoes, deltas)

    async def _chunks(
        self, request: CompletionRequest, request_id: str, echoes: list[str], deltas: AsyncIterator[TextDelta]
    ) -> AsyncIterator[CompletionChunk]:
        created = int(time.time())

        def chunk(
            choices: list[CompletionChoice], usage: Usage | None = None, timings: Timings | None = None
        ) -> CompletionChunk:
            return CompletionChunk(
                id=request_id,
                created=created,
                model=request.model,
                choices=choices,
                usage=usage,
                timings=timings,
                system_fingerprint=self.context.model.system_fingerprint,
                service_tier=served_tier(request),
            )

        for index, echo in enumerate(echoes):
            if echo:
                yield chunk([CompletionChoice(index=index, text=echo)])
        async for event in stream_events(deltas, request.include_usage()):
            delta = event.delta
            if delta is None:
                yield chunk([], usage=event.usage, timings=event.timings)
            elif event.finish:
                finish = CompletionChoice(index=delta.index, text="", finish_reason=delta.finish_reason)
                yield chunk([finish], timings=event.timings)
            else:
                logprobs = self._logprobs(request, delta.tokens)
                yield chunk([CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs)])

    async def _start(self, request: CompletionRequest) -> tuple[str, list[str], AsyncIterator[TextDelta]]:
        """Check and tokenize the prompts; return the id, each choice's echoed prompt and the (unstarted) deltas."""
        context = self.context
        context.admit(request.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        log_request(request_id, request)
        prompts = request.prompts()
        streams = []
        echoes: list[str] = []
        for position, prompt in enumerate(prompts):
            prompt_ids = await self._token_ids(prompt)
            params = context.sampling_params(request, len(prompt_ids), context.model.max_model_len, "prompt")
            params = await context.constrained(request, params)
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{position}"
            streams.append(context.generate(engine_id, prompt_ids, params, request.stop_strings()))
            echo = (prompt if isinstance(prompt, str) else context.tokenizer.decode(prompt)) if request.echo else ""
            echoes += [echo] * request.n
        return request_id, echoes, merge_generations(streams, request.n)

    async def _token_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text is tokenized as the model wants (with BOS if it has one), ids are checked."""
        if isinstance(prompt, str):
            prompt_ids = await self.context.encode(prompt, "prompt", add_special_tokens=True)
        else:
            self.context.check_token_ids(prompt, "prompt")
            prompt_ids = prompt
        if not prompt_ids:
            raise APIError("the prompt is empty", param="prompt")
        return prompt_ids

    def _logprobs(self, request: CompletionRequest, tokens: list[ReleasedToken]) -> CompletionLogprobs | None:
        return None if request.logprobs is None else completion_logprobs(tokens, self.context.strings)


def completion_logprobs(tokens: list[ReleasedToken], strings: TokenStrings) -> CompletionLogprobs:
    """The legacy `logprobs` object for some tokens of a choice; each top_logprobs entry includes the chosen token."""
    top_logprobs = []
    for released in tokens:
        record = released.logprob
        top = {strings.text(token_id): logprob for token_id, logprob in record.top}
        top.setdefault(strings.text(record.token_id), record.logprob)
        top_logprobs.append(top)
    return CompletionLogprobs(
        tokens=[strings.text(released.logprob.token_id) for released in tokens],
        token_logprobs=[released.logprob.logprob for released in tokens],
        top_logprobs=top_logprobs,
        text_offset=[released.offset for released in tokens],
    )
