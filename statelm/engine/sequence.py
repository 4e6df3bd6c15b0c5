"""A request's token sequence as the engine tracks it, and the parameters that steer its sampling."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from statelm.engine.cache_pins import CachePinRequest
from statelm.engine.grammar import CompiledGrammar
from statelm.engine.guidance import GuideStop, OutputGuide, ReasoningBudget
from statelm.engine.kv_manager import BlockTable
from statelm.engine.prompt_lookup import PromptLookup
from statelm.engine.repetition import RepetitionConfig
from statelm.models.pooling import PooledRows

SEED_MODULUS = 2**64  # torch generators take seeds in [0, 2**64); negative seeds wrap around
GREEDY_TEMPERATURE = 1e-5  # below it, sampling is greedy (as in vLLM): logits / temperature would overflow


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, already validated by the API layer."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    repetition_penalty_range: int = -1  # tokens at the end of the context it looks at: -1 all of them, 0 none
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    n: int = 1  # choices, each its own sequence after the shared prompt
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens cannot be sampled before this many tokens
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the chosen token's logprob and this many top alternatives; None = off
    grammar: CompiledGrammar | None = None  # constrains the output token by token; the output ends when it is complete
    grammar_start_after: tuple[int, ...] = ()  # the grammar starts once the output has produced these ids (</think>)
    reasoning: ReasoningBudget | None = None  # caps the think block; its end tag is forced when the budget is spent
    repetition: RepetitionConfig | None = None  # ends the sequence (STOP) when its output falls into a loop
    priority: int = 0  # waiting sequences of a higher priority are scheduled first (OpenAI's service_tier)
    cache_pins: tuple[CachePinRequest, ...] = ()  # prompt prefixes to pin in the prefix cache once computed (or found)

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index`: choice i of seed s samples as a single request with seed s + i would."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why generation ended, in OpenAI's words."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """Prompt and generated token ids, the KV blocks that hold them and the sampling state (compared by identity)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    session_id: str | None = None  # a session turn starts from, and parks its KV for, this session
    prefill_only: bool = False  # computes its tokens' K/V and ends without sampling (a refresh of a session or reply)
    pooled: PooledRows | None = None  # an embedding: its prompt's hidden states are pooled; it ends without sampling
    index: int = 0  # which of the request's n choices this is
    forks: list[Sequence] = field(default_factory=list)  # the other choices, started from this one's prompt KV
    block_table: BlockTable = field(default_factory=BlockTable)  # its KV blocks, which the KVManager changes
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    pending_cache_pins: list[CachePinRequest] = field(default_factory=list)  # shortest first, pinned once computed
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None  # a seeded choice's own; unseeded ones draw from the engine's
    first_scheduled_at: float | None = None  # time.perf_counter() when its first chunk ran
    max_chunk_tokens: int | None = None  # at most this many rows a step (idle-time work, which must give way soon)
    lookup: PromptLookup | None = None  # drafts its next tokens from its own text (--speculative-tokens)
    draft: list[int] = field(default_factory=list)  # this step's guess of the tokens after `tokens`, verified by it
    tokens: list[int] = field(init=False)  # prompt then output, the sequence's whole token list
    guide: OutputGuide | None = field(init=False)  # grammar, reasoning budget and repetition stop, if any is asked for
    ended_by_token: bool = field(init=False, default=False)  # its last token ended it and is not output text (EOS…)
    repetition_detected: bool = field(init=False, default=False)  # it ended because its output fell into a loop

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.guide = None if self.prefill_only else OutputGuide.for_params(self.params)

    @classmethod
    def refresh(cls, request_id: str, tokens: list[int], session_id: str | None = None) -> Sequence:
        """A prefill-only sequence that computes tokens' K/V as prompt rows (a session's decoded tail, or a
        stateless reply for the prefix cache) and ends without sampling."""
        return cls(
            request_id=request_id,
            prompt_ids=list(tokens),
            params=SamplingParams(max_tokens=1),
            eos_token_ids=frozenset(),
            max_total_tokens=len(tokens) + 1,
            session_id=session_id,
            prefill_only=True,
        )

    @property
    def samples(self) -> bool:
        """True for a sequence that samples tokens (not a session refresh, not an embedding)."""
        return not self.prefill_only and self.pooled is None

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Length of prompt plus output."""
        return len(self.tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens that still need a forward pass before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    def num_exact_tokens(self, decoded_kv_exact: bool) -> int:
        """Leading tokens whose K/V in the cache are a prefill's: all computed ones where generated rows compute as
        prompt rows do (compute_path.decoded_kv_exact), else the prompt's."""
        return self.num_computed_tokens if decoded_kv_exact else min(self.num_computed_tokens, len(self.prompt_ids))

    @property
    def is_finished(self) -> bool:
        """True once generation has ended."""
        return self.status is SequenceStatus.FINISHED

    @property
    def output_ids(self) -> list[int]:
        """The generated token ids."""
        return self.tokens[len(self.prompt_ids) :]

    def may_stop(self) -> bool:
        """False while min_tokens keeps EOS and the stop tokens from being sampled."""
        return self.num_output_tokens >= self.params.min_tokens

    def ending_token_ids(self) -> frozenset[int]:
        """Token ids whose sampling ends the sequence: the stop tokens, and EOS unless it is ignored."""
        params = self.params
        return params.stop_token_ids if params.ignore_eos else params.stop_token_ids | self.eos_token_ids

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and finish the sequence if it ends generation.

        An EOS or stop token ends it as an ending token (not text); so do an EOS that completes the grammar and a
        token the grammar rejects. A token that completes the grammar or a loop ends it as the output's last token.
        """
        self.tokens.append(token_id)
        stop = None if self.guide is None else self.guide.observe(token_id)
        if token_id in self.ending_token_ids():
            self.ended_by_token = True
            self.finish(FinishReason.STOP)
        elif stop is not None:
            self.ended_by_token = stop is GuideStop.GRAMMAR_REJECTED or (
                stop is GuideStop.GRAMMAR_COMPLETE and token_id in self.eos_token_ids
            )
            self.repetition_detected = stop is GuideStop.REPETITION
            self.finish(FinishReason.STOP)
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_total_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        """Mark the sequence finished."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
