"""One Hugging Face `tokenizers` backend per llama.cpp vocabulary type, built from `tokenizer.ggml.*` fields."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from statelm.gguf_vocab.pre_tokenizers import BpePreTokenizer

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5  # a converter's padding up to the embedding's size: rendered as no text
SPACE_MARK = "\u2581"  # SentencePiece's visible space


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_backend(
    fields: Mapping[str, Any], tokens: Sequence[str], pre: BpePreTokenizer, split_words: bool = False
) -> BackendTokenizer:
    """BPE over the file's merges, pre-tokenized as llama.cpp does for `pre`.

    Vocabulary entries are looked up by their stored text, as llama.cpp does: a byte-level vocabulary stores
    its pieces in GPT-2's byte alphabet, and added tokens (spaces runs, `<｜begin▁of▁sentence｜>`) as plain
    text. `split_words` drops whitespace between words first and lowercases unless told not to (llama.cpp's
    `whitespace` tokenizer).
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(vocab, _merges(fields), ignore_merges=pre.ignore_merges, byte_fallback=not pre.byte_level)
    backend = BackendTokenizer(model)
    normalizer = pre.normalizer()
    if split_words:
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        default_lowercase = fields.get("tokenizer.ggml.pre") != "whitespace"
        if fields.get("tokenizer.ggml.normalizer.lowercase", default_lowercase):
            normalizer = normalizers.Lowercase()
    else:
        backend.pre_tokenizer = pre.pre_tokenizer()
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre.byte_level:
        backend.decoder = decoders.ByteLevel()
    else:
        backend.decoder = _pieces_decoder(strip_space=False, escaped=pre.escape_spaces)
    return backend


def _merges(fields: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs; like llama.cpp, the split is the first space after the first character."""
    merges = fields.get("tokenizer.ggml.merges") or []
    return [(merge[:cut], merge[cut + 1 :]) for merge in merges if (cut := merge.find(" ", 1)) > 0]


def sentencepiece_backend(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int]
) -> BackendTokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) with byte fallback and `▁` spaces."""
    scores = list(fields.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in fields:
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, scores)
    unk_index = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_index)] if unk_index is not None else None
    if unk is None:
        unk = next((t for t, kind in zip(tokens, token_types, strict=False) if kind == TOKEN_TYPE_UNKNOWN), None)
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # Like llama.cpp and sentencepiece: every text fragment (the start, and after each added token) gets the
    # space prefix, even one already starting with a space; `Metaspace(prepend_scheme="first")` would not.
    spaces = normalizers.Replace(" ", SPACE_MARK)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), spaces]) if add_prefix else spaces
    backend.decoder = _pieces_decoder(strip_space=add_prefix)
    return backend


def _pieces_decoder(strip_space: bool, escaped: bool = True) -> decoders.Decoder:
    """Decoding for SentencePiece-style pieces: `▁` is a space, `<0xXX>` a byte; drop the prefix space if added."""
    steps = [decoders.Replace(SPACE_MARK, " ")] if escaped else []
    steps += [decoders.ByteFallback(), decoders.Fuse()]
    if strip_space:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, by score."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores, strict=False):
        local = [
            (piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def wordpiece_backend(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: Sequence[int], unk: str
) -> BackendTokenizer:
    """BERT's WordPiece (`tokenizer.ggml.model == "bert"`): greedy longest match within each word.

    The GGUF stores a word's first piece with a `▁` in front and continuation pieces bare (llama.cpp's form);
    they go back to BERT's form (bare first pieces, `##` continuations) for `tokenizers`' WordPiece, which
    then matches as llama.cpp does. Words split on whitespace and punctuation, CJK characters stand alone.
    """
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types, strict=False)):
        vocab[_bert_piece(token, kind)] = i
    # BERT's own limit: a word longer than this is [UNK] (llama.cpp splits it; the model was trained on [UNK]).
    backend = BackendTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = bool(fields.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(fields.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # Words joined by spaces, then llama.cpp's clean-up of the spaces BERT's splitting put before punctuation.
    cleanup = [(" ?", "?"), (" !", "!"), (" .", "."), (" ,", ","), (" ' ", "'")]
    cleanup += [(f" '{suffix}", f"'{suffix}") for suffix in ("s", "m", "re", "ve")]
    backend.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="##", cleanup=False), decoders.Fuse()]
        + [decoders.Replace(old, new) for old, new in cleanup]
    )
    return backend


def _bert_piece(token: str, kind: int) -> str:
    if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
        return token
    if token.startswith(SPACE_MARK) and len(token) > 1:
        return token[1:]
    if token.startswith("[") and token.endswith("]"):
        return token  # [unused0] and the like are stored as they are
    return "##" + token


def unigram_backend(fields: Mapping[str, Any], tokens: Sequence[str], unk_id: int | None) -> BackendTokenizer:
    """SentencePiece unigram (`tokenizer.ggml.model == "t5"`): best-scoring segmentation of each fragment.

    Normalized like llama.cpp's UGM tokenizer: the precompiled character map, then (with
    `remove_extra_whitespaces`) runs of spaces collapsed and the ends trimmed, spaces as `▁`, and a `▁` in
    front of the text when `add_space_prefix` (or when spaces are collapsed, as every word then gets one).
    """
    scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    model = models.Unigram([(t, float(s)) for t, s in zip(tokens, scores, strict=False)], unk_id=unk_id)
    backend = BackendTokenizer(model)
    steps: list[normalizers.Normalizer] = []
    charsmap = fields.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(b & 0xFF for b in charsmap)))
    merge_spaces = bool(fields.get("tokenizer.ggml.remove_extra_whitespaces", False))
    if merge_spaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", SPACE_MARK))
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", False))
    if add_prefix or merge_spaces:
        steps.append(normalizers.Prepend(SPACE_MARK))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = _pieces_decoder(strip_space=add_prefix)
    return backend
