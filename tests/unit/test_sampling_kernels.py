"""The sampler's kernels: top_k (the candidates of top-k and top-p, logprobs' most likely tokens) gives torch.topk's
values in its order, equal values by lower id, NaNs first; inverse_cdf (a draw) finds where torch's cumulative sums
cross uniform * total; each row's result is the same in any batch and thread count."""

from __future__ import annotations

import math

import pytest
import torch

from statelm.engine.logits_processors import largest, sampling_kernels_take
from statelm.kernels.build import KernelBuildError, load_kernels
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)


def reference(row: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The k best of one row by the kernel's rule, sorted in Python: NaN first, larger first, lower id first."""
    values = row.tolist()

    def rank(i: int) -> tuple[bool, float, int]:
        nan = math.isnan(values[i])
        return not nan, 0.0 if nan else -values[i], i

    ranked = sorted(range(len(values)), key=rank)[:k]
    return [values[i] for i in ranked], ranked


@pytest.mark.parametrize("k", [1, 5, 64, 1000])
@pytest.mark.parametrize("vocab", [1000, 49_152])
def test_the_k_largest_are_torch_topk_values_in_order(vocab: int, k: int) -> None:
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 4
    values, ids = torch.ops.statelm.top_k(logits, k)
    expected = torch.topk(logits, k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and values.shape == ids.shape == (6, k)
    assert torch.equal(values, expected.values)
    assert torch.equal(ids, expected.indices)  # no equal values in random rows: the same ids
    assert torch.equal(logits.gather(1, ids), values)


@pytest.mark.invariance  # also under the capped classes: each has its own comparison of a block with the threshold
def test_equal_values_nans_and_masked_rows_follow_the_rule() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 3000, generator=generator)
    logits[0, [2900, 40, 1500, 7]] = 9.0  # ties at the top, read out of order
    logits[1] = torch.randint(0, 4, (3000,), generator=generator).float()  # every value tied many times over
    logits[2, [2999, 5, 600]] = float("nan")  # NaNs rank first, by id
    logits[3] = float("-inf")  # a row a grammar masked whole
    logits[4].fill_(float("-inf"))[[100, 2000]] = 1.0  # two tokens left
    logits[5] = float("nan")  # all NaN
    logits[6, 2990:] = 50.0  # the best values last, in the scalar tail
    for k in (1, 3, 4, 17, 3000):
        values, ids = torch.ops.statelm.top_k(logits, k)
        for row in range(logits.shape[0]):
            expected_values, expected_ids = reference(logits[row], k)
            assert ids[row].tolist() == expected_ids, (row, k)
            assert torch.equal(values[row], torch.tensor(expected_values)) or row in (2, 5), (row, k)
    assert torch.ops.statelm.top_k(logits, 3)[1][2].tolist() == [5, 600, 2999]


@pytest.mark.invariance
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_a_row_gets_the_same_candidates_in_any_batch_and_thread_count(threads: int) -> None:
    logits = torch.randn(20, 5000, generator=torch.Generator().manual_seed(3))
    logits[:, ::7] = 1.5  # ties
    alone = [torch.ops.statelm.top_k(logits[i : i + 1], 64) for i in range(20)]
    with kernel_threads(threads):
        values, ids = torch.ops.statelm.top_k(logits, 64)
        strided = torch.randn(20, 9000)[:, :5000]  # rows apart in memory
        strided.copy_(logits)
        strided_values, strided_ids = torch.ops.statelm.top_k(strided, 64)
    for row, (row_values, row_ids) in enumerate(alone):
        assert torch.equal(values[row], row_values[0]) and torch.equal(ids[row], row_ids[0])
        assert torch.equal(strided_values[row], row_values[0]) and torch.equal(strided_ids[row], row_ids[0])


def test_top_k_refuses_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match=r"k must be 1\.\.10"):
        torch.ops.statelm.top_k(torch.zeros(2, 10), 11)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.statelm.top_k(torch.zeros(2, 10, dtype=torch.float64), 3)


def test_largest_takes_the_kernel_for_float32_cpu_rows_and_torch_otherwise() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    for rows in (logits, logits.double()):
        values, ids = largest(rows, 10)
        assert torch.equal(values, torch.topk(rows, 10).values) and torch.equal(ids, torch.topk(rows, 10).indices)
    assert largest(logits, 0)[0].shape == (3, 0)  # logprobs without top_logprobs
    assert sampling_kernels_take(logits) and not sampling_kernels_take(logits.double())
    tied = torch.zeros(1, 500)  # every value equal: the kernel's rule, lower ids first
    assert largest(tied, 10)[1].tolist() == [list(range(10))]


def exact_probabilities(rows: int, n: int, seed: int) -> torch.Tensor:
    """Multiples of 1/1024 up to 7/1024: every partial sum is exact in float32, in any order of addition."""
    return torch.randint(0, 8, (rows, n), generator=torch.Generator().manual_seed(seed)).float() / 1024


@pytest.mark.parametrize("n", [1, 7, 256, 1000, 49_152])
def test_the_draw_falls_where_torch_cumulative_sums_cross(n: int) -> None:
    probs = exact_probabilities(9, n, n)
    uniforms = torch.rand(9, generator=torch.Generator().manual_seed(n))
    uniforms[0], uniforms[1] = 0.0, 0.999999
    positions, totals = torch.ops.statelm.inverse_cdf(probs, uniforms)
    cumulative = torch.cumsum(probs, dim=-1)
    expected = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert positions.dtype == torch.int64 and torch.equal(totals, cumulative[:, -1])
    valid = totals > 0
    assert torch.equal(positions[valid], expected[valid].clamp(max=n - 1))


def test_the_draw_skips_tokens_of_no_probability_and_reports_a_bad_total() -> None:
    probs = torch.zeros(4, 600)
    probs[0, [3, 590]] = 0.5
    probs[1, 599] = 1.0  # the whole mass on the last token, in the last (partial) chunk
    probs[2, 10] = float("nan")
    positions, totals = torch.ops.statelm.inverse_cdf(probs, torch.tensor([0.0, 0.0, 0.5, 0.5]))
    assert positions[:2].tolist() == [3, 599] and totals[:2].tolist() == [1.0, 1.0]
    assert totals[2].isnan() and totals[3] == 0.0  # the sampler fails these rows
    assert torch.ops.statelm.inverse_cdf(probs[:1], torch.tensor([0.75]))[0].tolist() == [590]


@pytest.mark.invariance
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_a_row_draws_the_same_position_in_any_batch_and_thread_count(threads: int) -> None:
    probs = torch.softmax(torch.randn(20, 5000, generator=torch.Generator().manual_seed(5)) * 3, dim=-1)
    uniforms = torch.rand(20, generator=torch.Generator().manual_seed(6))
    alone = [torch.ops.statelm.inverse_cdf(probs[i : i + 1], uniforms[i : i + 1]) for i in range(20)]
    with kernel_threads(threads):
        positions, totals = torch.ops.statelm.inverse_cdf(probs, uniforms)
        strided = torch.zeros(20, 9000)[:, :5000]  # rows apart in memory
        strided.copy_(probs)
        strided_positions, strided_totals = torch.ops.statelm.inverse_cdf(strided, uniforms)
    for row, (row_position, row_total) in enumerate(alone):
        assert positions[row] == row_position[0] and strided_positions[row] == row_position[0]
        assert torch.equal(totals[row : row + 1], row_total) and torch.equal(strided_totals[row : row + 1], row_total)


def test_the_draw_refuses_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="one uniform per row"):
        torch.ops.statelm.inverse_cdf(torch.ones(2, 10), torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.statelm.inverse_cdf(torch.ones(2, 10, dtype=torch.float64), torch.zeros(2))
