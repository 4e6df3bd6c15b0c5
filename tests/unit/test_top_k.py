"""top_k (the sampler's candidates and logprobs' most likely tokens on the kernels path): torch.topk's values in
its order, equal values by lower id, NaNs first, and a row's result the same in any batch and thread count."""

from __future__ import annotations

import math

import pytest
import torch

from statelm.engine.logits_processors import largest
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


def test_bad_arguments_are_refused() -> None:
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
