"""A tiny GGUF model in each block format: its matrices used in place (views of the mapped file), its logits those of
the same file dequantized and run as a float model, and it generates through the engine; so do Llama's variants.

Llama's (and Granite's and Mixtral's) Q/K rows stay in llama.cpp's permuted order with interleaved rope when in
place, and are put back in Hugging Face's order with rotate-half rope when dequantized: the same logits either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from statelm.attention.base import AttentionMetadata
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.kv_cache import KVCache
from statelm.engine.sequence import SamplingParams
from statelm.kernels.build import KernelBuildError, cpu_variant, load_kernels
from statelm.kernels.quant import PackedWeight
from statelm.models.compute_path import compute_paths, use_activations, use_compute_path, use_repack
from statelm.models.gguf import PERMUTED_QK_ARCHITECTURES
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model
from statelm.models.moe import MoEMLP
from statelm.models.packed import PackedLinear
from statelm.server.memory_budget import module_bytes
from tests.models.engine_run import generate
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_gguf import write_gguf_from_checkpoint, write_tiny_gguf
from tests.models.tiny_model_dir import make_tiny_model_dir
from tests.unit.gguf_blocks import FORMATS

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm kernels unavailable: {exc}", allow_module_level=True)

PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
BLOCK = 16


def load(path: Path, quantization: str) -> LoadedModel:
    return load_model(str(path), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant(),
                      quantization=quantization)  # fmt: skip


def prompt_logits(loaded: LoadedModel) -> torch.Tensor:
    """Next-token logits [len(PROMPT), vocab] of PROMPT as one prefill on an empty cache."""
    config, count = loaded.config, len(PROMPT)
    cache = KVCache(config.num_hidden_layers, 2, BLOCK, config.num_key_value_heads, config.head_dim,
                    torch.float32, "cpu")  # fmt: skip
    positions = torch.arange(count)
    meta = AttentionMetadata(positions, torch.tensor([[0]]), [count], [count], [0, count])
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(PROMPT), positions, cache, meta, torch.ones(count, dtype=torch.bool))
        return loaded.model.compute_logits(hidden, torch.ones(count, dtype=torch.bool))


def in_place_weights(loaded: LoadedModel) -> list[PackedWeight]:
    model = loaded.model
    linears = [module.weight for module in model.modules() if isinstance(module, PackedLinear)]
    return [*linears, model.embed_tokens.weight]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_a_model_in_place_computes_what_its_dequantized_model_does(qtype: Q, arch: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", qtype, arch)
    packed, dense = load(path, "auto"), load(path, "none")
    assert packed.config.rope_interleaved == (arch == "llama") and not dense.config.rope_interleaved
    same_layout = packed.fingerprint.parts["config"] == dense.fingerprint.parts["config"]
    assert same_layout == (arch != "llama")  # KV of permuted Q/K rows differs: the fingerprint says so
    file = path.read_bytes()
    bases = set()
    for weight in in_place_weights(packed):  # views of one mapping of the file: the bytes as stored, not copies
        for part in weight.parts:
            offset = file.find(bytes(part.data.flatten().numpy()))
            assert offset > 0
            bases.add(part.data.data_ptr() - offset)
    assert len(bases) == 1
    use_compute_path(packed.model, "kernels")
    use_activations(packed.model, "float32")
    use_compute_path(dense.model, "torch")
    expected = prompt_logits(dense)
    got = prompt_logits(packed)
    scale = expected.abs().max()
    assert float((got - expected).abs().max() / scale) < 1e-4
    for activations, bound in (("int16-prompt", 1e-3), ("int8", 0.1)):
        use_activations(packed.model, activations)
        assert float((prompt_logits(packed) - expected).abs().max() / scale) < bound, activations


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "granite", "olmo2", "qwen3_moe", "mixtral"])
def test_a_variant_in_place_computes_what_its_dequantized_model_does(arch: str, tmp_path: Path) -> None:
    overrides = {"query_pre_attn_scalar": 16} if arch == "gemma3" else {}
    overrides |= {"mlp_only_layers": []} if arch == "qwen3_moe" else {}  # llama.cpp's qwen3moe: experts everywhere
    checkpoint = make_tiny_checkpoint(arch, tmp_path / "hf", **overrides)
    path = write_gguf_from_checkpoint(checkpoint, tmp_path / "model.gguf", Q.Q8_0)
    packed, dense = load(path, "auto"), load(path, "none")
    permuted = packed.config.architecture in PERMUTED_QK_ARCHITECTURES
    assert packed.config.rope_interleaved == permuted and not dense.config.rope_interleaved
    assert permuted == (arch in ("granite", "mixtral"))
    linears = [module for module in packed.model.modules() if isinstance(module, PackedLinear)]
    assert len(linears) >= 3 * packed.config.num_hidden_layers  # qkv, output, and the MLP's or the router, in place
    assert "kernels" in compute_paths(packed.model)
    use_compute_path(packed.model, "kernels")
    use_activations(packed.model, "float32")
    use_compute_path(dense.model, "torch")
    expected = prompt_logits(dense)
    scale = expected.abs().max()
    assert float((prompt_logits(packed) - expected).abs().max() / scale) < 1e-4


# Q4_K's 256-value blocks need input sizes of 256: the tiny mixtures' hidden and expert sizes are raised to it
MOE_SIZES = {"qwen3_moe": {"hidden_size": 256, "moe_intermediate_size": 256}, "mixtral": {"hidden_size": 256,
             "intermediate_size": 256}}  # fmt: skip


@pytest.mark.parametrize("experts", [Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_runs_its_experts_in_their_blocks(arch: str, experts: Q, tmp_path: Path) -> None:
    overrides = MOE_SIZES[arch] if experts == Q.Q4_K else {}
    overrides |= {"mlp_only_layers": []} if arch == "qwen3_moe" else {}  # llama.cpp's qwen3moe: experts everywhere
    checkpoint = make_tiny_checkpoint(arch, tmp_path / "hf", **overrides)
    path = write_gguf_from_checkpoint(checkpoint, tmp_path / "model.gguf", Q.Q8_0, experts=experts)
    packed, dense = load(path, "auto"), load(path, "none")
    assert not [name for name, _ in packed.model.named_parameters() if ".experts." in name]  # no float experts
    assert [name for name, _ in dense.model.named_parameters() if ".experts." in name]
    layers = [module for module in packed.model.modules() if isinstance(module, MoEMLP)]
    assert len(layers) == packed.config.num_hidden_layers
    experts_in_place = [expert for layer in layers for expert in layer.experts]
    for expert in experts_in_place:  # gate and up fused, each expert's rows of the mapped stacks
        gate_up, down = expert.gate_up_proj.weight, expert.down_proj.weight
        assert gate_up.kind == down.kind == experts.name and len(gate_up.parts) == 2
        assert all(part.mapped for part in (*gate_up.parts, *down.parts))
    use_compute_path(packed.model, "kernels")
    use_activations(packed.model, "float32")
    use_compute_path(dense.model, "torch")
    expected = prompt_logits(dense)
    scale = expected.abs().max()
    repacked = prompt_logits(packed)
    assert float((repacked - expected).abs().max() / scale) < 1e-4
    copies = sum(part.interleaved.numel() for e in experts_in_place for part in e.gate_up_proj.weight.parts
                 if part.interleaved is not None)  # fmt: skip
    # --repack reaches the experts (where the library has an interleaved layout: not the scalar x86-64-v2 class), and
    # the memory budget counts their interleaved copies instead of the mapped pages they replace
    assert (copies > 0) == (cpu_variant() is not None and cpu_variant().name != "x86-64-v2")
    with_copies = module_bytes(packed.model)
    use_repack(packed.model, False)
    assert with_copies >= copies and (with_copies < module_bytes(packed.model) + copies or not copies)
    assert torch.equal(prompt_logits(packed), repacked)  # read in place: the same bits
    use_activations(packed.model, "int16-prompt")  # (int8's rounding may flip a token's choice of experts)
    assert float((prompt_logits(packed) - expected).abs().max() / scale) < 1e-3
    use_compute_path(packed.model, "torch")  # kernels unavailable: the experts dequantized
    assert float((prompt_logits(packed) - expected).abs().max() / scale) < 1e-4


def test_a_float_mixture_of_experts_quantized_at_load_runs_its_experts_packed(tmp_path: Path) -> None:
    folder = make_tiny_model_dir("qwen3_moe", tmp_path)
    quantized, float_model = load(folder, "int8"), load(folder, "none")
    assert not [name for name, _ in quantized.model.named_parameters() if ".experts." in name]
    use_compute_path(quantized.model, "kernels")
    use_activations(quantized.model, "float32")
    use_compute_path(float_model.model, "torch")
    expected = prompt_logits(float_model)
    assert float((prompt_logits(quantized) - expected).abs().max() / expected.abs().max()) < 0.1  # Q8_0's rounding


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS], ids=lambda q: q.name)
def test_a_model_in_place_generates_the_same_tokens_in_any_batch(qtype: Q, tmp_path: Path) -> None:
    loaded = load(write_tiny_gguf(tmp_path / "m.gguf", qtype), "auto")
    settings = EngineConfig(kv_cache_memory=16 << 20, activations="int16-prompt")
    use_activations(loaded.model, settings.activations)
    engine = create_engine(loaded, settings)
    assert loaded.model.compute_path == "kernels" and loaded.invariance is not None and loaded.invariance.verified
    prompts = {"a": PROMPT, "b": PROMPT[:5], "c": PROMPT[3:] * 2}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = generate(engine, prompts, params)
    assert all(len(tokens) == 12 for tokens in together.values())
    assert together == {rid: generate(engine, {rid: ids}, params)[rid] for rid, ids in prompts.items()}
