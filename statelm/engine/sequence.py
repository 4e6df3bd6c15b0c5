"""A request's token sequence as the engine tracks it, and the parameters that steer its sampling."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, already validated by the API layer."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0 or self.top_k == 1


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


@dataclass
class Sequence:
    """Prompt and generated token ids, the KV blocks that hold them and the sampling state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int
    session_id: str | None = None  # a session turn starts from, and parks its KV for, this session
    prefill_only: bool = False  # computes its tokens' K/V and ends without sampling (a session refresh)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks published so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    tokens: list[int] = field(init=False)  # prompt then output, the sequence's whole token list

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

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

    @property
    def is_finished(self) -> bool:
        """True once generation has ended."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and finish the sequence if it ends generation."""
        self.tokens.append(token_id)
        params = self.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish(FinishReason.STOP)
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_total_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        """Mark the sequence finished."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
