"""The GGUF matmul kernel on every block format: dequantization bit for bit equal to gguf-py's, each arithmetic
against float64 matmuls, odd shapes and mixed formats, invariance in any batch and thread count, and the same bits
from every lower CPU class's library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from statelm.cpu import cpu_flags
from statelm.kernels.build import LIBRARY_DIR, KernelBuildError, cpu_variant, load_kernels
from statelm.kernels.quant import INTERLEAVED_TYPE, BlockMatrix, PackedWeight, matmul_groups, quantize
from statelm.kernels.variants import select_variant
from tests.models.test_cpu_classes import ONEDNN_ISA
from tests.unit.gguf_blocks import FORMATS, random_blocks, random_columns
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)

ARITHMETICS = ["float32", "int8", "int16"]
LIMITS = {"int8": 127, "int16": 32767}


def matrix(qtype: Q, rows: int, cols: int, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    """A random matrix of the format and its dequantization by gguf-py (the oracle)."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    dense = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
    return PackedWeight([BlockMatrix.of(qtype, raw, (rows, cols))]), torch.from_numpy(dense)


def seen_activations(x: torch.Tensor, arithmetic: str, span: int = 32) -> torch.Tensor:
    """x as the kernel multiplies it, in float64: per row and span of values (32; int8 on a 256-value format, 256),
    round(x * L / amax) * (amax / L)."""
    if arithmetic == "float32":
        return x.double()
    blocks = x.view(x.shape[0], -1, span if arithmetic == "int8" else 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, LIMITS[arithmetic] / amax, torch.zeros_like(amax))
    levels = torch.round(blocks * inverse)  # half to even, as the kernel rounds
    return (levels.double() * (amax / LIMITS[arithmetic]).double()).view_as(x)


def assert_matmul_close(weight: PackedWeight, dense: torch.Tensor, x: torch.Tensor) -> None:
    """Every arithmetic against a float64 matmul of what it multiplies (each part's activations as its format's
    arithmetic quantizes them): only float rounding may differ; against x itself, int8 within what 8-bit
    activations cost and int16 within 1e-4 (relative to the products' sizes)."""
    magnitude = (x.double().abs() @ dense.double().abs().T).max()
    for arithmetic in ARITHMETICS:
        result = weight.matmul(x, arithmetic).double()
        first = 0
        for part in weight.parts:
            columns = slice(first, first + part.data.shape[0])
            seen = seen_activations(x, arithmetic, GGML_QUANT_SIZES[part.qtype][0])
            error = (result[:, columns] - seen @ dense[columns].double().T).abs().max()
            assert float(error / magnitude) < 1e-6, (arithmetic, part.qtype.name)
            first = columns.stop
        bound = {"float32": 1e-6, "int16": 1e-4, "int8": 0.01}[arithmetic]
        assert float((result - x.double() @ dense.double().T).abs().max() / magnitude) < bound, arithmetic


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequantization_is_gguf_py_bit_for_bit(qtype: Q) -> None:
    weight, dense = matrix(qtype, 37, random_columns(qtype), seed=int(qtype))
    assert torch.equal(weight.dequantize(), dense)
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(weight.embedding(ids), dense[ids])


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 19])
def test_every_arithmetic_multiplies_right(qtype: Q, rows: int) -> None:
    # 37 output columns: a partial tile; 768 or 800 inputs: a partial K chunk (and an odd count of 32-value blocks)
    weight, dense = matrix(qtype, 37, random_columns(qtype), seed=rows)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    assert_matmul_close(weight, dense, x)


@pytest.mark.invariance
@pytest.mark.parametrize(("qtype", "cols"), [(Q.Q8_0, 2048), (Q.Q4_K, 4096), (Q.Q5_K, 4096)], ids=lambda v: str(v))
def test_long_rows_read_in_place_multiply_right(qtype: Q, cols: int) -> None:
    # rows over 2 KiB are read where they lie (shorter ones are copied first, as every other test here has them)
    weight, dense = matrix(qtype, 21, cols, seed=cols)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(1))
    assert_matmul_close(weight, dense, x)
    for arithmetic in ARITHMETICS:
        alone = torch.cat([weight.matmul(x[i : i + 1], arithmetic) for i in range(6)])
        assert torch.equal(weight.matmul(x, arithmetic), alone), arithmetic


def test_parts_of_different_formats_stack_into_one_output() -> None:
    parts = [matrix(qtype, rows, 256, seed=rows) for qtype, rows in ((Q.Q4_K, 24), (Q.Q6_K, 9), (Q.Q8_0, 16))]
    weight = PackedWeight.concat([part for part, _ in parts])
    dense = torch.cat([d for _, d in parts])
    assert weight.kind == "Q4_K+Q6_K+Q8_0" and (weight.out_features, weight.in_features) == (49, 256)
    assert torch.equal(weight.dequantize(), dense)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    assert_matmul_close(weight, dense, x)
    for arithmetic in ARITHMETICS:
        alone = torch.cat([part.matmul(x, arithmetic) for part, _ in parts], dim=1)
        assert torch.equal(weight.matmul(x, arithmetic), alone)


@pytest.mark.invariance
def test_grouped_calls_give_the_bits_of_calls_one_by_one() -> None:
    """matmul_groups (a layer's experts in one kernel call): each group's result is its own call's, bit for bit,
    whatever the other groups' rows, K, formats, layouts and arithmetics (rows past the stream path included)."""
    q4k = matrix(Q.Q4_K, 45, 512, seed=21)[0]
    weights = [
        q4k.interleave(),
        q4k,
        PackedWeight.concat([matrix(Q.Q6_K, 24, 256, seed=22)[0].interleave(), matrix(Q.Q8_0, 9, 256, seed=23)[0]]),
        matrix(Q.Q3_K, 17, 768, seed=24)[0],
    ]
    for rows in ((1, 1, 1, 1), (3, 0, 7, 1), (9, 5, 1, 20)):
        for arithmetics in (["int8"] * 4, ["int16", "int8", "float32", "int8"]):
            calls = []
            for i, (weight, count, arithmetic) in enumerate(zip(weights, rows, arithmetics, strict=True)):
                x = torch.randn(count, weight.in_features, generator=torch.Generator().manual_seed(30 + i))
                calls.append((x, weight, arithmetic))
            grouped = matmul_groups(calls)
            for (x, weight, arithmetic), y in zip(calls, grouped, strict=True):
                assert y.shape == (x.shape[0], weight.out_features)
                assert torch.equal(y, weight.matmul(x, arithmetic)), (rows, arithmetics)
    with pytest.raises(RuntimeError, match="parts"):
        torch.ops.statelm.gguf_matmul_groups([torch.zeros(1, 256)], [], [], [1], [1])


NO_TILE_BUILDER = (Q.Q2_K, Q.Q3_K)  # decoded block by block: never interleaved
PAIRED = (Q.Q4_0, Q.IQ4_NL, Q.Q8_0)  # interleaved two blocks a unit, both d's first


@pytest.mark.invariance
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_interleaved_blocks_give_the_bits_of_the_blocks_in_place(qtype: Q) -> None:
    # 141 rows: the last tile is partly padding; 37 rows of x cross the few-row and tile paths, and at one thread
    # the AVX2 build's panels (32 rows or more: 18 tiles in panels of four, its int16 pairs two tiles at a time)
    weight, dense = matrix(qtype, 141, random_columns(qtype), seed=11)
    interleaved = weight.interleave()
    simd = cpu_variant() is not None and cpu_variant().name != "x86-64-v2"
    assert interleaved.interleaved == (simd and qtype not in NO_TILE_BUILDER)
    again = interleaved.interleave()  # an interleaved matrix is not copied again
    assert all(a.interleaved is b.interleaved for a, b in zip(again.parts, interleaved.parts, strict=True))
    assert torch.equal(interleaved.dequantize(), dense)
    ids = torch.tensor([140, 0, 8, 7, 136, 8])  # the padded last tile, tile edges, a repeat
    assert torch.equal(interleaved.embedding(ids), dense[ids])  # lookups gather rows back out of the copy
    x = torch.randn(37, weight.in_features, generator=torch.Generator().manual_seed(12))
    for arithmetic in ARITHMETICS:
        alone = torch.cat([weight.matmul(x[i : i + 1], arithmetic) for i in range(37)])
        for count in (1, 2, 3, 4, 5, 8, 9, 17, 37):
            with kernel_threads(1):
                assert torch.equal(interleaved.matmul(x[:count], arithmetic), alone[:count]), (arithmetic, count)
    assert not interleaved.in_place().interleaved and torch.equal(interleaved.in_place().matmul(x), weight.matmul(x))


@pytest.mark.parametrize("qtype", PAIRED, ids=lambda q: q.name)
def test_paired_formats_interleave_without_padding_rows_of_even_blocks_only(qtype: Q) -> None:
    simd = cpu_variant() is not None and cpu_variant().name != "x86-64-v2"
    even, _ = matrix(qtype, 20, 832, seed=3)
    interleaved = even.interleave()
    assert interleaved.interleaved == simd
    if simd:  # the interleaved copy is the file's size: no padding word a block
        assert all(p.interleaved.shape[1] == p.data.shape[1] for p in interleaved.parts)
    odd, _ = matrix(qtype, 20, 800, seed=4)  # 25 blocks a row: no pairs, read in place
    assert not odd.interleave().interleaved
    x = torch.randn(3, 800, generator=torch.Generator().manual_seed(5))
    assert torch.equal(odd.interleave().matmul(x), odd.matmul(x))


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its range as `start` and `end`, and its fields."""
    entry: dict[str, str] = {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if entry and int(entry["start"], 16) <= address < int(entry["end"], 16):
                return entry
            start, end = head.split("-")
            entry = {"start": start, "end": end}
        else:
            name, _, value = line.partition(":")
            entry[name] = value.strip()
    assert entry and int(entry["start"], 16) <= address < int(entry["end"], 16), "no mapping holds the address"
    return entry


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="needs Linux with transparent huge pages"
)
def test_large_interleaved_copies_sit_on_2_mib_aligned_mappings_advised_for_huge_pages() -> None:
    simd = cpu_variant() is not None and cpu_variant().name != "x86-64-v2"
    if not simd:
        pytest.skip("this library has no interleaved layout")
    weight = matrix(Q.Q4_K, 4096, 1024, seed=21)[0]
    interleaved = weight.interleave()
    large = interleaved.parts[0].interleaved  # 2.25 MiB
    assert large is not None and large.data_ptr() % (2 << 20) == 0
    mapping = mapping_of(large.data_ptr())
    assert int(mapping["start"], 16) == large.data_ptr()  # a mapping of its own
    assert "hg" in mapping["VmFlags"].split()  # MADV_HUGEPAGE
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(22))
    assert torch.equal(interleaved.matmul(x), weight.matmul(x))


def test_interleaved_and_in_place_parts_stack_into_one_output() -> None:
    parts = [matrix(qtype, rows, 256, seed=rows)[0] for qtype, rows in ((Q.Q4_K, 24), (Q.Q3_K, 9), (Q.Q6_K, 17))]
    mixed = PackedWeight.concat([parts[0].interleave(), parts[1].interleave(), parts[2]])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(13))
    for arithmetic in ARITHMETICS:
        assert torch.equal(mixed.matmul(x, arithmetic), PackedWeight.concat(parts).matmul(x, arithmetic))


def test_block_matrices_are_checked() -> None:
    raw = random_blocks(Q.Q4_K, 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of Q4_K's 256-value blocks"):
        BlockMatrix.of(Q.Q4_K, raw, (8, 128))
    with pytest.raises(ValueError, match="is not a Q4_K matrix"):
        BlockMatrix.of(Q.Q4_K, raw, (5, 256))
    with pytest.raises(ValueError, match="not a block format"):
        BlockMatrix.of(Q.F16, raw, (4, 256))
    with pytest.raises(RuntimeError, match="does not match K"):
        PackedWeight([BlockMatrix.of(Q.Q4_K, raw, (4, 256))]).matmul(torch.zeros(1, 512))
    q3_k = torch.from_numpy(random_blocks(Q.Q3_K, 4, 256, np.random.default_rng(0))).reshape(4, -1)
    with pytest.raises(RuntimeError, match="Q3_K rows of 110 bytes have no interleaved layout"):
        torch.ops.statelm.gguf_matmul(torch.zeros(1, 256), [q3_k], [int(Q.Q3_K) | INTERLEAVED_TYPE], 1)


@pytest.mark.parametrize(("kind", "qtype"), [("int8", Q.Q8_0), ("int4", Q.Q4_1)])
def test_float_weights_quantize_as_gguf_py_does(kind: str, qtype: Q) -> None:
    dense = torch.randn(40, 96, generator=torch.Generator().manual_seed(2)) * 3
    dense[0, :32] = 0  # a block of zeros: scale 0
    weight = quantize(dense, kind)
    assert weight.kind == qtype.name
    assert np.array_equal(weight.parts[0].data.numpy(), gguf_quantize(dense.numpy(), qtype).reshape(40, -1))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), kind)


@pytest.mark.invariance
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("threads", [1, 2, 7])  # 7: more pool threads than cores, some never scheduled in time
def test_a_row_gets_the_same_bits_in_any_batch_and_thread_count(qtype: Q, threads: int, arithmetic: str) -> None:
    # a row alone takes the few-row path (rows multiplied straight from the blocks), a batch of many the tile path:
    # every count from 1 to 17 crosses from one to the other, and both must give each row the same bits
    weight, _ = matrix(qtype, 200, random_columns(qtype), seed=5)
    x = torch.randn(65, weight.in_features, generator=torch.Generator().manual_seed(6))
    with kernel_threads(threads):
        alone = torch.cat([weight.matmul(x[i : i + 1], arithmetic) for i in range(65)])
        for count in (*range(2, 18), 64, 65):
            assert torch.equal(weight.matmul(x[:count], arithmetic), alone[:count]), count


CLASS_LIBRARY_CHILD = """
import sys, torch
from statelm.kernels.build import load_kernels, loaded_library
from statelm.kernels.quant import ARITHMETICS, INTERLEAVED_TYPE
load_kernels()
torch.ops.statelm.set_num_threads(2)  # the AVX2 build's panels of two tiles (the test's weights)
print("library:", loaded_library())
data = torch.load(sys.argv[1])
outputs = {}
for name, (raw, qtype) in data["weights"].items():
    for arithmetic, code in ARITHMETICS.items():
        x = data["x"][name]
        outputs[f"{name}-{arithmetic}"] = torch.ops.statelm.gguf_matmul(x, [raw], [qtype], code)
        few = [torch.ops.statelm.gguf_matmul(x[i : i + 1], [raw], [qtype], code) for i in range(3)]
        few.append(torch.ops.statelm.gguf_matmul(x[3:6], [raw], [qtype], code))
        outputs[f"{name}-{arithmetic}-few"] = torch.cat(few)
        interleaved = torch.ops.statelm.gguf_interleave(raw, qtype)
        if interleaved.numel():  # this class's own layout (its tile width), the bits of the blocks in place
            args = [interleaved[: raw.shape[0]]], [qtype | INTERLEAVED_TYPE], code
            outputs[f"{name}-{arithmetic}-interleaved"] = torch.ops.statelm.gguf_matmul(x, *args)
            few = [torch.ops.statelm.gguf_matmul(rows, *args) for rows in (x[:1], x[1:9])]  # streamed; one tile pass
            outputs[f"{name}-{arithmetic}-interleaved-few"] = torch.cat(few)
for name, (x, weight) in data["float"].items():
    outputs[f"float-{name}"] = torch.ops.statelm.float_linear(x, weight)
outputs["silu_mul"] = torch.ops.statelm.silu_mul(data["gate_up"])
torch.save(outputs, sys.argv[2])
"""


@pytest.mark.parametrize("capability", ["avx512", "avx2", "default"])
def test_every_cpu_class_library_gives_the_same_bits(capability: str, tmp_path: Path) -> None:
    """The library of each lower class (loaded as built, no compiler) computes this machine's library's bits, for
    every block format and arithmetic, in many rows (tiles) and in few (rows alone, and three together), from the
    blocks in place and (SIMD classes) interleaved in its own layout; and float_linear's and silu_mul's (its
    exponential vectorised for each class)."""
    capped, own = select_variant(cpu_flags(), capability), cpu_variant()
    if capped is None or own is None or capped == own:
        pytest.skip(f"this machine runs the {own and own.name} kernels: no wider library to compare with")
    rng = np.random.default_rng(8)
    # 141 output columns: 18 AVX2 tiles, the last partly padding, which 37 rows of x (every row tile kind) pass over
    # in panels of two tiles at the child's two threads (the AVX2 build's panels: 32 rows or more, four a thread)
    weights = {q.name: (torch.from_numpy(random_blocks(q, 141, random_columns(q), rng)), int(q)) for q in FORMATS}
    generator = torch.Generator().manual_seed(9)
    x = {q.name: torch.randn(37, random_columns(q), generator=generator) for q in FORMATS}
    floats = {k: (torch.randn(7, k, generator=generator), torch.randn(24, k, generator=generator)) for k in (100, 2048)}
    # gate values over the whole range, past the exponential's clamp at both ends, and the ordinary ones
    gate_up = torch.cat([torch.linspace(-120, 120, 4099).repeat(2, 2), torch.randn(5, 8198, generator=generator) * 4])
    torch.save({"x": x, "weights": weights, "float": floats, "gate_up": gate_up}, tmp_path / "in.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    if capability in ONEDNN_ISA:
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA[capability]
    command = [sys.executable, "-c", CLASS_LIBRARY_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    library = LIBRARY_DIR / f"{capped.library_stem}"
    assert f"library: {library}" in child.stdout, f"not the built {capped.name} library (run `make kernels`)\n{child}"
    outputs = torch.load(tmp_path / "out.pt")
    for name, (raw, qtype) in weights.items():
        weight = PackedWeight([BlockMatrix.of(Q(qtype), raw, (141, x[name].shape[1]))])
        for arithmetic in ARITHMETICS:
            expected = weight.matmul(x[name], arithmetic)
            assert torch.equal(expected, outputs[f"{name}-{arithmetic}"]), (name, arithmetic)
            assert torch.equal(expected[:6], outputs[f"{name}-{arithmetic}-few"]), (name, arithmetic, "few rows")
            if f"{name}-{arithmetic}-interleaved" in outputs:
                assert torch.equal(expected, outputs[f"{name}-{arithmetic}-interleaved"]), (name, arithmetic)
                assert torch.equal(expected[:9], outputs[f"{name}-{arithmetic}-interleaved-few"]), (name, arithmetic)
    for k, (x_float, weight_float) in floats.items():  # the float32 router's linear
        assert torch.equal(torch.ops.statelm.float_linear(x_float, weight_float), outputs[f"float-{k}"]), k
    assert torch.equal(torch.ops.statelm.silu_mul(gate_up), outputs["silu_mul"])


@pytest.mark.invariance
@pytest.mark.parametrize("activations", ["int8-decode", "int16-prompt"])
def test_prompt_and_generated_rows_take_their_own_arithmetic(activations: str) -> None:
    """Mixed activations: prompt rows and generated rows each take their arithmetic, whatever the mix."""
    from statelm.models.layers import RowChunking
    from statelm.models.packed import ACTIVATIONS, PackedLinear, kernel_matmuls

    prompt_arithmetic, generated_arithmetic = ACTIVATIONS[activations]
    weight = quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(5)), "int8")
    chunking = RowChunking.batch_invariant()
    linear = PackedLinear(weight, None, chunking)
    linear.activations = activations
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    is_prompt = torch.tensor([True, False, False, True, True, False, True, False, True])
    chunking.set_rows(is_prompt)
    mixed = linear(x)
    assert torch.equal(mixed[is_prompt], weight.matmul(x[is_prompt], prompt_arithmetic))
    assert torch.equal(mixed[~is_prompt], weight.matmul(x[~is_prompt], generated_arithmetic))
    shares = ([1, 3, 4, 8], [1, 2], [0, 3, 6])  # an expert's share of the batch: mixed, generated, prompt rows
    for share in shares:
        tokens = torch.tensor(share)
        assert torch.equal(linear.kernel_matmul(x[tokens], *chunking.rows_among(tokens)), mixed[tokens]), share
    together = kernel_matmuls([(linear, x[torch.tensor(s)], *chunking.rows_among(torch.tensor(s))) for s in shares])
    for share, y in zip(shares, together, strict=True):  # a layer's experts in one call
        assert torch.equal(y, mixed[torch.tensor(share)]), share
    chunking.set_rows(None)  # all generated
    assert torch.equal(linear(x[1:2]), mixed[1:2])
    chunking.set_rows(torch.ones(1, dtype=torch.bool))  # all prompt
    assert torch.equal(linear(x[:1]), mixed[:1])
