"""Every architecture and GGUF block format on a CUDA device (GPU only): transformers' logits through each GPU
compute path, a GGUF's blocks dequantized at load to what the CPU computes from them, and the variants' fast paths
verified and batch-invariant in the engine, in bfloat16 with CUDA graphs, as `statelm serve` runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from statelm.config import EngineConfig
from statelm.engine.builder import load_engine_model
from statelm.engine.sequence import SamplingParams
from statelm.models.compute_path import compute_paths, use_compute_path
from statelm.models.config import ModelConfig
from statelm.models.layers import RowChunking
from statelm.models.llama import LlamaForCausalLM
from statelm.models.loader import load_model
from statelm.models.variants import model_class
from tests.models import test_hf_parity, test_variant_parity
from tests.models.engine_run import generate
from tests.models.test_cuda_engine import engine_for
from tests.models.test_hf_parity import (
    DECODE_STEPS,
    PROMPT_LEN,
    PagedSequences,
    hf_logits,
    prefill_then_decode,
    random_tokens,
)
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_gguf import write_gguf_from_checkpoint, write_tiny_gguf
from tests.unit.gguf_blocks import FORMATS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
ARCHITECTURES = {**test_hf_parity.VARIANTS, **test_variant_parity.VARIANTS}
TOLERANCE = 1e-4  # of the largest logit; float32 throughout: cuBLAS without TF32, Triton's dots in IEEE float32
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def logits_on_every_path(model: LlamaForCausalLM, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The prompt-then-decode logits of tokens through each compute path the model can run."""
    found = {}
    for path in compute_paths(model):
        use_compute_path(model, path)
        found[path] = prefill_then_decode(PagedSequences(model), tokens, PROMPT_LEN)
    return found


def relative_errors(found: dict[str, torch.Tensor], expected: torch.Tensor) -> dict[str, float]:
    """Each path's largest logit error, as a fraction of the largest expected logit."""
    scale = expected.abs().max().item()
    return {path: (logits - expected).abs().max().item() / scale for path, logits in found.items()}


@pytest.mark.parametrize("variant", list(ARCHITECTURES))
def test_each_architecture_matches_transformers_on_every_gpu_path(variant: str, tmp_path: Path) -> None:
    arch, overrides = ARCHITECTURES[variant]
    checkpoint = make_tiny_checkpoint(arch, tmp_path, **overrides)
    config = ModelConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    model = model_class(config)(config, dtype=torch.float32, device=CUDA, chunking=RowChunking.batch_invariant())
    model.load_weights(load_file(checkpoint / "model.safetensors").items())
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, config.vocab_size, seed=1)
    expected = hf_logits(checkpoint, tokens)
    found = logits_on_every_path(model, tokens)
    assert ("triton" in found) == (config.num_experts == 0)  # mixtures of experts run off Triton
    errors = relative_errors(found, expected)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_a_gguf_dequantized_on_the_gpu_computes_what_the_cpu_does(qtype: Q, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", qtype)
    on_cpu = load_model(str(path), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant())
    on_gpu = load_model(str(path), CUDA, torch.float32, chunking=RowChunking.batch_invariant(), quantization="auto")
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, on_cpu.config.vocab_size, seed=2)
    use_compute_path(on_cpu.model, "torch")
    expected = prefill_then_decode(PagedSequences(on_cpu.model), tokens, PROMPT_LEN)
    found = logits_on_every_path(on_gpu.model, tokens)
    errors = relative_errors(found, expected)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("variant", ["gemma2", "mixtral", "qwen3-moe"])
def test_a_variant_served_in_bfloat16_is_verified_and_batch_invariant(variant: str, tmp_path: Path) -> None:
    """Gemma 2's soft-capped, sliding-window attention on Triton; the mixtures of experts' routing on torch."""
    arch, overrides = test_variant_parity.GGUF_VARIANTS[variant]
    checkpoint = make_tiny_checkpoint(arch, tmp_path / "hf", **overrides)
    gguf = write_gguf_from_checkpoint(checkpoint, tmp_path / f"{arch}.gguf")
    loaded = load_engine_model(EngineConfig(model=str(gguf), device="cuda", dtype="bfloat16"))
    engine = engine_for(loaded)
    report = loaded.invariance
    assert report is not None and report.verified, report and report.summary()
    assert report.path == compute_paths(loaded.model)[0]
    vocab = loaded.config.vocab_size
    requests = {f"r{i}": random_tokens(5 + 7 * i, vocab, seed=10 + i) for i in range(8)}
    together = generate(engine, requests, GREEDY)
    for request_id, prompt_ids in requests.items():
        assert generate(engine_for(loaded), {request_id: prompt_ids}, GREEDY)[request_id] == together[request_id]
