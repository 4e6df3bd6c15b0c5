"""Tokenizer loading (HF directory, GGUF fields) and the incremental detokenizer."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from statelm.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_PIECES = [
    "hello",
    "world",
    "tokens",
    "stream",
    " ",
    "  ",
    "    ",
    "\n",
    "\n\n",
    "\t",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇯🇵",
    "中文字符",
    "日本語",
    "한국어",
    "Ελληνικά",
    "кириллица",
    "e\u0301",
    "a\u0308\u0301",
    "naïve",
    "ß",
    "def f(x):\n    return x",
    "if a<b: {c}",
    "1234567",
    "3.14",
    "\u200b",
    "\u00a0",
    "'s",
    "don't",
    "<|im_start|>",
    "<|im_end|>",
    "￼",
    "\U0001f9d1\u200d\U0001f4bb",
]


_RARE = ["🦀", "ॐ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "Ꙭ", "\U0010fffd"]  # not in the training corpus: byte fallback / byte BPE


def _strings(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = _PIECES + _RARE
    out = list(pool)
    while len(out) < count:
        out.append("".join(rng.choice(pool) + rng.choice(["", " "]) for _ in range(rng.randint(1, 10))))
    return out


def _corpus() -> list[str]:
    rng = random.Random(0)
    plain = [p for p in _PIECES if not p.startswith("<|")]
    return [" ".join(rng.choice(plain) for _ in range(12)) for _ in range(400)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE in a Hugging Face directory layout (vocab too small for whole CJK/emoji)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_corpus(), trainer)
    directory = tmp_path_factory.mktemp("hf")
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "special": True},
        "eos_token": "<|endoftext|>",
        "add_bos_token": True,
        "chat_template": [
            {
                "name": "default",
                "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
            },
            {"name": "tool_use", "template": "tools!"},
        ],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    return directory


@pytest.fixture(scope="module")
def byte_tok(hf_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(hf_dir)


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    """A SentencePiece BPE (byte fallback) turned into GGUF-style fields."""
    spm = pytest.importorskip("sentencepiece")
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=proto,
        vocab_size=400,
        model_type="bpe",
        character_coverage=0.98,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    size = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 4 if i in (3, 4) else 1
        for i in range(size)
    ]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(size)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(size)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    return Tokenizer.from_gguf_fields(fields)


def test_from_hf_dir_reads_configs(byte_tok: Tokenizer) -> None:
    assert byte_tok.bos_token == "<|im_start|>" and byte_tok.bos_token_id == 1
    assert byte_tok.eos_token == "<|endoftext|>"
    assert byte_tok.eos_token_ids == frozenset({0, 2, 7})  # eos, <|im_end|>, generation_config
    assert byte_tok.add_bos_token and byte_tok.vocab_size == 330
    assert byte_tok.chat_template == "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert byte_tok.encode("hello", add_special_tokens=True)[0] == 1
    assert byte_tok.encode("hello")[0] != 1
    assert byte_tok.encode("<|im_end|>") == [2]
    assert byte_tok.is_special(2) and not byte_tok.is_special(byte_tok.encode("hello")[0])


def test_from_hf_dir_matches_transformers(hf_dir: Path, byte_tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for text in _strings(100, seed=5):
        ids = byte_tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert byte_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template_file_takes_precedence_and_bos_inferred(hf_dir: Path, tmp_path: Path) -> None:
    backend = Backend.from_file(str(hf_dir / "tokenizer.json"))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template == "{{ messages[0].content }}"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == frozenset({2})
    assert tok.bos_token is None and not tok.add_bos_token
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_padding_and_truncation_in_tokenizer_json_are_off(hf_dir: Path, byte_tok: Tokenizer, tmp_path: Path) -> None:
    """A tokenizer.json that pads to and truncates at a fixed length (as sentence-transformers ship) does neither."""
    backend = Backend.from_file(str(hf_dir / "tokenizer.json"))
    backend.enable_padding(pad_id=0, pad_token="<|endoftext|>", length=64)
    backend.enable_truncation(max_length=3)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text((hf_dir / "tokenizer_config.json").read_text())
    assert len(backend.encode("hello world").ids) == 64  # what the file asks for
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.backend.padding is None and tok.backend.truncation is None
    text = "hello world tokens stream hello world"
    assert tok.encode(text) == byte_tok.encode(text) and len(tok.encode(text)) > 3
    assert tok.encode(text, add_special_tokens=True) == byte_tok.encode(text, add_special_tokens=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    assert tok.encode(prompt) == byte_tok.encode(prompt)


def test_content_hash(hf_dir: Path, byte_tok: Tokenizer, spm_tok: Tokenizer) -> None:
    assert byte_tok.content_hash() == Tokenizer.from_hf_dir(hf_dir).content_hash()
    assert len({byte_tok.content_hash(), spm_tok.content_hash()}) == 2


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


def test_token_bytes_concatenate_to_text(byte_tok: Tokenizer, spm_tok: Tokenizer) -> None:
    for text in _strings(60, seed=6):
        assert b"".join(byte_tok.token_bytes(i) for i in byte_tok.encode(text)) == text.encode()
        spm_bytes = b"".join(spm_tok.token_bytes(i) for i in spm_tok.encode(text))
        if "<|" not in text:
            assert spm_bytes == b" " + text.encode()  # SentencePiece's space prefix


def test_sentencepiece_uses_byte_fallback(spm_tok: Tokenizer) -> None:
    pieces = [spm_tok.backend.id_to_token(i) for i in spm_tok.encode("🦀 hello")]
    assert pieces[:5] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_full_decode(
    kind: str, skip_special_tokens: bool, byte_tok: Tokenizer, spm_tok: Tokenizer
) -> None:
    tok = byte_tok if kind == "byte_level" else spm_tok
    for text in _strings(250, seed=7):
        ids = tok.encode(text, add_special_tokens=True)
        stream = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        chunks = [stream.add(i) for i in ids]
        chunks.append(stream.flush())
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip_special_tokens), text
        assert not any("\ufffd" in c for c in chunks), text


def test_incremental_detokenizer_holds_partial_characters(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("😀")
    assert len(ids) > 1  # the tiny vocabulary splits the emoji into byte tokens
    stream = IncrementalDetokenizer(byte_tok)
    assert [stream.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.add(ids[-1]) == "😀"
    assert stream.flush() == ""
    truncated = IncrementalDetokenizer(byte_tok)
    assert "".join(truncated.add(i) for i in ids[:-1]) == ""
    assert truncated.flush() == byte_tok.decode(ids[:-1])


def test_incremental_detokenizer_decodes_small_windows(byte_tok: Tokenizer, monkeypatch: Any) -> None:
    ids = byte_tok.encode(" ".join(_strings(80, seed=8)))
    assert len(ids) > 1000
    widths: list[int] = []
    decode = byte_tok.decode

    def spy(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        widths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(byte_tok, "decode", spy)
    stream = IncrementalDetokenizer(byte_tok)
    text = "".join(stream.add(i) for i in ids) + stream.flush()
    monkeypatch.undo()
    assert text == byte_tok.decode(ids)
    assert max(widths) <= 16
