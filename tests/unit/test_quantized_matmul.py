"""Packed GGUF and int8/int4 weights: exact unpacking, the kernel against dequantize-then-matmul (with the
kernel's int8 activations), odd shapes, and invariance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from statelm.cpu import cpu_flags
from statelm.kernels.build import LIBRARY_DIR, KernelBuildError, cpu_variant, load_kernels
from statelm.kernels.quant import PackedWeight, pack_gguf
from statelm.kernels.quant import quantize as quantize_float
from statelm.kernels.variants import select_variant
from tests.models.test_cpu_classes import ONEDNN_ISA
from tests.models.test_gguf import _random_k_blocks
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)

EXACT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]  # packed bit for bit
REPACKED_TYPES = [Q.Q5_0, Q.Q5_1]  # dequantized and re-quantized to q8
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K]


def gguf_tensor(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        return _random_k_blocks(qtype, rows, cols, rng)
    return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(shape))


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and block of 32, round(x * 127 / amax) * (amax / 127), in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    levels = torch.round(blocks * inverse)  # half to even, as the kernel rounds
    return (levels.double() * (amax / 127.0).double()).view_as(x)


def assert_matmul_close(weight: PackedWeight, dense: torch.Tensor, rows: int, seed: int) -> None:
    """Both kernel paths against float64 matmuls on dense: only float rounding may differ.

    The float path is compared with x @ dense.T, the int8 path with x̂ @ dense.T, x̂ the int8-quantized
    activations; against x, the int8 path stays within what 8-bit activations cost (under 1% of the sum of
    the products' magnitudes).
    """
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(seed))
    for int8, seen in ((False, x.double()), (True, int8_activations(x))):
        result = weight.matmul(x, int8_activations=int8).double()
        magnitude = (seen.abs() @ dense.double().abs().T).max()  # what float rounding is relative to
        assert float((result - seen @ dense.double().T).abs().max() / magnitude) < 1e-6, int8
        assert float((result - x.double() @ dense.double().T).abs().max() / magnitude) < 0.01, int8


@pytest.mark.parametrize("qtype", EXACT_TYPES)
@pytest.mark.parametrize(("rows", "cols"), [(96, 64), (33, 576), (7, 1536), (1, 32)])
def test_exact_types_unpack_bit_for_bit_and_multiply_right(qtype: Q, rows: int, cols: int) -> None:
    raw = gguf_tensor(qtype, rows, cols, seed=rows + cols)
    weight = pack_gguf(qtype, raw, (rows, cols))
    dense = reference(raw, qtype, (rows, cols))
    assert torch.equal(weight.dequantize(), dense)
    for count in (1, 5, 64):
        assert_matmul_close(weight, dense, count, seed=count)


@pytest.mark.parametrize("qtype", REPACKED_TYPES + K_TYPES)
def test_other_types_repack_to_q8_within_its_rounding(qtype: Q) -> None:
    raw = gguf_tensor(qtype, 24, 512, seed=int(qtype))
    weight = pack_gguf(qtype, raw, (24, 512))
    dense = reference(raw, qtype, (24, 512))
    assert weight.kind == "q8"
    blocks = dense.view(24, -1, 32)
    bound = blocks.abs().amax(dim=-1, keepdim=True) / 254 * (1 + 1e-5)
    assert bool(((weight.dequantize().view(24, -1, 32) - blocks).abs() <= bound).all())
    assert_matmul_close(weight, weight.dequantize(), 3, seed=1)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_float_weights_quantize_at_load(kind: str) -> None:
    dense = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    weight = quantize_float(dense, kind)
    step = dense.view(40, -1, 32).abs().amax(-1) / 127 if kind == "int8" else None
    error = (weight.dequantize() - dense).view(40, -1, 32).abs().amax(-1)
    if step is not None:
        assert bool((error <= step / 2 + 1e-6).all())
    else:
        spread = dense.view(40, -1, 32).amax(-1) - dense.view(40, -1, 32).amin(-1)
        assert bool((error <= spread / 30 + 1e-6).all())
    assert_matmul_close(weight, weight.dequantize(), 9, seed=3)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_float(torch.zeros(4, 40), kind)


@pytest.mark.invariance
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
@pytest.mark.parametrize("threads", [1, 2, 7])  # 7: more pool threads than cores, some never scheduled in time
def test_a_row_gets_the_same_bits_in_any_batch_and_thread_count(qtype: Q, threads: int, int8: bool) -> None:
    weight = pack_gguf(qtype, gguf_tensor(qtype, 200, 576, seed=5), (200, 576))
    x = torch.randn(65, 576, generator=torch.Generator().manual_seed(6))
    with kernel_threads(threads):
        alone = torch.cat([weight.matmul(x[i : i + 1], int8) for i in range(65)])
        for count in (2, 3, 5, 7, 16, 64, 65):
            assert torch.equal(weight.matmul(x[:count], int8), alone[:count]), count


CLASS_LIBRARY_CHILD = """
import sys, torch
from statelm.kernels.build import load_kernels, loaded_library
from statelm.kernels.quant import PackedWeight
load_kernels()
print("library:", loaded_library())
data = torch.load(sys.argv[1])
outputs = {}
for name, (kind, shape, state) in data["weights"].items():
    weight = PackedWeight.from_state(kind, *shape, state)
    for int8 in (False, True):
        outputs[f"{name}-{int8}"] = weight.matmul(data["x"], int8_activations=int8)
torch.save(outputs, sys.argv[2])
"""


@pytest.mark.parametrize("capability", ["avx512", "avx2", "default"])
def test_every_cpu_class_library_gives_the_same_bits(capability: str, tmp_path: Path) -> None:
    """The library of each lower class (loaded as built, no compiler) computes this machine's library's bits."""
    capped, own = select_variant(cpu_flags(), capability), cpu_variant()
    if capped is None or own is None or capped == own:
        pytest.skip(f"this machine runs the {own and own.name} kernels: no wider library to compare with")
    weights = {qtype.name: pack_gguf(qtype, gguf_tensor(qtype, 77, 96, seed=8), (77, 96)) for qtype in EXACT_TYPES}
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(9))  # every tile kind, widened blocks too
    inputs = {
        "x": x,
        "weights": {name: (w.kind, (w.out_features, w.in_features), w.state()) for name, w in weights.items()},
    }
    torch.save(inputs, tmp_path / "in.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    if capability in ONEDNN_ISA:
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA[capability]
    command = [sys.executable, "-c", CLASS_LIBRARY_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    library = LIBRARY_DIR / f"{capped.library_stem}"
    assert f"library: {library}" in child.stdout, f"not the built {capped.name} library (run `make kernels`)\n{child}"
    outputs = torch.load(tmp_path / "out.pt")
    for name, weight in weights.items():
        for int8 in (False, True):
            assert torch.equal(weight.matmul(x, int8_activations=int8), outputs[f"{name}-{int8}"]), (name, int8)


def test_rows_select_concat_embed_and_round_trip_their_state() -> None:
    a = pack_gguf(Q.Q4_1, gguf_tensor(Q.Q4_1, 6, 64, seed=7), (6, 64))
    b = pack_gguf(Q.Q4_1, gguf_tensor(Q.Q4_1, 4, 64, seed=8), (4, 64))
    both = PackedWeight.concat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    index = torch.tensor([3, 0, 9, 9])
    assert torch.equal(both.select_rows(index).dequantize(), both.dequantize()[index])
    assert torch.equal(both.embedding(torch.tensor([9, 1])), both.dequantize()[[9, 1]])
    again = PackedWeight.from_state(both.kind, both.out_features, both.in_features, both.state())
    assert torch.equal(again.dequantize(), both.dequantize()) and again.nbytes == both.nbytes
    with pytest.raises(ValueError, match="one kind"):
        PackedWeight.concat([a, pack_gguf(Q.Q8_0, gguf_tensor(Q.Q8_0, 2, 64, seed=9), (2, 64))])
    with pytest.raises(ValueError, match="do not make"):
        PackedWeight.from_state("q4", 6, 64, {"values": a.values, "scales": a.scales})


@pytest.mark.invariance
def test_int8_decode_activations_quantize_generated_rows_only() -> None:
    """int8-decode: generated tokens' rows take the int8 path and prompt rows the float32 one, whatever the mix."""
    from statelm.models.layers import RowChunking
    from statelm.models.packed import PackedLinear

    dense = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    weight = quantize_float(dense, "int8")
    chunking = RowChunking.batch_invariant()
    linear = PackedLinear(weight, None, chunking)
    linear.activations = "int8-decode"
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    is_prompt = torch.tensor([True, False, False, True, True, False, True, False, True])
    chunking.set_rows(is_prompt)
    mixed = linear(x)
    assert torch.equal(mixed[is_prompt], weight.matmul(x[is_prompt], int8_activations=False))
    assert torch.equal(mixed[~is_prompt], weight.matmul(x[~is_prompt], int8_activations=True))
    chunking.set_rows(None)  # all generated
    assert torch.equal(linear(x[1:2]), mixed[1:2])
    chunking.set_rows(torch.ones(1, dtype=torch.bool))  # all prompt
    assert torch.equal(linear(x[:1]), mixed[:1])
