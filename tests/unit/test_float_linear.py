"""float_linear (a mixture of experts' float32 router on the kernels path): right to float rounding, and a row's
bits the same in any batch, thread count and K (the cross-class test in test_quantized_matmul covers CPU classes)."""

from __future__ import annotations

import pytest
import torch

from statelm.kernels.build import KernelBuildError, load_kernels
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)


@pytest.mark.parametrize("k", [16, 100, 2048])  # 100: a partial last group of sixteen
def test_float_linear_multiplies_right(k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    x, weight = torch.randn(5, k, generator=generator), torch.randn(33, k, generator=generator)
    y = torch.ops.statelm.float_linear(x, weight)
    reference = x.double() @ weight.double().T
    assert y.dtype == torch.float32 and y.shape == (5, 33)
    assert float((y.double() - reference).abs().max()) < 1e-5 * k**0.5 * float(reference.abs().max())


@pytest.mark.invariance
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_a_row_gets_the_same_bits_in_any_batch_and_thread_count(threads: int) -> None:
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(20, 2048, generator=generator), torch.randn(128, 2048, generator=generator)
    alone = torch.cat([torch.ops.statelm.float_linear(x[i : i + 1], weight) for i in range(20)])
    with kernel_threads(threads):
        for count in (1, 2, 5, 16, 20):
            assert torch.equal(torch.ops.statelm.float_linear(x[:count], weight), alone[:count]), count
        strided = torch.randn(20, 4096, generator=generator)[:, :2048]  # rows apart in memory
        strided.copy_(x)
        assert torch.equal(torch.ops.statelm.float_linear(strided, weight), alone)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.statelm.float_linear(torch.zeros(1, 64), torch.zeros(8, 32))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.statelm.float_linear(torch.zeros(1, 64, dtype=torch.float64), torch.zeros(8, 64))
