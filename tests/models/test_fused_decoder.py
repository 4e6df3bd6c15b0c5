"""The fused C++ decoder (all layers in one call) equals the Python forward on the kernels path, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from statelm.attention.base import AttentionMetadata
from statelm.attention.kv_format import Q8_GROUP
from statelm.engine.kv_cache import KVCache
from statelm.kernels.build import KernelBuildError, cpu_variant, load_kernels
from statelm.models import compute_path
from statelm.models.compute_path import use_activations, use_compute_path, use_repack
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model
from statelm.models.packed import ACTIVATIONS, PackedLinear
from tests.models.test_variant_engine import model_path
from tests.models.tiny_gguf import write_tiny_gguf
from tests.models.tiny_model_dir import make_tiny_model_dir
from tests.unit.paged_cases import fill_with_noise

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)

pytestmark = pytest.mark.invariance
BLOCK = 16


VARIANT_GGUFS = [
    "qwen3_moe-q4_0-gguf",
    "mixtral-q8_0-gguf",
    "gemma2-q8_0-gguf",
    "gemma3-q8_0-gguf",
    "granite-q8_0-gguf",
    "olmo2-q8_0-gguf",
]


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "llama-gguf", *VARIANT_GGUFS])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny checkpoint quantized to int8 at load (every linear packed): qkv bias (qwen2), q/k norms (qwen3); or a
    GGUF of mixed formats used in place, with interleaved rope (llama-gguf), or of a mixture of experts' blocks and
    float32 router (qwen3_moe, mixtral), or of a variant's block: soft-capped scores, sliding layers, norms after
    attention and MLP and GeGLU (gemma2), its sliding layers' own rope (gemma3), multipliers (granite), norms after
    attention and MLP only and a QK-norm over all heads (olmo2)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama-gguf":
        mix = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "attn_k": Q.Q8_0, "token_embd": Q.Q6_K}  # as in a Q4_K_M
        source = write_tiny_gguf(folder / "mixed.gguf", Q.Q4_K, formats=mix)
    elif request.param.endswith("gguf"):
        source = model_path(request.param, folder)
    else:
        overrides = {"sliding_window": 5} if request.param == "mistral" else {}
        source = make_tiny_model_dir(request.param, folder, **overrides)
    model = load_model(str(source), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant(),
                       quantization="int8")  # fmt: skip
    use_compute_path(model.model, "kernels")
    assert model.model.fused is not None
    return model


def forward(loaded: LoadedModel, fused: bool, is_prompt: torch.Tensor, kv: str) -> tuple[torch.Tensor, KVCache]:
    """A step of a 9-token prompt chunk over 4 cached tokens beside two decodes, on fresh KV filled the same way."""
    model, config = loaded.model, loaded.config
    cache = KVCache(config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, config.head_dim, kv, "cpu")
    fill_with_noise(cache, torch.Generator().manual_seed(0))
    positions = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 33])
    tables = torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 7]])
    seqs = torch.tensor([0] * 9 + [1, 2])
    slots = tables[seqs, positions // BLOCK] * BLOCK + positions % BLOCK
    meta = AttentionMetadata(slots, tables, [9, 1, 1], [13, 21, 34], [0, 9, 10, 11])
    ids = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    saved, model.fused = model.fused, (model.fused if fused else None)
    try:
        with torch.inference_mode():
            return model(ids, positions, cache, meta, is_prompt), cache
    finally:
        model.fused = saved


@pytest.mark.parametrize("kv", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("activations", list(ACTIVATIONS))
def test_fused_layers_equal_the_python_forward(loaded: LoadedModel, activations: str, kv: str) -> None:
    if kv == "q8_0" and loaded.config.head_dim % Q8_GROUP:
        pytest.skip(f"q8_0 needs a head dim that is a multiple of {Q8_GROUP}")
    use_activations(loaded.model, activations)
    kinds = {
        "generated": torch.zeros(11, dtype=torch.bool),
        "prompt": torch.ones(11, dtype=torch.bool),
        "mixed": torch.tensor([True] * 9 + [False] * 2),
    }
    try:
        for is_prompt in kinds.values():
            expected, expected_cache = forward(loaded, False, is_prompt, kv)
            got, cache = forward(loaded, True, is_prompt, kv)
            assert torch.equal(got, expected)
            planes = [(a, b) for x, y in zip(cache.layers, expected_cache.layers, strict=True)
                      for (a, _), (b, _) in zip(x.planes(), y.planes(), strict=True)]  # fmt: skip
            assert all(torch.equal(a, b) for a, b in planes)
    finally:
        use_activations(loaded.model, "float32")


@pytest.mark.parametrize("activations", list(ACTIVATIONS))
def test_generated_rows_give_a_prompt_row_s_bits_where_decoded_kv_is_exact(
    loaded: LoadedModel, activations: str
) -> None:
    use_activations(loaded.model, activations)
    try:
        exact = compute_path.decoded_kv_exact(loaded.model)
        assert exact == (activations in ("int8", "float32"))  # every linear packed, a mixture's router float32
        prompt, prompt_cache = forward(loaded, True, torch.ones(11, dtype=torch.bool), "float16")
        generated, generated_cache = forward(loaded, True, torch.zeros(11, dtype=torch.bool), "float16")
        planes = [(a, b) for x, y in zip(prompt_cache.layers, generated_cache.layers, strict=True)
                  for (a, _), (b, _) in zip(x.planes(), y.planes(), strict=True)]  # fmt: skip
        assert (torch.equal(prompt, generated) and all(torch.equal(a, b) for a, b in planes)) == exact
    finally:
        use_activations(loaded.model, "float32")


def test_a_model_with_a_float_linear_is_not_fused_and_keeps_decoded_kv_apart(qwen2_dir: Path) -> None:
    model = load_model(str(qwen2_dir), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant())
    use_compute_path(model.model, "kernels")
    assert model.model.fused is None
    assert not compute_path.decoded_kv_exact(model.model)  # its torch matmuls chunk the two kinds of row apart


def test_blocks_read_in_place_give_the_interleaved_blocks_bits(loaded: LoadedModel) -> None:
    # --repack (the default) against --no-repack: the same model, prompt and generated rows, the fused decoder
    packed = [module for module in loaded.model.modules() if isinstance(module, PackedLinear)]
    simd = cpu_variant() is not None and cpu_variant().name != "x86-64-v2"
    # every matrix whose rows fit the layout (a one-block row of a tiny expert does not) is interleaved
    assert any(module.weight.interleaved for module in packed) == simd
    use_activations(loaded.model, "int16-prompt")
    is_prompt = torch.tensor([True] * 9 + [False] * 2)
    interleaved, _ = forward(loaded, True, is_prompt, "float16")
    use_repack(loaded.model, False)
    use_compute_path(loaded.model, "kernels")
    try:
        assert not any(module.weight.interleaved for module in packed)
        in_place, _ = forward(loaded, True, is_prompt, "float16")
    finally:
        use_repack(loaded.model, True)
        use_compute_path(loaded.model, "kernels")
    assert torch.equal(interleaved, in_place)


def test_auto_activations_follow_the_size_of_the_packed_weights(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--activations auto`: int16-prompt below AUTO_INT8_WEIGHTS packed weights, int8 from there on."""
    packed = [module for module in loaded.model.modules() if isinstance(module, PackedLinear)]
    weights = sum(module.in_features * module.out_features for module in packed)
    for threshold, chosen in ((weights + 1, "int16-prompt"), (weights, "int8")):
        monkeypatch.setattr(compute_path, "AUTO_INT8_WEIGHTS", threshold)
        assert use_activations(loaded.model, "auto") == len(packed)
        assert loaded.model.activations == chosen
        assert all(module.activations == chosen for module in packed)
    with pytest.raises(ValueError, match="unknown activations"):
        use_activations(loaded.model, "int4")
