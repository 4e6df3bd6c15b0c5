"""The statelm decoder over a shuffled paged KV cache matches transformers' logits, alone and batched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from statelm.attention.base import AttentionMetadata
from statelm.engine.kv_cache import KVCache
from statelm.models.config import ModelConfig, ModelConfigError
from statelm.models.llama import LlamaForCausalLM
from tests.models.tiny_checkpoints import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
PROMPT_LEN = 64
DECODE_STEPS = 16

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama3", {}),
    "mistral": ("mistral", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 24}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-qk-norm-tied": ("qwen3", {"tie_word_embeddings": True}),
    # Qwen2.5's long context: YaRN over an original context (32) shorter than the test's 80 tokens
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 1e6,
            }
        },
    ),
    "llama-yarn-mscale": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "rope_theta": 10000.0,
            }
        },
    ),
}


class PagedSequences:
    """Test driver: gives sequences blocks in shuffled order and runs one flat forward per step, on the model's
    device."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 32, seed: int = 0) -> None:
        config = model.config
        self.model = model
        self.cache = KVCache(
            config.num_hidden_layers,
            num_blocks,
            BLOCK_SIZE,
            config.num_key_value_heads,
            config.head_dim,
            model.dtype,
            model.device,
        )
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each sequence its new tokens in one batched forward; return float32 logits per sequence (on the CPU)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        for seq_id, tokens in chunks.items():
            table = self.tables.setdefault(seq_id, [])
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            query_start.append(query_start[-1] + len(tokens))
            self.lens[seq_id] = end
        width = max(len(self.tables[s]) for s in chunks)
        device = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            block_tables=torch.tensor(
                [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks], device=device
            ),
            query_lens=[len(t) for t in chunks.values()],
            seq_lens=[self.lens[s] for s in chunks],
            query_start=query_start,
        )
        with torch.inference_mode():
            ids_tensor, positions_tensor = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
            hidden = self.model(ids_tensor, positions_tensor, self.cache, meta)
            logits = self.model.compute_logits(hidden).cpu()
        return {s: logits[query_start[i] : query_start[i + 1]] for i, s in enumerate(chunks)}


def load_statelm(path: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the statelm model from a checkpoint directory."""
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights((name, t) for name, t in load_file(path / "model.safetensors").items())
    return model


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 eager logits [len(tokens), vocab] for one full-sequence forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def random_tokens(count: int, vocab: int, seed: int) -> list[int]:
    """Reproducible random token ids."""
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_then_decode(runner: PagedSequences, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Prefill tokens[:prompt_len] in one step, then feed the rest one per step; logits of every position."""
    outputs = [runner.step({0: tokens[:prompt_len]})[0]]
    outputs += [runner.step({0: [token]})[0] for token in tokens[prompt_len:]]
    return torch.cat(outputs)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One llama checkpoint shared by the batching tests."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant: str, tmp_path: Path) -> None:
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    model = load_statelm(path)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, model.config.vocab_size, seed=1)
    ours = prefill_then_decode(PagedSequences(model), tokens, PROMPT_LEN)
    expected = hf_logits(path, tokens)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-4


def test_batched_sequences_match_running_alone(llama_dir: Path) -> None:
    model = load_statelm(llama_dir)
    a = random_tokens(43, model.config.vocab_size, seed=2)
    b = random_tokens(31, model.config.vocab_size, seed=3)

    alone_a = PagedSequences(model, seed=4)
    expected_a = [alone_a.step({0: a[:40]})[0], alone_a.step({0: [a[40]]})[0], alone_a.step({0: [a[41]]})[0]]
    alone_b = PagedSequences(model, seed=5)
    expected_b = [alone_b.step({1: b[:30]})[1], alone_b.step({1: [b[30]]})[1]]

    batched = PagedSequences(model, seed=6)
    first = batched.step({0: a[:40]})
    prefill_with_decode = batched.step({0: [a[40]], 1: b[:30]})
    two_decodes = batched.step({0: [a[41]], 1: [b[30]]})

    pairs = [
        (first[0], expected_a[0]),
        (prefill_with_decode[0], expected_a[1]),
        (prefill_with_decode[1], expected_b[0]),
        (two_decodes[0], expected_a[2]),
        (two_decodes[1], expected_b[1]),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_chunked_prefill_matches_single_chunk(llama_dir: Path) -> None:
    model = load_statelm(llama_dir)
    tokens = random_tokens(PROMPT_LEN, model.config.vocab_size, seed=7)
    whole = PagedSequences(model, seed=8).step({0: tokens})[0]
    chunked_runner = PagedSequences(model, seed=9)
    chunks = [tokens[:24], tokens[24:48], tokens[48:]]
    chunked = torch.cat([chunked_runner.step({0: chunk})[0] for chunk in chunks])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_float32(llama_dir: Path, dtype: torch.dtype) -> None:
    tokens = random_tokens(40, 512, seed=10)
    reference = prefill_then_decode(PagedSequences(load_statelm(llama_dir)), tokens, 32)
    half = prefill_then_decode(PagedSequences(load_statelm(llama_dir, dtype)), tokens, 32)
    assert half.dtype == torch.float32
    assert (half - reference).abs().max().item() < 0.1


def test_load_weights_reports_unknown_and_missing(llama_dir: Path) -> None:
    weights = load_file(llama_dir / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    del weights["model.norm.weight"]
    config = ModelConfig.from_hf_dict(json.loads((llama_dir / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"mlp\.extra\.weight.*model\.norm\.weight"):
        LlamaForCausalLM(config).load_weights(weights.items())


def test_unsupported_rope_scaling_is_rejected(llama_dir: Path) -> None:
    raw = json.loads((llama_dir / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    with pytest.raises(ModelConfigError, match="dynamic"):
        LlamaForCausalLM(ModelConfig.from_hf_dict(raw))
