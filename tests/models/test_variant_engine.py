"""Llama's variants as the server runs them: the start-up self-check's path, batch invariance and session exactness.

Gemma 2 (soft-capped attention scores) and Gemma 3 run statelm's kernels path (their weights packed from Q8_0
GGUFs) and its fused decoder; so do Phi-3 (fused projections, LongRoPE; Llama's block once loaded) and Granite (from
a Q8_0 GGUF). OLMo 2 (from a Hugging Face folder, in bfloat16 where the CPU computes it) is covered too, and the
mixtures of experts: Qwen3-MoE from a folder and from a Q4_0 GGUF, Mixtral from a Q8_0 GGUF (the GGUFs' experts run
by the packed kernel in their blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.kernels.build import kernels_available
from statelm.models.loader import LoadedModel
from statelm.models.packed import PackedLinear
from statelm.tokenizer import ChatTemplateError
from tests.models.engine_run import generate
from tests.models.test_session_engine import run_turn
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_gguf import gemma_style_vocab, write_gguf_from_checkpoint
from tests.models.tiny_model_dir import make_tiny_model_dir

pytestmark = [pytest.mark.invariance]

# Gemma 3 from a Hugging Face folder is also in test_engine.py's invariance test
MODELS = (
    "gemma2-q8_0-gguf",
    "gemma3-q8_0-gguf",
    "phi3-q8_0-gguf",
    "granite-q8_0-gguf",
    "olmo2",
    "qwen3_moe",
    "mixtral-q8_0-gguf",
    "qwen3_moe-q4_0-gguf",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)


def model_path(name: str, folder: Path) -> Path:
    """A tiny model folder (HF checkpoint and ChatML tokenizer), or a GGUF (`arch-format-gguf`) with a Gemma-style
    vocabulary."""
    if not name.endswith("gguf"):
        return make_tiny_model_dir(name, folder)
    arch, qtype, _ = name.split("-")
    overrides = {"query_pre_attn_scalar": 16} if arch.startswith("gemma") else {}
    overrides |= {"mlp_only_layers": []} if arch == "qwen3_moe" else {}  # llama.cpp's qwen3moe: experts everywhere
    checkpoint = make_tiny_checkpoint(arch, folder / "hf", **overrides)
    return write_gguf_from_checkpoint(checkpoint, folder / "model.gguf", Q[qtype.upper()], gemma_style_vocab)


@pytest.fixture(scope="module", params=MODELS)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = model_path(request.param, tmp_path_factory.mktemp(request.param))
    return load_engine_model(EngineConfig(model=str(path)))


def engine_for(loaded: LoadedModel, **settings: object) -> Engine:
    return create_engine(loaded, EngineConfig(**{"kv_cache_memory": 8 << 20, **settings}))


def prompts(loaded: LoadedModel, count: int) -> dict[str, list[int]]:
    """Prompts longer than the tiny models' sliding window (12), of varied lengths."""
    encode = loaded.tokenizer.encode
    return {f"r{i}": encode(f"Request {i}: " + "the quick brown fox " * (3 + i % 4)) for i in range(count)}


def test_the_self_check_picks_the_path_the_architecture_supports(loaded: LoadedModel) -> None:
    engine_for(loaded)
    report, model = loaded.invariance, loaded.model
    assert report is not None and report.verified
    packed = any(isinstance(module, PackedLinear) for module in model.modules())
    if kernels_available() and model.dtype == torch.float32:
        assert model.compute_path == "kernels"  # the Q8_0 GGUFs (a folder is bfloat16 on BF16 CPUs)
        assert (model.fused is not None) == packed  # every architecture's block is in the fused decoder
    assert packed == loaded.fingerprint.parts["weights"].startswith("gguf:")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_alone(loaded: LoadedModel, params: SamplingParams) -> None:
    work = prompts(loaded, 6)
    assert min(len(ids) for ids in work.values()) > 12
    engine = engine_for(loaded, enable_prefix_caching=False)
    together = generate(engine, work, params)
    alone = {rid: generate(engine, {rid: ids}, params)[rid] for rid, ids in work.items()}
    assert together == alone


def test_a_session_turn_equals_the_stateless_request(loaded: LoadedModel) -> None:
    encode = loaded.tokenizer.encode
    engine = engine_for(loaded)
    first = encode("Name three rivers of Europe, please.")
    generated = run_turn(engine, "chat", first, 12)
    second = first + generated + encode(" Which of them is the longest?")
    turn = run_turn(engine, "chat", second, 10, cached=len(first) + len(generated) - 1)
    stateless = generate(engine_for(loaded, enable_prefix_caching=False), {"s": second}, GREEDY)
    assert turn == stateless["s"]


def test_gemma_chat_template_from_the_gguf(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint("gemma2", tmp_path / "hf")
    path = write_gguf_from_checkpoint(checkpoint, tmp_path / "gemma.gguf", tokenizer=gemma_style_vocab)
    tokenizer = load_engine_model(EngineConfig(model=str(path), quantization="none")).tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert (
        text
        == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer.encode(text)
    assert ids[:2] == [2, 3] and tokenizer.token_to_id("<end_of_turn>") in tokenizer.eos_token_ids
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}])
    assert torch.tensor(ids).max() < 512
