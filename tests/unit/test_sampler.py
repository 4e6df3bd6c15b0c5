"""Sampler: greedy, top-k, top-p, per-sequence seeded generators."""

from __future__ import annotations

import torch

from statelm.engine.sampler import make_generator, sample
from statelm.engine.sequence import SamplingParams, Sequence


def seq_with(params: SamplingParams, seed: int | None = None) -> Sequence:
    generator = None if params.greedy else make_generator(seed, torch.device("cpu"))
    return Sequence("r", [1], params, frozenset(), 100, generator=generator)


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    seqs = [seq_with(SamplingParams(temperature=0.0)), seq_with(SamplingParams(top_k=1))]
    assert sample(logits, seqs) == [1, 0]


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = [sample(logits, [seq_with(SamplingParams(top_k=2), seed)])[0] for seed in range(200)]
    assert set(top_k) == {0, 1}
    top_p = [sample(logits, [seq_with(SamplingParams(top_p=0.7), seed)])[0] for seed in range(200)]
    assert set(top_p) == {0, 1}
    free = [sample(logits, [seq_with(SamplingParams(), seed)])[0] for seed in range(400)]
    assert set(free) == {0, 1, 2, 3}


def test_same_seed_same_tokens_regardless_of_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.5)
    alone = seq_with(params, 42)
    draws_alone = [sample(logits, [alone])[0] for _ in range(8)]
    batched, neighbour = seq_with(params, 42), seq_with(params, 7)
    batch = torch.cat([torch.randn(1, 50), logits])
    draws_batched = [sample(batch, [neighbour, batched])[1] for _ in range(8)]
    assert draws_batched == draws_alone
    other = seq_with(params, 43)
    assert [sample(logits, [other])[0] for _ in range(8)] != draws_alone
