"""Tokenizer, chat template rendering (sandboxed jinja2) and incremental detokenization."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# Special tokens that end an assistant turn in common chat templates; they stop generation too.
# One text at a time: no rayon pool, so no warning (and no disabled pool) in processes forked after tokenizing
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split expressions, as llama.cpp (llama-vocab.cpp) and the models' tokenizer.json use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, or rejected the conversation."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded."""


class Tokenizer:
    """Text <-> token ids, special tokens and the model's chat template, on top of HF `tokenizers`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._added_text = {i: tok.content for i, tok in added.items()}
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        specials = {tok.content: i for i, tok in added.items() if tok.special}
        eos = {backend.token_to_id(eos_token)} if eos_token is not None else set()
        eos |= {specials[t] for t in END_OF_TURN_TOKENS if t in specials}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in (*eos, *extra_eos_ids) if i is not None)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json` and its companion config files from a Hugging Face model directory."""
        path = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:
            raise TokenizerError(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        bos = _token_content(config.get("bos_token", special_map.get("bos_token")))
        eos = _token_content(config.get("eos_token", special_map.get("eos_token")))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            bos_id = backend.token_to_id(bos) if bos else None
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        template_file = path / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_template(config.get("chat_template"))
        )
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            chat_template=template,
            add_bos_token=bool(add_bos),
            extra_eos_ids=[int(i) for i in extra],
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from decoded GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = fields.get("tokenizer.ggml.model")
        tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens")
        token_types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        builders = {"gpt2": _gguf_byte_level_backend, "llama": _gguf_sentencepiece_backend}
        if kind not in builders:
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        try:
            backend = builders[kind](fields, tokens, token_types)
        except Exception as exc:  # the tokenizers library raises bare Exception for malformed vocabularies
            raise TokenizerError(f"malformed GGUF tokenizer: {exc}") from exc

        def token(key: str) -> str | None:
            index = fields.get(f"tokenizer.ggml.{key}")
            return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

        _add_gguf_special_tokens(backend, tokens, token_types, kind == "gpt2")
        named = [token(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named if t])
        extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields]
        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            extra_eos_ids=[int(i) for i in extra],
        )

    @functools.cached_property
    def _content_hash(self) -> str:
        identity = json.dumps([self.bos_token, self.eos_token, self.add_bos_token, sorted(self.eos_token_ids)])
        return hashlib.sha256((identity + self.backend.to_str()).encode("utf-8")).hexdigest()

    def content_hash(self) -> str:
        """sha256 of the vocabulary, merges, pre/post-processing and special tokens (not the template)."""
        return self._content_hash

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` prepends BOS when the model wants it.

        Through `encode_batch`, which lets go of the GIL while it works (`encode` holds it): a long text
        tokenized in a worker thread then leaves the event loop free.
        """
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (added tokens: their text)."""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} out of range")
        if self._byte_level:
            return bytes(self._byte_decoder[c] for c in piece)
        match = _BYTE_PIECE.match(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )


class IncrementalDetokenizer:
    """Streaming decode: emits text as tokens arrive, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Append one token and return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._advance(prefix_text, new_text)

    def flush(self) -> str:
        """Return whatever text is still held back (end of the stream)."""
        prefix_text, new_text = self._window_texts()
        return self._advance(prefix_text, new_text) if len(new_text) > len(prefix_text) else ""

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        split = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        prefix_text = decode(window[:split], skip_special_tokens=self._skip) if split else ""
        return prefix_text, decode(window, skip_special_tokens=self._skip)

    def _advance(self, prefix_text: str, new_text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]


# --- chat templates -------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker), rendered as-is."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block body and render it unchanged."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"invalid chat template: {exc}") from exc


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render a chat template in the sandbox; template failures raise ChatTemplateError."""
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


# --- loading helpers ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
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


def _gguf_byte_level_backend(fields: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), pre-tokenized as llama.cpp does for `ggml.pre`."""
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    vocab = {
        tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    pre = str(fields.get("tokenizer.ggml.pre") or "default")
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRE))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    if pre in _QWEN2_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the original tokenizer.json for a llama.cpp `tokenizer.ggml.pre` name."""
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _gguf_sentencepiece_backend(
    fields: Mapping[str, Any], tokens: list[str], token_types: list[int]
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
        unk = next((t for t, kind in zip(tokens, token_types, strict=False) if kind == _TOKEN_TYPE_UNKNOWN), None)
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # Like llama.cpp and sentencepiece: every text fragment (the start, and after each added token) gets the
    # space prefix, even one already starting with a space; `Metaspace(prepend_scheme="first")` would not.
    spaces = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if add_prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
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


def _add_gguf_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched whole)."""
    alphabet = set(_bytes_to_unicode().values())
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and (not byte_level or set(tok) <= alphabet)
    ]
    backend.add_special_tokens(control)
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_tokens(user)
