"""Sampler: greedy, top-k, top-p, min-p, the logit processors, logprobs, seeds and per-row failures."""

from __future__ import annotations

import math
import random

import pytest
import torch

from statelm.engine.logits_processors import apply_min_p
from statelm.engine.sampler import make_generator, most_likely, sample
from statelm.engine.sequence import SamplingParams, Sequence

EOS = 3


def seq_with(params: SamplingParams, seed: int | None = None, output: tuple[int, ...] = ()) -> Sequence:
    generator = None if params.greedy or seed is None else make_generator(seed, torch.device("cpu"))
    seq = Sequence("r", [1], params, frozenset({EOS}), 100, generator=generator)
    seq.tokens.extend(output)
    return seq


def tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    outcomes = sample(logits, seqs)
    assert all(outcome.error is None for outcome in outcomes)
    return [outcome.token_id for outcome in outcomes]


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    seqs = [seq_with(SamplingParams(temperature=0.0)), seq_with(SamplingParams(top_k=1))]
    assert tokens(logits, seqs) == [1, 0]
    assert sample(torch.empty(0, 3), []) == []  # a step that only prefills


def test_the_most_likely_token_is_the_one_torch_argmax_picks() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 49_152, generator=generator)
    logits[1, [7, 300, 40_000]] = 50.0  # ties: the first
    logits[2] = float("-inf")  # nothing finite: the first
    logits[3, [9, 20_000]] = float("nan")  # a NaN counts as the largest: the first
    logits[4, 49_151] = 60.0  # the last
    logits[5] = 0.0
    for rows in (logits, logits[1:2], logits[::3], logits[:, :1000]):
        chosen = most_likely(rows)
        assert chosen.dtype == torch.int64
        assert chosen.tolist() == rows.argmax(dim=-1).tolist()
    assert most_likely(logits).tolist()[1:6] == [7, 0, 9, 49_151, 0]
    assert most_likely(logits.double()).tolist() == logits.argmax(dim=-1).tolist()  # other dtypes: torch's own


def test_top_k_top_p_and_min_p_restrict_the_candidates() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def draws(params: SamplingParams, count: int = 200) -> set[int]:
        return {tokens(logits, [seq_with(params, seed)])[0] for seed in range(count)}

    assert draws(SamplingParams(top_k=2)) == {0, 1}
    assert draws(SamplingParams(top_p=0.7)) == {0, 1}
    assert draws(SamplingParams(min_p=0.5)) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert draws(SamplingParams(), 400) == {0, 1, 2, 3}


def test_a_nucleus_wider_than_the_candidates_is_whole() -> None:
    logits = -torch.arange(3000, dtype=torch.float32).unsqueeze(0) * 1e-4  # nearly flat, most likely first
    probs = torch.softmax(logits[0], dim=-1)
    nucleus = int((torch.cumsum(probs, dim=0) - probs < 0.9).sum())
    assert nucleus > 2 * 1024
    draws = [tokens(logits, [seq_with(SamplingParams(top_p=0.9), seed)])[0] for seed in range(200)]
    assert max(draws) < nucleus and max(draws) >= 1024


def test_logit_bias_forces_a_token_and_min_tokens_masks_eos() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    assert tokens(logits, [seq_with(SamplingParams(temperature=0.0))]) == [EOS]
    assert tokens(logits, [seq_with(SamplingParams(temperature=0.0, logit_bias={0: 100.0}))]) == [0]
    assert tokens(logits, [seq_with(SamplingParams(temperature=0.0, min_tokens=1))]) == [2]
    stop_token = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=frozenset({2}))
    assert tokens(logits, [seq_with(stop_token, output=(1,))]) == [1]
    assert tokens(logits, [seq_with(stop_token, output=(1, 1))]) == [EOS]  # min_tokens reached


def test_penalties_steer_away_from_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -5.0, 1.9, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert tokens(logits, [seq_with(greedy, output=(0,))]) == [0]
    for penalized in (
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ):
        assert tokens(logits, [seq_with(penalized, output=(0,))]) == [2]
    outside_window = SamplingParams(temperature=0.0, repetition_penalty=1.2, repetition_penalty_range=1)
    assert tokens(logits, [seq_with(outside_window, output=(0, 1))]) == [0]  # token 0 is out of the last 1


def test_logprobs_of_the_processed_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = SamplingParams(temperature=0.7, seed=1, logprobs=2, logit_bias={0: 5.0})
    (outcome,) = sample(logits, [seq_with(params, 1)])
    assert outcome.logprob is not None
    reference = torch.log_softmax(torch.tensor([6.0, 2.0, 3.0, 0.5]), dim=-1)  # bias applied, no temperature
    assert outcome.logprob.token_id == outcome.token_id
    assert math.isclose(outcome.logprob.logprob, reference[outcome.token_id].item(), rel_tol=1e-5)
    assert [token for token, _ in outcome.logprob.top] == [0, 2]
    assert sample(logits, [seq_with(SamplingParams(temperature=0.0))])[0].logprob is None
    zero = sample(logits, [seq_with(SamplingParams(temperature=0.0, logprobs=0))])[0].logprob
    assert zero is not None and zero.top == ()


def test_a_failing_row_fails_alone() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5], [0.0, 1.0, 2.0, 0.5]])
    good = seq_with(SamplingParams(temperature=0.0, logit_bias={1: 10.0}))
    bad = seq_with(SamplingParams(temperature=0.0, logit_bias={99: 1.0}))
    outcomes = sample(logits, [good, bad])
    assert outcomes[0].error is None and outcomes[0].token_id == 1
    assert outcomes[1].error is not None and "outside the vocabulary" in outcomes[1].error
    nan = seq_with(SamplingParams(temperature=1.0), 0)
    outcomes = sample(torch.tensor([[0.0, 1.0, 2.0, 0.5], [float("nan")] * 4]), [good, nan])
    assert outcomes[0].token_id == 1 and outcomes[1].error is not None


def test_same_seed_same_tokens_regardless_of_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.5, min_p=0.01, presence_penalty=0.3, logprobs=3)
    alone = seq_with(params, 42, output=(5, 6))
    draws_alone = [sample(logits, [alone])[0] for _ in range(8)]
    batched, neighbour = seq_with(params, 42, output=(5, 6)), seq_with(SamplingParams(repetition_penalty=1.5), 7)
    batch = torch.cat([torch.randn(1, 50), logits])
    draws_batched = [sample(batch, [neighbour, batched])[1] for _ in range(8)]
    assert draws_batched == draws_alone
    other = seq_with(params, 43, output=(5, 6))
    assert [sample(logits, [other])[0].token_id for _ in range(8)] != [draw.token_id for draw in draws_alone]


def reference_draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampler's draw before it was batched: one row at a time, top-p among 1024 candidates, then all."""
    scaled = (logits / params.temperature).unsqueeze(0)
    if params.min_p > 0.0:
        apply_min_p(scaled, torch.tensor([params.min_p]))
    scaled = scaled.squeeze(0)
    if params.top_k > 0:
        values, candidates = torch.topk(scaled, min(params.top_k, scaled.numel()))
        probs = torch.softmax(values, dim=-1)
    else:
        full = torch.softmax(scaled, dim=-1)
        probs, candidates = full, None
        if params.top_p < 1.0:
            probs, candidates = torch.topk(full, min(1024, full.numel()))
            if float(probs.sum()) < params.top_p:
                probs, candidates = torch.sort(full, descending=True)
    if params.top_p < 1.0:
        outside = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        outside[0] = False
        probs = probs.masked_fill(outside, 0.0)
    cumulative = torch.cumsum(probs, dim=-1)
    threshold = torch.rand(1, generator=generator) * float(cumulative[-1])
    position = int(torch.searchsorted(cumulative, threshold, right=True).clamp_(max=probs.numel() - 1))
    return position if candidates is None else int(candidates[position])


def random_params(rng: random.Random, top_ks: list[int]) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice(top_ks),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.95, 0.99]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
    )


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from peaked to nearly flat, so top-p nuclei range from one token to more than 1024."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 1.0, 2.0, 3.0, 8.0]).repeat(rows)[:rows].unsqueeze(1)
    return torch.randn(rows, vocab, generator=generator) * scale


@pytest.mark.parametrize("top_ks", [[0, 0, 0, 1, 3, 8, 40], [0, 0, 0, 1, 40, 1500]])  # top-p from 64 or 1500 tokens
def test_the_batched_draw_picks_what_the_row_by_row_draw_picked(top_ks: list[int]) -> None:
    rng = random.Random(len(top_ks))
    vocab, rows, steps = 4096, 80, 6
    params = [random_params(rng, top_ks) for _ in range(rows)]
    seeds = [rng.randrange(2**32) for _ in range(rows)]
    seqs = [seq_with(p, seed) for p, seed in zip(params, seeds, strict=True)]
    references = [make_generator(seed, torch.device("cpu")) for seed in seeds]
    compared = 0
    for step in range(steps):
        logits = random_logits(rows, vocab, step)
        expected = [
            int(logits[row].argmax()) if p.greedy else reference_draw(logits[row], p, references[row])
            for row, p in enumerate(params)
        ]
        assert tokens(logits, seqs) == expected
        compared += rows
    assert compared == rows * steps
    assert {p.top_p for p in params if not p.greedy} >= {1.0, 0.5, 0.9, 0.99}  # the settings were mixed


@pytest.mark.parametrize("position", [7, 9])  # nearly flat logits (a nucleus wider than the candidates), peaked ones
def test_a_seeded_row_draws_the_same_alone_or_among_fifteen_others(position: int) -> None:
    rng = random.Random(position)
    vocab, steps = 49_152, 5
    params = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=40, top_p=0.8),
        SamplingParams(temperature=0.5, min_p=0.1, presence_penalty=0.5),
        SamplingParams(temperature=2.0, top_k=5000),
    ]
    alone = seq_with(params, 1234)
    together = seq_with(params, 1234)
    neighbours = [seq_with(rng.choice(others), rng.choice([None, row])) for row in range(15)]
    batch = [*neighbours[:position], together, *neighbours[position:]]
    for step in range(steps):
        logits = random_logits(len(batch), vocab, 100 + step)
        assert tokens(logits[position : position + 1].clone(), [alone]) == [tokens(logits, batch)[position]]


def test_unseeded_rows_draw_from_the_shared_generator() -> None:
    logits = torch.zeros(64, 1000)  # flat: every row may take any token
    seqs = [seq_with(SamplingParams(top_p=0.9)) for _ in range(64)]
    first = tokens(logits, seqs)
    assert len(set(first)) > 32  # each row has its own number
    again = [sample(logits, seqs, make_generator(7, torch.device("cpu"))) for _ in range(2)]
    assert again[0] == again[1] and [outcome.token_id for outcome in again[0]] != first
