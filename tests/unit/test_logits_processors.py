"""Batched logit transforms against per-element reference computations; rows never affect each other."""

from __future__ import annotations

import math

import pytest
import torch

from statelm.engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    token_counts,
    token_logprobs,
)

VOCAB = 50
CPU = torch.device("cpu")


@pytest.fixture
def logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, VOCAB, generator=generator) * 3


HISTORIES = [[1, 2, 2, 7, 7, 7], [], [49, 0, 49], [3] * 10]


def test_token_counts() -> None:
    counts = token_counts(HISTORIES, VOCAB, CPU)
    assert counts.shape == (4, VOCAB) and counts.dtype == torch.int32
    for row, history in enumerate(HISTORIES):
        assert counts[row].tolist() == [history.count(token) for token in range(VOCAB)]
    assert token_counts([], VOCAB, CPU).shape == (0, VOCAB)


def test_repetition_penalty_follows_hf(logits: torch.Tensor) -> None:
    penalty = torch.tensor([1.3, 2.0, 1.0, 0.8])
    windows = [history[-3:] for history in HISTORIES]  # a trailing window is just a shorter list
    expected = logits.clone()
    for row, window in enumerate(windows):
        for token in set(window):
            value = expected[row, token].item()
            expected[row, token] = value / penalty[row] if value > 0 else value * penalty[row]
    apply_repetition_penalty(logits, token_counts(windows, VOCAB, CPU), penalty)
    assert torch.allclose(logits, expected)


def test_presence_and_frequency_penalties_follow_openai(logits: torch.Tensor) -> None:
    presence = torch.tensor([0.5, 1.0, -0.5, 0.0])
    frequency = torch.tensor([0.25, 0.0, 1.0, 2.0])
    expected = logits.clone()
    for row, history in enumerate(HISTORIES):
        for token in set(history):
            expected[row, token] -= history.count(token) * frequency[row] + presence[row]
    apply_presence_frequency_penalties(logits, token_counts(HISTORIES, VOCAB, CPU), presence, frequency)
    assert torch.allclose(logits, expected)


def test_logit_bias_is_clamped_and_checked(logits: torch.Tensor) -> None:
    biases = [{3: 5.0, 4: -250.0}, None, {}, {0: 100.0, 49: -1.5}]
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[row, token] += max(-100.0, min(100.0, value))
    apply_logit_bias(logits, biases)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_logit_bias(logits, [{VOCAB: 1.0}])


def test_min_p_keeps_tokens_within_a_fraction_of_the_top(logits: torch.Tensor) -> None:
    min_p = torch.tensor([0.05, 0.0, 0.5, 1.0])
    probs = torch.softmax(logits, dim=-1)
    original = logits.clone()
    apply_min_p(logits, min_p)
    for row in range(4):
        keep = probs[row] >= min_p[row] * probs[row].max()
        assert torch.equal(torch.isfinite(logits[row]), keep)
        assert torch.equal(logits[row][keep], original[row][keep])
    assert torch.isfinite(logits[1]).all()  # 0 = off
    assert torch.isfinite(logits[3]).sum() == 1  # 1 = greedy


def test_logprobs_of_chosen_and_top_tokens(logits: torch.Tensor) -> None:
    logits[2, 5:] = float("-inf")  # e.g. masked by a grammar
    chosen = torch.tensor([0, 17, 3, 49])
    result = token_logprobs(logits, chosen, num_top=7)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row in range(4):
        assert math.isclose(result.chosen[row].item(), reference[row, chosen[row]].item(), rel_tol=1e-5)
        order = torch.argsort(reference[row], descending=True, stable=True)[:7]
        assert result.top_ids[row].tolist()[:5] == order.tolist()[:5]
        assert torch.allclose(result.top_logprobs[row], reference[row, result.top_ids[row]].float().clamp(min=-9999.0))
    assert result.top_logprobs[2, 5:].tolist() == [-9999.0, -9999.0]  # never -inf: JSON cannot carry it
    assert result.top_ids.shape == (4, 7) and token_logprobs(logits, chosen, 0).top_ids.shape == (4, 0)


def test_rows_are_independent_of_their_batch(logits: torch.Tensor) -> None:
    """Each transform gives a row the same bits alone as in a batch, and neutral parameters change nothing."""
    counts = token_counts(HISTORIES, VOCAB, CPU)
    params = {
        "rep": torch.tensor([1.3, 1.0, 1.0, 0.8]),
        "presence": torch.tensor([0.5, 0.0, 0.0, 1.0]),
        "frequency": torch.tensor([0.2, 0.0, 0.0, 0.7]),
        "min_p": torch.tensor([0.1, 0.0, 0.0, 0.3]),
    }
    biases = [{1: 2.0}, None, None, {2: -3.0}]

    def process(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
        rows = rows.clone()
        apply_logit_bias(rows, [biases[i] for i in index])
        apply_repetition_penalty(rows, counts[index], params["rep"][index])
        apply_presence_frequency_penalties(rows, counts[index], params["presence"][index], params["frequency"][index])
        apply_min_p(rows, params["min_p"][index])
        return rows

    batch = process(logits, [0, 1, 2, 3])
    for row in range(4):
        assert torch.equal(process(logits[row : row + 1], [row])[0], batch[row])
    assert torch.equal(batch[1], logits[1]) and torch.equal(batch[2], logits[2])
    logprobs = token_logprobs(logits, torch.tensor([1, 2, 3, 4]), 5)
    for row in range(4):
        alone = token_logprobs(logits[row : row + 1], torch.tensor([row + 1]), 5)
        assert torch.equal(alone.chosen[0], logprobs.chosen[row]) and torch.equal(
            alone.top_ids[0], logprobs.top_ids[row]
        )
