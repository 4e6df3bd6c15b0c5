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
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from statelm.gguf_vocab import VocabError, build_gguf_vocab, bytes_to_unicode

# Special tokens that end an assistant turn in common chat templates; they stop generation too.
# One text at a time: no rayon pool, so no warning (and no disabled pool) in processes forked after tokenizing
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

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
        append_tokens: Sequence[str] = (),
        unused_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.append_tokens = tuple(append_tokens)
        self._append_ids = [i for i in map(backend.token_to_id, self.append_tokens) if i is not None]
        self._unused_ids = frozenset(unused_ids)  # a GGUF's padding tokens: rendered as no text, as llama.cpp does
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._added_text = {i: tok.content for i, tok in added.items()}
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        specials = {tok.content: i for i, tok in added.items() if tok.special}
        eos = {backend.token_to_id(eos_token)} if eos_token is not None else set()
        eos |= {specials[t] for t in END_OF_TURN_TOKENS if t in specials}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in (*eos, *extra_eos_ids) if i is not None)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._word_pieces = isinstance(backend.model, models.WordPiece)
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json` and its companion config files from a Hugging Face model directory."""
        path = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:
            raise TokenizerError(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        # A tokenizer.json may pad to and truncate at a fixed length (sentence-transformers folders do): a prompt or
        # an input is its own tokens, and one too long is refused where it is checked, never padded or cut here
        backend.no_padding()
        backend.no_truncation()
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
        """Build from decoded GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`), as llama.cpp reads it."""
        try:
            vocab = build_gguf_vocab(fields)
        except VocabError as exc:
            raise TokenizerError(str(exc)) from exc
        return cls(
            vocab.backend,
            bos_token=vocab.bos_token,
            eos_token=vocab.eos_token,
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos_token=vocab.add_bos,
            extra_eos_ids=vocab.extra_eos_ids,
            append_tokens=vocab.append_tokens,
            unused_ids=vocab.unused_ids,
        )

    @functools.cached_property
    def _content_hash(self) -> str:
        named: list[Any] = [self.bos_token, self.eos_token, self.add_bos_token, sorted(self.eos_token_ids)]
        identity = json.dumps([*named, list(self.append_tokens)] if self.append_tokens else named)
        return hashlib.sha256((identity + self.backend.to_str()).encode("utf-8")).hexdigest()

    def content_hash(self) -> str:
        """sha256 of the vocabulary, merges, pre/post-processing and special tokens (not the template)."""
        return self._content_hash

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the model's BOS (and BERT's [SEP], T5's EOS) around it.

        Through `encode_batch`, which lets go of the GIL while it works (`encode` holds it): a long text
        tokenized in a worker thread then leaves the event loop free.
        """
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if not add_special_tokens:
            return ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids + self._append_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a GGUF's unused tokens render as nothing)."""
        kept = [i for i in ids if i not in self._unused_ids] if self._unused_ids else list(ids)
        return self.backend.decode(kept, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (added tokens: their text; a GGUF's unused tokens: none)."""
        if token_id in self._unused_ids:
            return b""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} out of range")
        if self._byte_level:
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            return piece.encode("utf-8")  # an entry stored as plain text (no byte-level merge reaches it)
        if self._word_pieces:
            return piece[2:].encode("utf-8") if piece.startswith("##") else b" " + piece.encode("utf-8")
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
