"""A sequence's output guide: its grammar, its reasoning budget and its repetition stop, followed token by token.

Each sequence with any of them owns one `OutputGuide`. Before a step the sampler asks it what to mask: the
token it forces (`forced_token`), else the grammar's allowed tokens (`matcher`, while `active`). After the
step the sequence hands it every output token (`observe`), which answers whether the guide ends the sequence.

The reasoning budget counts output tokens inside the think block; when it is spent and the model has not
closed the block, the end tag's ids are forced, once (only the rest of the tag if the model's last tokens
began it). A grammar that starts after that tag then constrains the answer only.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from statelm.engine.grammar import GrammarMatcher
from statelm.engine.repetition import RepetitionDetector

if TYPE_CHECKING:
    from statelm.engine.grammar import CompiledGrammar
    from statelm.engine.repetition import RepetitionConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningBudget:
    """At most `max_tokens` output tokens inside the think block `start_ids` … `end_ids`, then `end_ids` are forced.

    `start_ids` and `end_ids` are the encoded open and close tags. With `opened_by_prompt` the prompt ended by
    opening the block, so the output starts inside it; otherwise the block exists only if the output begins
    with `start_ids`. The tags do not count against the budget, but the first tokens of an end tag still being
    written do; when the budget runs out in the middle of one, only its rest is forced.
    """

    max_tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    opened_by_prompt: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("a reasoning budget needs max_tokens >= 0")
        if not self.end_ids:
            raise ValueError("a reasoning budget needs the end tag's token ids")
        if not self.opened_by_prompt and not self.start_ids:
            raise ValueError("a reasoning budget needs the start tag's token ids unless the prompt opened the block")


class GuidedParams(Protocol):
    """What a guide reads of a request's sampling parameters (SamplingParams has it)."""

    @property
    def grammar(self) -> CompiledGrammar | None:
        """The grammar the output must match."""
        ...

    @property
    def grammar_start_after(self) -> tuple[int, ...]:
        """Output ids after which the grammar starts."""
        ...

    @property
    def reasoning(self) -> ReasoningBudget | None:
        """The think block's budget."""
        ...

    @property
    def repetition(self) -> RepetitionConfig | None:
        """When a loop in the output ends it."""
        ...


class GuideStop(enum.Enum):
    """Why a guide ends its sequence."""

    GRAMMAR_COMPLETE = "grammar_complete"  # the output matches and the grammar allows nothing more
    GRAMMAR_REJECTED = "grammar_rejected"  # the token breaks the grammar (a forced token it forbids)
    REPETITION = "repetition"  # the output's tail is a loop


class _Block(enum.Enum):
    UNDECIDED = "undecided"  # the output so far is a prefix of the start tag
    OPEN = "open"
    CLOSED = "closed"  # closed by its end tag, or never opened


class _ReasoningBlock:
    """Where the output stands relative to its think block, and the tokens spent inside it."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.state = _Block.OPEN if budget.opened_by_prompt else _Block.UNDECIDED
        self.spent = 0  # tokens inside the open block, a partly written end tag included
        self._tail: tuple[int, ...] = ()  # the start tag matched so far, then the last tokens inside the block
        self._end_forced = False

    def observe(self, token_id: int) -> None:
        """Follow one output token."""
        if self.state is _Block.UNDECIDED:
            if token_id != self.budget.start_ids[len(self._tail)]:
                self.state = _Block.CLOSED
                return
            self._tail = (*self._tail, token_id)
            if self._tail == self.budget.start_ids:
                self.state, self._tail = _Block.OPEN, ()
        elif self.state is _Block.OPEN:
            self._tail = (*self._tail, token_id)[-len(self.budget.end_ids) :]
            if self._tail == self.budget.end_ids:
                self.state = _Block.CLOSED
            else:
                self.spent += 1

    def take_forced_end(self) -> tuple[int, ...]:
        """The end tag's ids to force now that the budget is spent (once), without the part the model began."""
        if self.state is not _Block.OPEN or self._end_forced or self.spent < self.budget.max_tokens:
            return ()
        self._end_forced = True
        end = self.budget.end_ids
        begun = next((k for k in range(min(len(self._tail), len(end) - 1), 0, -1) if self._tail[-k:] == end[:k]), 0)
        return end[begun:]


class OutputGuide:
    """One sequence's constraints on its output: grammar matcher, reasoning budget, forced tokens, loop detector."""

    def __init__(self, params: GuidedParams) -> None:
        grammar = params.grammar
        self.matcher = None if grammar is None else GrammarMatcher(grammar, start_after=params.grammar_start_after)
        self._reasoning = None if params.reasoning is None else _ReasoningBlock(params.reasoning)
        self._detector = None if params.repetition is None else RepetitionDetector(params.repetition)
        self._forced: deque[int] = deque()
        self._force_end_if_due()

    @classmethod
    def for_params(cls, params: GuidedParams) -> OutputGuide | None:
        """A guide if the parameters ask for a grammar, a reasoning budget or repetition detection, else None."""
        wanted = params.grammar is not None or params.reasoning is not None or params.repetition is not None
        return cls(params) if wanted else None

    @property
    def forced_token(self) -> int | None:
        """The token the next step must produce, if one is forced."""
        return self._forced[0] if self._forced else None

    @property
    def constrains(self) -> bool:
        """True when the next token is masked: a token is forced or the grammar is active."""
        return bool(self._forced) or (self.matcher is not None and self.matcher.active)

    def observe(self, token_id: int) -> GuideStop | None:
        """Follow one output token (sampled or forced); return why the sequence must end here, if it must."""
        if self._forced and self._forced[0] == token_id:
            self._forced.popleft()
        if self._reasoning is not None:
            self._reasoning.observe(token_id)
            self._force_end_if_due()
        if self.matcher is not None:
            if not self.matcher.accept(token_id):
                log.warning("output token %d breaks the grammar, ending the sequence: %s", token_id, self.matcher.error)
                return GuideStop.GRAMMAR_REJECTED
            if self.matcher.is_terminated():
                return GuideStop.GRAMMAR_COMPLETE
        if self._detector is not None and self._detector.add(token_id) is not None:
            return GuideStop.REPETITION
        return None

    def _force_end_if_due(self) -> None:
        if self._reasoning is not None:
            self._forced.extend(self._reasoning.take_forced_end())
