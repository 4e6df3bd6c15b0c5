"""GGUF vocabularies (`tokenizer.ggml.*`) as Hugging Face `tokenizers` backends that tokenize as llama.cpp does.

Supported `tokenizer.ggml.model` values: `gpt2` (byte-level BPE, with every `tokenizer.ggml.pre` of
`pre_tokenizers.BPE_PRE_TOKENIZERS`), `llama` (SentencePiece BPE, Gemma's included), `gemma4` (SentencePiece-style
BPE), `bert` (WordPiece), `t5` (unigram) and `whitespace`. Any other type raises `VocabError` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from statelm.gguf_vocab.models import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    bpe_backend,
    bytes_to_unicode,
    sentencepiece_backend,
    unigram_backend,
    wordpiece_backend,
)
from statelm.gguf_vocab.pre_tokenizers import (
    BPE_PRE_TOKENIZERS,
    UNSUPPORTED_BPE_PRE_TOKENIZERS,
    BpePreTokenizer,
)

__all__ = ["SUPPORTED_VOCAB_TYPES", "GGUFVocab", "VocabError", "build_gguf_vocab", "bytes_to_unicode"]


class VocabError(ValueError):
    """A GGUF vocabulary statelm cannot tokenize as llama.cpp does."""


@dataclass
class GGUFVocab:
    """A GGUF file's tokenizer: the backend, its special tokens and what encoding with special tokens adds."""

    backend: BackendTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    append_tokens: tuple[str, ...] = ()  # after the text (BERT's [SEP], T5's </s>)
    extra_eos_ids: list[int] = field(default_factory=list)
    unused_ids: frozenset[int] = frozenset()  # tokens llama.cpp renders as no text (type unused)


@dataclass(frozen=True)
class _Defaults:
    """llama.cpp's special-token ids and flags for a vocabulary type, where the file does not set them."""

    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    add_bos: bool = False
    add_eos: bool = False


_DEFAULTS = {
    "llama": _Defaults(bos=1, eos=2, unk=0, add_bos=True),
    "bert": _Defaults(bos=101, unk=100, add_bos=True),
    "gpt2": _Defaults(bos=11, eos=11),
    "whitespace": _Defaults(bos=11, eos=11),
    "gemma4": _Defaults(add_bos=True),
    "t5": _Defaults(eos=1, unk=2, add_eos=True),
}
SUPPORTED_VOCAB_TYPES = tuple(_DEFAULTS)


def build_gguf_vocab(fields: Mapping[str, Any]) -> GGUFVocab:
    """The tokenizer of a GGUF file from its decoded metadata; raises VocabError where llama.cpp's is not matched."""
    kind = fields.get("tokenizer.ggml.model")
    # An empty entry gets a placeholder name, as llama.cpp gives it, so that every id keeps a distinct text.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(fields.get("tokenizer.ggml.tokens") or [])]
    if not tokens:
        raise VocabError("GGUF file has no tokenizer.ggml.tokens")
    if kind not in _DEFAULTS:
        raise VocabError(f"unsupported GGUF tokenizer model {kind!r} (supported: {', '.join(SUPPORTED_VOCAB_TYPES)})")
    token_types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    defaults = _DEFAULTS[kind]
    pre = _pre_tokenizer(kind, fields)

    def token_id(key: str, default: int | None) -> int | None:
        index = fields.get(f"tokenizer.ggml.{key}", default)
        return int(index) if index is not None and 0 <= int(index) < len(tokens) else None

    bos_default = defaults.bos if pre is None or pre.default_bos else None
    bos_id = token_id("bos_token_id", token_id("cls_token_id", bos_default) if kind == "bert" else bos_default)
    eos_id = token_id("eos_token_id", defaults.eos)
    unk_id = token_id("unknown_token_id", defaults.unk)
    if kind == "bert" and unk_id is None:
        raise VocabError("GGUF bert vocabulary has no unknown token")
    try:
        backend = _backend(kind, fields, tokens, token_types, pre, unk_id)
    except Exception as exc:  # the tokenizers library raises bare Exception for malformed vocabularies
        raise VocabError(f"malformed GGUF tokenizer: {exc}") from exc

    named = [bos_id, eos_id, unk_id, token_id("padding_token_id", None)]
    _add_special_tokens(backend, fields, tokens, token_types, named)
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", pre.add_bos if pre else defaults.add_bos))
    if kind == "gemma4":
        add_bos = True  # llama.cpp overrides the file for Gemma 4
    append: tuple[str, ...] = ()
    if kind == "bert":
        sep_id = token_id("seperator_token_id", 102)
        append = (tokens[sep_id],) if sep_id is not None else ()
    elif eos_id is not None and bool(fields.get("tokenizer.ggml.add_eos_token", defaults.add_eos)):
        append = (tokens[eos_id],)
    extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields]
    return GGUFVocab(
        backend=backend,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos=add_bos,
        append_tokens=append,
        extra_eos_ids=[int(i) for i in extra],
        unused_ids=frozenset(i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_UNUSED),
    )


def _pre_tokenizer(kind: str, fields: Mapping[str, Any]) -> BpePreTokenizer | None:
    """The BPE pre-tokenizer named by `tokenizer.ggml.pre` (None for the non-BPE types)."""
    if kind in ("gemma4", "whitespace"):
        return BPE_PRE_TOKENIZERS[kind]
    if kind != "gpt2":
        return None
    name = str(fields.get("tokenizer.ggml.pre") or "default")
    if name in UNSUPPORTED_BPE_PRE_TOKENIZERS or name not in BPE_PRE_TOKENIZERS:
        raise VocabError(f"unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre)")
    return BPE_PRE_TOKENIZERS[name]


def _backend(
    kind: str,
    fields: Mapping[str, Any],
    tokens: list[str],
    token_types: list[int],
    pre: BpePreTokenizer | None,
    unk_id: int | None,
) -> BackendTokenizer:
    if pre is not None:
        return bpe_backend(fields, tokens, pre, split_words=kind == "whitespace")
    if kind == "llama":
        return sentencepiece_backend(fields, tokens, token_types)
    if kind == "bert":
        assert unk_id is not None  # the caller refuses a bert vocabulary without one
        return wordpiece_backend(fields, tokens, token_types, tokens[unk_id])
    return unigram_backend(fields, tokens, unk_id)


def _add_special_tokens(
    backend: BackendTokenizer,
    fields: Mapping[str, Any],
    tokens: Sequence[str],
    token_types: Sequence[int],
    named: Sequence[int | None],
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched whole).

    Then the file's named tokens (BOS, EOS, unknown, padding) are made special too. Whitespace next to some
    tokens is absorbed as llama.cpp does for those models (Phi-3's chat markers, the embedding models' mask).
    """
    lstrip, rstrip = _stripping_tokens(fields, tokens, token_types)

    def added(token: str, special: bool) -> AddedToken:
        return AddedToken(token, normalized=False, special=special, lstrip=token in lstrip, rstrip=token in rstrip)

    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens([added(tok, True) for tok, kind in typed if kind == TOKEN_TYPE_CONTROL])
    backend.add_tokens([added(tok, False) for tok, kind in typed if kind == TOKEN_TYPE_USER_DEFINED])
    backend.add_special_tokens([added(tokens[i], True) for i in named if i is not None])


def _stripping_tokens(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]
) -> tuple[frozenset[str], frozenset[str]]:
    """Added tokens that swallow the whitespace before (lstrip) or after (rstrip) them, per llama.cpp's model rules."""
    name = str(fields.get("general.name") or "").lower()
    pre = str(fields.get("tokenizer.ggml.pre") or "")
    arch = str(fields.get("general.architecture") or "")
    if any(n in pre for n in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        n in arch for n in ("nomic-bert-moe", "jina-bert-v3")
    ):
        return frozenset({"<mask>"}), frozenset()
    if "phi-3" in name or "phi3" in name:
        special = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)
        marked = {t for t, kind in zip(tokens, token_types, strict=False) if kind in special} | {"</s>"}
        return frozenset(), frozenset(marked - {"<unk>", "<s>", "<|endoftext|>"})
    if "modern-bert" in name:
        return frozenset({"[MASK]"}), frozenset()
    return frozenset(), frozenset()
