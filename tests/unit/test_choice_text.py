"""One choice's tokens to text: stop strings after min_tokens, the ending token left out, logprobs aligned to text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from statelm.api.generation import ChoiceText, TextDelta
from statelm.engine.client import RequestOutput
from statelm.engine.sampler import TokenLogprob
from statelm.engine.sequence import FinishReason
from statelm.tokenizer import Tokenizer

TEXT = "héllo wörld 😀 STOP and then more"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE too small to hold ö or the emoji whole, so they are split across tokens."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>"], initial_alphabet=alphabet)
    backend.train_from_iterator(["hello world and then more STOP"] * 20, trainer)
    return Tokenizer(backend, eos_token="<eos>")


def run(
    tokenizer: Tokenizer, ids: list[int], stops: list[str], min_tokens: int = 0, ending: bool = False
) -> list[TextDelta]:
    """Feed ids one step at a time; the last one ends the choice (as EOS when ending, else by length)."""
    choice = ChoiceText(tokenizer, stops, min_tokens, align_to_tokens=True)
    deltas = []
    for position, token_id in enumerate(ids):
        last = position == len(ids) - 1
        reason = (FinishReason.STOP if ending else FinishReason.LENGTH) if last else None
        logprob = TokenLogprob(token_id, -0.5, ())
        output = RequestOutput("r", [token_id], last, reason, 3, 0, logprobs=[logprob], ended_by_token=last and ending)
        deltas.append(choice.add(output))
        if choice.finish_reason is not None:
            break
    return deltas


def joined(deltas: list[TextDelta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t.logprob.token_id for d in deltas for t in d.tokens]


def test_without_stops_every_token_is_reported_in_order(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= 20
    deltas = run(tokenizer, ids, [])
    text, reported = joined(deltas)
    assert text == TEXT and reported == ids and deltas[-1].finish_reason == "length"
    offsets = [t.offset for d in deltas for t in d.tokens]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert b"".join(tokenizer.token_bytes(i) for i in reported) == TEXT.encode()


@pytest.mark.parametrize("stop", ["STOP", "ö", "😀 S", "rld 😀", "more"])
def test_a_stop_string_cuts_text_and_tokens(tokenizer: Tokenizer, stop: str) -> None:
    ids = tokenizer.encode(TEXT)
    deltas = run(tokenizer, ids, [stop])
    text, reported = joined(deltas)
    assert text == TEXT[: TEXT.index(stop)] and deltas[-1].finish_reason == "stop"
    needed = next(k for k in range(len(ids) + 1) if tokenizer.decode(ids[:k]).startswith(text))
    assert reported == ids[:needed]  # exactly the tokens whose text is (at least partly) in the reply


def test_the_ending_token_is_not_part_of_the_reply(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world")
    eos = tokenizer.token_to_id("<eos>")
    deltas = run(tokenizer, [*ids, eos], [], ending=True)
    assert joined(deltas) == ("hello world", ids) and deltas[-1].finish_reason == "stop"


def test_stop_strings_count_only_after_min_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello STOP world STOP more")
    early = len(tokenizer.encode("hello STOP"))
    text, _ = joined(run(tokenizer, ids, ["STOP"], min_tokens=early))
    assert text == "hello STOP world "


@pytest.mark.parametrize("stop", [None, "STOP", "😀 S", "more"])
def test_each_delta_carries_exactly_its_tokens(tokenizer: Tokenizer, stop: str | None) -> None:
    ids = tokenizer.encode(TEXT)
    deltas = run(tokenizer, ids, [stop] if stop else [])
    aligned = deltas[:-1] if stop else deltas  # the last delta before a stop string may hold more than its text
    for delta in aligned:
        assert b"".join(tokenizer.token_bytes(t.logprob.token_id) for t in delta.tokens) == delta.text.encode()
    assert any(len(delta.tokens) > 1 for delta in deltas)  # the split characters went out with their tokens


@pytest.mark.parametrize("stop", [None, "STOP", "ö", "more"])
def test_outputs_of_several_tokens_give_what_one_at_a_time_gives(tokenizer: Tokenizer, stop: str | None) -> None:
    """A verified draft's tokens come in one output: a stop string among them ends the reply where it would have, and
    the tokens after it are not the reply's (nor counted)."""
    ids = tokenizer.encode(TEXT)
    stops = [stop] if stop else []
    by_one = run(tokenizer, ids, stops)
    several = ChoiceText(tokenizer, stops, 0, align_to_tokens=True)
    deltas = []
    for start in range(0, len(ids), 3):
        group = ids[start : start + 3]
        last = start + 3 >= len(ids)
        logprobs = [TokenLogprob(token_id, -0.5, ()) for token_id in group]
        output = RequestOutput("r", group, last, FinishReason.LENGTH if last else None, 3, 0, logprobs=logprobs)
        deltas.append(several.add(output))
        if several.finish_reason is not None:
            break
    assert joined(deltas) == joined(by_one) and deltas[-1].finish_reason == by_one[-1].finish_reason
    assert deltas[-1].token_ids == by_one[-1].token_ids
