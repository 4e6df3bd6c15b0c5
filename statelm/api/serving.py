"""What every generation endpoint shares: the served model, admission, sampling parameters, rendering, accounting."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from statelm.api.chat_prompt import ChatPrompter, RenderedPrompt
from statelm.api.errors import APIError, queue_full
from statelm.api.generation import GenerationStats, TextDelta, generate_text
from statelm.api.limits import GenerationLimits
from statelm.api.logprobs import TokenStrings
from statelm.api.protocol import (
    ChatMessage,
    GenerationRequest,
    PromptTokensDetails,
    SamplerSettings,
    Timings,
    ToolDefinition,
    Usage,
)
from statelm.api.structured_output import ConstraintCompiler, OutputConstraint, requested_constraint
from statelm.engine.client import EngineClient, RepetitionConfig, SamplingParams, SessionKVData
from statelm.metrics import ServingMetrics
from statelm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# What an unset sampling field means when neither the request nor the server's defaults set it
BUILTIN_SAMPLING = SamplerSettings(
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    repetition_penalty_range=-1,
)
# OpenAI's service tiers as scheduling priorities; `auto` is served at the default tier
SERVICE_TIER_PRIORITY = {"auto": 0, "default": 0, "flex": -1, "priority": 1}


@dataclass
class ServedModel:
    """The model this server answers for, as the API sees it."""

    name: str
    aliases: frozenset[str]
    max_model_len: int
    created: int
    system_fingerprint: str = ""  # what decides outputs besides the request: see `system_fingerprint`

    def check(self, requested: str) -> None:
        """404 unless the request names this model."""
        if requested != self.name and requested not in self.aliases:
            raise APIError(
                f"The model `{requested}` does not exist; this server serves `{self.name}`.",
                status=404,
                param="model",
                code="model_not_found",
            )


def sampling_defaults(values: Mapping[str, Any]) -> SamplerSettings:
    """A model's sampling defaults, checked like request fields; a value that fails is dropped with a warning."""
    kept = {}
    for name, value in values.items():
        try:
            SamplerSettings.model_validate({name: value})
        except ValidationError as exc:
            log.warning("ignoring the sampling default %s=%r: %s", name, value, exc.errors()[0]["msg"])
        else:
            kept[name] = value
    return SamplerSettings.model_validate(kept)


def system_fingerprint(model_digest: str, output_settings: Mapping[str, Any]) -> str:
    """OpenAI's `system_fingerprint`: a short hash of the model's fingerprint and the settings that change outputs."""
    identity = json.dumps({"model": model_digest, **output_settings}, sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(identity.encode()).hexdigest()[:12]


def served_tier(request: GenerationRequest) -> str:
    """The service tier a request is served at, as responses report it (`auto` and unset: `default`)."""
    tier = request.service_tier
    return "default" if tier is None or tier == "auto" else tier


def effective_defaults(defaults: SamplerSettings) -> SamplerSettings:
    """Every sampling field's value for a request that leaves it out: the server's defaults, else OpenAI's."""
    return BUILTIN_SAMPLING.model_copy(update=defaults.model_dump(exclude_none=True))


def longest_token(tokenizer: Tokenizer) -> int:
    """The most characters one token of the vocabulary stands for, plus one (a tokenizer may add a space)."""
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.token_bytes(token_id)))
        except IndexError:  # an id the vocabulary leaves unused
            continue
    return longest + 1


def usage_of(stats: GenerationStats) -> Usage:
    """Usage block from the final counts of a generation."""
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
    )


def timings_of(stats: GenerationStats) -> Timings:
    """llama.cpp-style timings: prefill from the first scheduled chunk to the first token, decode from there on."""
    prompt_n = stats.prompt_tokens - stats.cached_tokens
    prompt_ms = (stats.prefilled_at - stats.started_at) * 1000
    predicted_ms = (stats.ended_at - stats.prefilled_at) * 1000
    return Timings(
        cache_n=stats.cached_tokens,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
        prompt_per_second=prompt_n * 1000 / prompt_ms if prompt_ms > 0 else 0.0,
        predicted_n=stats.completion_tokens,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / stats.completion_tokens if stats.completion_tokens else 0.0,
        predicted_per_second=stats.completion_tokens * 1000 / predicted_ms if predicted_ms > 0 else 0.0,
        draft_n=stats.draft_tokens or None,
        draft_n_accepted=stats.draft_tokens_accepted if stats.draft_tokens else None,
    )


@dataclass
class StreamEvent:
    """One chunk of a stream: a choice's new text, a choice's finish, or (delta None) the usage at the end."""

    delta: TextDelta | None
    finish: bool = False
    usage: Usage | None = None
    timings: Timings | None = None  # on the last chunk before [DONE]


async def stream_events(deltas: AsyncIterator[TextDelta], include_usage: bool) -> AsyncIterator[StreamEvent]:
    """The chunks a generation streams as, in OpenAI's order: text, finish per choice, then usage if asked for."""
    async for delta in deltas:
        stats = delta.stats
        if delta.text or delta.tokens:
            yield StreamEvent(delta)
        if delta.finish_reason is not None:
            yield StreamEvent(delta, finish=True, timings=None if stats is None or include_usage else timings_of(stats))
        if stats is not None and include_usage:
            yield StreamEvent(None, usage=usage_of(stats), timings=timings_of(stats))


@dataclass
class ServingContext:
    """The engine, tokenizer, served model, metrics, limits and sampling defaults that the endpoints work with."""

    engine: EngineClient
    tokenizer: Tokenizer
    model: ServedModel
    metrics: ServingMetrics
    limits: GenerationLimits | None = None  # None: only the context length bounds a request
    defaults: SamplerSettings = field(default_factory=SamplerSettings)
    tool_parser: str | None = None  # --tool-parser; None: from the chat template
    reasoning_parser: str = "auto"  # --reasoning-parser
    strings: TokenStrings = field(init=False)
    constraints: ConstraintCompiler = field(init=False)
    prompter: ChatPrompter = field(init=False)

    max_chars_per_token: int = field(init=False)  # no token covers more characters of a text

    def __post_init__(self) -> None:
        self.max_chars_per_token = longest_token(self.tokenizer)
        self.strings = TokenStrings(self.tokenizer)
        self.constraints = ConstraintCompiler(self.tokenizer)
        self.prompter = ChatPrompter(
            self.tokenizer, tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser
        )

    def admit(self, requested_model: str) -> None:
        """404 for another model, 429 when the queue is full."""
        self.model.check(requested_model)
        if self.engine.queue_is_full():
            raise queue_full(self.engine.info.max_queue)

    async def render(
        self,
        messages: list[ChatMessage],
        tools: list[ToolDefinition] | None,
        kwargs: Mapping[str, Any],
        *,
        context: int | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        prefill: str = "",
    ) -> RenderedPrompt:
        """The conversation (and the start of its reply, `prefill`) rendered and tokenized in a worker thread; a
        rendering too long for `context` tokens (default: the model's) is refused before it is tokenized."""
        check = functools.partial(self.check_fits, context=context or self.model.max_model_len, param="messages")
        return await asyncio.to_thread(
            self.prompter.render,
            messages,
            tools,
            kwargs,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            check_text=check,
            prefill=prefill,
        )

    async def encode(self, text: str, param: str, *, add_special_tokens: bool) -> list[int]:
        """A text's token ids, tokenized in a worker thread; a text too long for the context is refused first."""
        self.check_fits(text, self.model.max_model_len, param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def check_fits(self, text: str, context: int, param: str) -> None:
        """400 `context_length_exceeded` when text has more characters than `context` tokens could hold.

        The bound is exact enough to need no tokenizing: no token covers more than `max_chars_per_token`
        characters, so a text this long has more tokens than the context, whatever its tokenization.
        """
        least = -(-len(text) // self.max_chars_per_token)
        if least > context:
            raise APIError(
                f"This model's maximum context length is {context} tokens; the prompt has at least {least} "
                f"tokens ({len(text)} characters), which does not fit.",
                param=param,
                code="context_length_exceeded",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """400 naming param if a token id is outside the vocabulary."""
        vocab = self.tokenizer.vocab_size
        outside = [token_id for token_id in token_ids if not 0 <= token_id < vocab]
        if outside:
            raise APIError(f"token id {outside[0]} in {param} is outside the vocabulary (0..{vocab - 1})", param=param)

    def sampling_params(
        self, request: GenerationRequest, prompt_len: int, context: int, prompt_param: str
    ) -> SamplingParams:
        """Engine parameters: the request's fields, else the model's defaults, else the built-in ones; checked."""
        room = context - prompt_len
        requested = request.requested_max_tokens()
        if room <= 0 or (requested is not None and requested > room):
            wanted = f" plus max_tokens {requested}" if requested is not None else ""
            raise APIError(
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_len} tokens{wanted}, which does not fit.",
                param=prompt_param if room <= 0 else "max_tokens",
                code="context_length_exceeded",
            )
        if self.limits is not None:
            self.limits.check_prompt(prompt_len, prompt_param)
        max_tokens = self.limits.completion_budget(requested, room) if self.limits is not None else requested or room
        if request.min_tokens > max_tokens:
            raise APIError(
                f"min_tokens ({request.min_tokens}) is more than the completion may have ({max_tokens})",
                param="min_tokens",
            )
        self.check_token_ids(list(request.logit_bias or {}), "logit_bias")
        self.check_token_ids(request.stop_token_ids, "stop_token_ids")

        defaults = effective_defaults(self.defaults)

        def pick(name: str) -> Any:
            value = getattr(request, name)
            return getattr(defaults, name) if value is None else value

        detection = request.repetition_detection
        repetition = None
        if detection is not None and detection.enabled:
            repetition = RepetitionConfig(
                detection.min_period, detection.max_period, detection.min_repeats, detection.min_tokens
            )
        return SamplingParams(
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=max(pick("top_k"), 0),
            min_p=pick("min_p"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            repetition_penalty_range=pick("repetition_penalty_range"),
            logit_bias=dict(request.logit_bias) if request.logit_bias else None,
            seed=request.seed,
            n=request.n,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logprobs=request.top_logprobs_count(),
            repetition=repetition,
            priority=SERVICE_TIER_PRIORITY[served_tier(request)],
        )

    async def constrained(
        self,
        request: GenerationRequest,
        params: SamplingParams,
        forced: OutputConstraint | None = None,
        start_after: tuple[int, ...] = (),
    ) -> SamplingParams:
        """params with the output constraint the request asks for (or `forced`, which excludes any other).

        The constraint begins once the output has produced `start_after` (the end of a think block).
        """
        constraint = requested_constraint(request)
        if forced is not None and constraint is not None:
            raise APIError(
                f"tool_choice forces a tool call, which {constraint.param} cannot constrain as well",
                param=constraint.param,
            )
        constraint = forced or constraint
        if constraint is None:
            return params
        grammar = await self.constraints.compile(constraint)
        return dataclasses.replace(params, grammar=grammar, grammar_start_after=start_after)

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_strings: list[str],
        session_id: str | None = None,
        restore: SessionKVData | None = None,
        keep_special_tokens: bool = False,
    ) -> AsyncIterator[TextDelta]:
        """The request's text deltas (not started until iterated)."""
        return generate_text(
            self.engine,
            self.tokenizer,
            request_id,
            prompt_ids,
            params,
            stop_strings,
            self.metrics,
            session_id,
            restore,
            keep_special_tokens,
        )
