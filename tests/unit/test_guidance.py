"""Output guides: the reasoning budget's state machine, forced tokens, grammar completion and the loop stop."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from statelm.engine.grammar import GrammarBackend
from statelm.engine.guidance import GuideStop, OutputGuide, ReasoningBudget
from statelm.engine.repetition import RepetitionConfig
from statelm.engine.sampler import make_generator, sample
from statelm.engine.sequence import FinishReason, SamplingParams, Sequence
from statelm.tokenizer import Tokenizer

START, END = (1, 2), (8, 9)  # a two-token think open tag and close tag
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # the fixture vocabulary: one token per byte, then <eos>
EOS = len(ALPHABET)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    """llguidance over a byte-level tokenizer with one token per byte and an `<eos>` special."""
    model = BackendTokenizer(models.BPE(vocab={char: i for i, char in enumerate(ALPHABET)}, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([AddedToken("<eos>", special=True)])
    return GrammarBackend(Tokenizer(model, eos_token="<eos>"))


def byte_ids(text: str) -> list[int]:
    """Token ids of printable ASCII text in the fixture vocabulary."""
    return [ALPHABET.index(char) for char in text]


def guide(**fields: object) -> OutputGuide:
    found = OutputGuide.for_params(SamplingParams(**fields))  # type: ignore[arg-type]
    assert found is not None
    return found


def forced_after(g: OutputGuide, tokens: list[int]) -> list[int | None]:
    """Feed the tokens; the forced token after each."""
    forced = []
    for token in tokens:
        assert g.observe(token) is None
        forced.append(g.forced_token)
    return forced


def test_no_guide_without_guidance_and_none_for_a_refresh() -> None:
    assert OutputGuide.for_params(SamplingParams()) is None
    params = SamplingParams(repetition=RepetitionConfig())
    assert Sequence("r", [1], params, frozenset({0}), 100).guide is not None
    assert Sequence("r", [1], params, frozenset({0}), 100, prefill_only=True).guide is None


def test_budget_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        ReasoningBudget(-1, START, END)
    with pytest.raises(ValueError, match="end tag"):
        ReasoningBudget(3, START, ())
    with pytest.raises(ValueError, match="start tag"):
        ReasoningBudget(3, (), END)
    ReasoningBudget(3, (), END, opened_by_prompt=True)


def test_budget_opened_by_the_prompt_forces_the_end_tag_once() -> None:
    g = guide(reasoning=ReasoningBudget(3, START, END, opened_by_prompt=True))
    assert g.forced_token is None and not g.constrains
    assert forced_after(g, [20, 21, 22]) == [None, None, 8]
    assert g.constrains
    assert forced_after(g, [8, 9]) == [9, None]
    assert forced_after(g, [20] * 10 + [*START, 30, 31, 32, 33]) == [None] * 16  # closed: never forced again


def test_budget_opened_by_the_output_start_tag_does_not_count_the_tags() -> None:
    g = guide(reasoning=ReasoningBudget(2, START, END))
    assert forced_after(g, [*START, 20, 21, 8, 9, 40]) == [None, None, None, 8, 9, None, None]


def test_budget_without_the_start_tag_does_nothing() -> None:
    g = guide(reasoning=ReasoningBudget(1, START, END))
    assert forced_after(g, [1, 7, 20, 21, *START, 22, 23]) == [None] * 8  # the tag must begin the output
    assert forced_after(guide(reasoning=ReasoningBudget(0, START, END)), [5, 1, 2, 3]) == [None] * 4


def test_budget_closed_by_the_model_in_time_is_not_forced() -> None:
    g = guide(reasoning=ReasoningBudget(5, START, END, opened_by_prompt=True))
    assert forced_after(g, [20, 8, 21, 8, 9]) == [None] * 5  # a lone 8 is not the tag; 8 9 closes it
    assert forced_after(g, [30] * 10) == [None] * 10


def test_budget_spent_inside_an_end_tag_forces_only_its_rest() -> None:
    g = guide(reasoning=ReasoningBudget(4, START, END, opened_by_prompt=True))
    assert forced_after(g, [20, 8, 21, 8, 9, 30]) == [None, None, None, 9, None, None]


def test_budget_zero_forces_from_the_first_token() -> None:
    g = guide(reasoning=ReasoningBudget(0, START, END, opened_by_prompt=True))
    assert g.forced_token == 8 and g.constrains
    assert forced_after(g, [8, 9, 20, 21]) == [9, None, None, None]
    g = guide(reasoning=ReasoningBudget(0, START, END))
    assert forced_after(g, [*START, *END, 20]) == [None, 8, 9, None, None]


def test_a_forced_token_masks_everything_else_and_other_rows_are_untouched() -> None:
    budget = ReasoningBudget(0, START, END, opened_by_prompt=True)
    plain = SamplingParams(temperature=0.8, logprobs=2)
    forced = SamplingParams(temperature=0.8, logprobs=2, reasoning=budget, logit_bias={3: 100.0})
    seqs = [
        Sequence("a", [1], plain, frozenset({0}), 100, generator=make_generator(5, CPU)),
        Sequence("b", [1], forced, frozenset({0}), 100, generator=make_generator(5, CPU)),
    ]
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    together = sample(logits, seqs)
    assert together[1].token_id == 8 and together[1].logprob is not None and together[1].logprob.logprob == 0.0
    alone = sample(logits[:1], [Sequence("a", [1], plain, frozenset({0}), 100, generator=make_generator(5, CPU))])
    assert together[0] == alone[0]


def test_grammar_ends_the_sequence_with_its_last_token_as_text(backend: GrammarBackend) -> None:
    params = SamplingParams(grammar=backend.compile("regex", "ab"), max_tokens=10)
    seq = Sequence("r", [1], params, frozenset({EOS}), 100)
    assert seq.guide is not None and seq.guide.constrains
    for token in byte_ids("ab"):
        assert not seq.is_finished
        seq.append_token(token)
    assert seq.finish_reason is FinishReason.STOP and not seq.ended_by_token and not seq.repetition_detected


def test_grammar_mask_allows_only_what_the_grammar_does(backend: GrammarBackend) -> None:
    params = SamplingParams(temperature=0.0, grammar=backend.compile("regex", "[bc]+"))
    seq = Sequence("r", [1], params, frozenset({EOS}), 100)
    logits = torch.zeros(1, 300)  # wider than the vocabulary: padding columns are never allowed
    logits[0, byte_ids("a")[0]] = 5.0
    logits[0, 280] = 9.0
    logits[0, byte_ids("c")[0]] = 1.0
    assert sample(logits, [seq])[0].token_id == byte_ids("c")[0]
    seq.append_token(byte_ids("c")[0])
    logits[0, EOS] = 2.0  # the grammar allows EOS once it matches
    assert sample(logits, [seq])[0].token_id == EOS


def test_an_eos_that_completes_the_grammar_is_an_ending_token_even_with_ignore_eos(backend: GrammarBackend) -> None:
    params = SamplingParams(grammar=backend.compile("regex", "a+"), ignore_eos=True)
    seq = Sequence("r", [1], params, frozenset({EOS}), 100)
    seq.append_token(byte_ids("a")[0])
    seq.append_token(EOS)
    assert seq.finish_reason is FinishReason.STOP and seq.ended_by_token


def test_a_token_the_grammar_rejects_ends_the_sequence(
    backend: GrammarBackend, caplog: pytest.LogCaptureFixture
) -> None:
    seq = Sequence("r", [1], SamplingParams(grammar=backend.compile("regex", "ab")), frozenset({EOS}), 100)
    with caplog.at_level(logging.WARNING, logger="statelm.engine.guidance"):
        seq.append_token(byte_ids("b")[0])
    assert seq.finish_reason is FinishReason.STOP and seq.ended_by_token
    assert "breaks the grammar" in caplog.text


def test_grammar_after_the_reasoning_end_tag_constrains_only_the_answer(backend: GrammarBackend) -> None:
    end = tuple(byte_ids("</"))
    budget = ReasoningBudget(2, (), end, opened_by_prompt=True)
    g = guide(grammar=backend.compile("regex", "x"), grammar_start_after=end, reasoning=budget)
    assert g.matcher is not None and not g.constrains
    assert g.observe(byte_ids("q")[0]) is None and not g.constrains
    assert g.observe(byte_ids("r")[0]) is None and g.forced_token == end[0]
    assert g.observe(end[0]) is None and g.forced_token == end[1]
    assert g.observe(end[1]) is None and g.forced_token is None and g.matcher.active
    assert g.observe(byte_ids("x")[0]) is GuideStop.GRAMMAR_COMPLETE


def test_a_loop_ends_the_sequence_and_is_flagged() -> None:
    config = RepetitionConfig(min_period=1, max_period=4, min_repeats=3, min_tokens=6)
    seq = Sequence("r", [1], SamplingParams(repetition=config, max_tokens=100), frozenset({0}), 1000)
    for token in [5, 6, 7, 6, 7, 6, 7]:
        assert not seq.is_finished
        seq.append_token(token)
    assert seq.finish_reason is FinishReason.STOP and seq.repetition_detected and not seq.ended_by_token
    assert seq.output_ids == [5, 6, 7, 6, 7, 6, 7]


def test_eos_still_ends_a_guided_sequence_as_an_ending_token() -> None:
    seq = Sequence("r", [1], SamplingParams(repetition=RepetitionConfig()), frozenset({0}), 100)
    seq.append_token(4)
    seq.append_token(0)
    assert seq.finish_reason is FinishReason.STOP and seq.ended_by_token and not seq.repetition_detected
