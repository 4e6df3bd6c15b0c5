"""The fused C++ layer ops agree with the torch ops and give each row the same bits in any batch."""

from __future__ import annotations

import pytest
import torch

from statelm.kernels.build import KernelBuildError, load_kernels
from statelm.models.layers import KernelLayerOps, LayerOps, RotaryEmbedding
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)

TORCH, KERNELS = LayerOps(), KernelLayerOps()


def rows(count: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("width", [64, 576, 1000])
def test_rms_norm_and_its_residual_form_match_torch(width: int) -> None:
    x, delta, weight = rows(9, width, 0), rows(9, width, 1), rows(1, width, 2)[0]
    torch.testing.assert_close(KERNELS.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5))
    residual_k, residual_t = x.clone(), x.clone()
    normed_k = KERNELS.add_rms_norm(residual_k, delta, weight, 1e-6)
    normed_t = TORCH.add_rms_norm(residual_t, delta, weight, 1e-6)
    assert torch.equal(residual_k, residual_t)
    torch.testing.assert_close(normed_k, normed_t)


def test_rms_norm_of_head_rows_keeps_the_shape() -> None:
    x, weight = rows(12, 64, 3).view(4, 3, 64), rows(1, 64, 4)[0]
    torch.testing.assert_close(KERNELS.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))


def test_silu_mul_matches_torch() -> None:
    gate_up = rows(7, 2 * 96, 5)
    torch.testing.assert_close(KERNELS.silu_mul(gate_up), TORCH.silu_mul(gate_up))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_torch_on_strided_views(interleaved: bool) -> None:
    heads, kv_heads, dim = 4, 2, 32
    qkv = rows(10, (heads + 2 * kv_heads) * dim, 6)
    positions = torch.tensor([0, 1, 2, 3, 50, 51, 52, 1000, 4095, 7])
    rotary = RotaryEmbedding(dim, 10000.0, None, torch.float32, interleaved=interleaved)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(10, heads, dim), k.view(10, kv_heads, dim)
    expected = TORCH.rope(q, k, TORCH.prepare_rope(positions, 4096, rotary))
    rotated = KERNELS.rope(q.clone(), k.clone(), KERNELS.prepare_rope(positions, 4096, rotary))
    torch.testing.assert_close(rotated[0], expected[0])
    torch.testing.assert_close(rotated[1], expected[1])


@pytest.mark.parametrize("ops", [TORCH, KERNELS], ids=["torch", "kernels"])
def test_interleaved_rope_on_llama_cpp_rows_is_rotate_half_on_hugging_face_rows(ops: LayerOps) -> None:
    """llama.cpp's converter moves each head's dimension i + D/2 next to i: rotating adjacent pairs of its rows is
    rotating halves of Hugging Face's, the same operations on the same values."""
    heads, dim = 3, 16
    hf = rows(5, heads * dim, 7).view(5, heads, dim)
    gguf_order = hf.unflatten(-1, (2, dim // 2)).transpose(-1, -2).flatten(-2)  # llama.cpp's permute of q/k rows
    positions = torch.tensor([0, 3, 9, 100, 4000])
    halves = RotaryEmbedding(dim, 10000.0, None, torch.float32)
    pairs = RotaryEmbedding(dim, 10000.0, None, torch.float32, interleaved=True)
    expected, _ = ops.rope(hf.clone(), hf.clone(), ops.prepare_rope(positions, 4096, halves))
    rotated, _ = ops.rope(gguf_order.clone(), gguf_order.clone(), ops.prepare_rope(positions, 4096, pairs))
    assert torch.equal(rotated, expected.unflatten(-1, (2, dim // 2)).transpose(-1, -2).flatten(-2))


def test_rope_rejects_a_position_outside_the_table() -> None:
    rotary = RotaryEmbedding(8, 10000.0, None, torch.float32)
    inputs = KERNELS.prepare_rope(torch.tensor([3]), 8, rotary)
    inputs.positions = torch.tensor([1 << 20])
    with pytest.raises(RuntimeError, match="outside the rope table"):
        KERNELS.rope(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), inputs)


@pytest.mark.invariance
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(threads: int) -> None:
    with kernel_threads(threads):
        x, delta, weight = rows(65, 576, 7), rows(65, 576, 8), rows(1, 576, 9)[0]
        for count in (1, 2, 7, 16, 65):
            assert torch.equal(KERNELS.rms_norm(x[:count], weight, 1e-5)[0], KERNELS.rms_norm(x[:1], weight, 1e-5)[0])
            assert torch.equal(KERNELS.silu_mul(x[:count])[-1], KERNELS.silu_mul(x[count - 1 : count])[0])
            residual = x[:count].clone()
            alone = x[count - 1 : count].clone()
            assert torch.equal(
                KERNELS.add_rms_norm(residual, delta[:count], weight, 1e-5)[-1],
                KERNELS.add_rms_norm(alone, delta[count - 1 : count], weight, 1e-5)[0],
            )


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 8), (5, 2), (37, 4)])
def test_expert_sum_matches_torch_bit_for_bit(tokens: int, top_k: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    experts = torch.rand(tokens, 16, generator=generator).argsort(dim=-1)[:, :top_k].sort(dim=-1).values
    pairs = experts.flatten().argsort(stable=True)  # (token, slot) pairs by expert, as models/moe.py orders them
    outputs, weights = rows(tokens * top_k, 96, tokens), torch.rand(tokens * top_k, generator=generator)
    outputs[0, :3] = torch.tensor([-0.0, 0.0, 1e-30])  # signed zeros and tiny products keep their bits too
    assert torch.equal(
        KERNELS.expert_sum(outputs, pairs, weights, top_k), TORCH.expert_sum(outputs, pairs, weights, top_k)
    )


def test_expert_sum_refuses_pairs_that_name_a_slot_twice() -> None:
    with pytest.raises(RuntimeError, match="each \\(token, slot\\) once"):
        KERNELS.expert_sum(rows(4, 8, 0), torch.tensor([0, 1, 1, 3]), torch.ones(4), 2)
