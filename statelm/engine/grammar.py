"""Constrained decoding with llguidance: JSON schemas, JSON objects, regexes and EBNF/GBNF/Lark grammars as token masks.

Why llguidance rather than xgrammar: a 3 MB wheel with no Python dependencies (xgrammar pulls in triton and
transformers); a grammar is ready in a few milliseconds with no per-grammar precompilation, its masks are
computed lazily; GBNF (llama.cpp/vLLM EBNF), Lark, JSON schema and regex in one engine, unsupported schema
keywords and bad grammars reported as messages (a 400), never a crash. Its masks cost more than
xgrammar's precomputed ones (about 0.4 ms per row with a 49k vocabulary, bench/structured.py), still far
below a decode step.

Flow: the API layer calls `GrammarBackend.compile` (GrammarError -> 400) and hands the result to the engine,
which starts a `GrammarMatcher` per sequence (in its `OutputGuide`). Each step the sampler fills the bitmask
rows of the constrained sequences (`fill_bitmask`, in parallel), applies them to the logits (`apply_bitmask`),
samples, then `accept`s each sampled (or forced) token; a sequence whose `is_terminated()` is true is done.
Compiling a huge schema can take long (llguidance releases the GIL meanwhile): call it off the event loop.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import torch

from statelm.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "grammar")
# JSON layout: compact, spaced or indented, but never unbounded whitespace, in which small models get stuck
# (llama.cpp's JSON grammars bound it the same way).
_JSON_OPTIONS: Any = {"whitespace_pattern": r"[ ]?|\n[ \t]{0,20}"}
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # error messages go to clients: no grammar dumps
_MAX_ERROR_CHARS = 1000
_EXECUTOR = llguidance.LLExecutor()  # computes the masks of a batch's rows in parallel


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; the message is fit for a 400 response."""


class CompiledGrammar:
    """A validated constraint, ready to start matchers from."""

    def __init__(self, kind: str, prototype: llguidance.LLMatcher, vocab_size: int) -> None:
        self.kind = kind
        self.vocab_size = vocab_size
        self._prototype = prototype


class GrammarMatcher:
    """One sequence's place in its grammar: masks the next token and follows the sampled ones.

    With `start_after` (token ids, e.g. the encoded `</think>`), the matcher constrains nothing until the
    output has produced that sequence, so the constraint starts after the reasoning. Pass it only when the
    output will reason (the prompt opened a think block, or a thinking model's prompt did not close one): if
    the model never ends a block, the constraint never starts, unless a reasoning budget forces the end tag.
    """

    def __init__(self, grammar: CompiledGrammar, *, start_after: Sequence[int] = ()) -> None:
        self._matcher = grammar._prototype.deep_copy()
        self.mask_words = (grammar.vocab_size + 31) // 32  # int32 words of a mask row: one bit per token
        self._trigger = tuple(start_after)
        self._recent: tuple[int, ...] = ()
        self.active = not self._trigger

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf (one row; for a batch see `fill_bitmask`)."""
        if self.active:
            row = torch.empty(self.mask_words, dtype=torch.int32)
            self.fill_bitmask_row(row)
            apply_bitmask(logits_row.view(1, -1), row.view(1, -1))

    def accept(self, token_id: int) -> bool:
        """Follow a sampled token; False if the grammar forbids it (the matcher then stays in error)."""
        if not self.active:
            self._recent = (*self._recent, token_id)[-len(self._trigger) :]
            self.active = self._recent == self._trigger
            return True
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and allows nothing more (not even whitespace): the sequence is done."""
        return self.active and self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed (a forbidden token was accepted), or an empty string."""
        return self._matcher.get_error()

    def fill_bitmask_row(self, row: torch.Tensor) -> None:
        """Write the allowed-token bits into the first `mask_words` words of a contiguous CPU int32 row."""
        if row.dtype != torch.int32 or row.is_cuda or not row.is_contiguous() or len(row) < self.mask_words:
            raise ValueError(f"a grammar mask row must be a contiguous CPU int32 tensor of >= {self.mask_words} words")
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.mask_words * 4)


class GrammarBackend:
    """llguidance bound to one tokenizer's vocabulary: compiles constraints (LRU-cached) and fills token masks."""

    def __init__(self, tokenizer: Tokenizer, *, cache_size: int = 128) -> None:
        if not tokenizer.eos_token_ids:
            raise ValueError("constrained decoding needs a tokenizer with an end-of-sequence token")
        self.vocab_size = tokenizer.vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=sorted(tokenizer.eos_token_ids)
        )
        self._compile_cached = functools.lru_cache(maxsize=cache_size)(self._compile)

    def compile(self, kind: str, spec: str | Mapping[str, Any] | None = None) -> CompiledGrammar:
        """Compile a constraint: `json_object` (no spec), `json_schema` (a schema, dict or JSON text), `regex`,
        or `grammar` (GBNF/EBNF as llama.cpp and vLLM take it, or Lark). Raises GrammarError if it is invalid."""
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        if kind == "json_object":
            return self._compile_cached(kind, "")
        if isinstance(spec, Mapping) and kind == "json_schema":
            return self._compile_cached(kind, json.dumps(spec))
        if not isinstance(spec, str) or not spec:
            raise GrammarError(f"{kind} must be a non-empty {'object' if kind == 'json_schema' else 'string'}")
        return self._compile_cached(kind, spec)

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        try:
            if kind in ("json_object", "json_schema"):
                schema = json.loads(spec) if spec else {"type": "object"}
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be a JSON object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            else:
                grammar = llguidance.grammar_from("grammar", spec)
        except ValueError as exc:  # json.JSONDecodeError, and llguidance's GBNF conversion errors
            raise GrammarError(_error_message(kind, str(exc))) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=_LIMITS)
        if error:
            raise GrammarError(_error_message(kind, error))
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if prototype.is_error():
            raise GrammarError(_error_message(kind, prototype.get_error()))
        return CompiledGrammar(kind, prototype, self.vocab_size)


def fill_bitmask(matchers: Sequence[GrammarMatcher], width: int) -> torch.Tensor:
    """The int32 masks [len(matchers), ceil(width / 32)] of the tokens each matcher allows next.

    Rows are computed in parallel by llguidance's executor; columns past the tokenizer's vocabulary (padding
    in logits `width` wide) are never allowed.
    """
    words = matchers[0].mask_words  # matchers of one backend share its vocabulary
    scratch = torch.empty((len(matchers), words), dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].fill_bitmask_row(scratch[0])
    else:
        pairs = [(matcher._matcher, row) for row, matcher in enumerate(matchers)]
        _EXECUTOR.unsafe_compute_mask_ptr(pairs, scratch.data_ptr(), words * 4, len(matchers))
    bitmask = torch.zeros((len(matchers), max(words, (width + 31) // 32)), dtype=torch.int32)
    bitmask[:, :words] = scratch
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens whose bit is 0 to -inf (in place); `bitmask` is [batch, ceil(width / 32)] int32.

    Rows that allow everything (all bits set: no constraint) are skipped.
    """
    rows = (bitmask != -1).any(dim=1).nonzero().flatten()
    if len(rows) == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask[rows].to(logits.device, non_blocking=True).unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    if allowed.shape[1] < logits.shape[1]:  # a mask narrower than the logits allows none of the extra columns
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]), value=False)
    rows = rows.to(logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def tool_call_schema(
    tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] = "required", *, parallel: bool = True
) -> dict[str, Any]:
    """JSON schema of a forced tool call, `[{"name": ..., "arguments": {...}}, ...]`, from OpenAI `tools`.

    `tool_choice` is "required" (one or more calls to any tool; just one unless `parallel`) or
    {"type": "function", "function": {"name": ...}} (exactly one call to that function). Parse the output
    with `statelm.api.parsers.tools.ForcedToolParser`.
    """
    functions = [tool.get("function") for tool in tools if isinstance(tool, Mapping)]
    functions = [f for f in functions if isinstance(f, Mapping) and isinstance(f.get("name"), str)]
    if isinstance(tool_choice, Mapping):
        named = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise GrammarError(f"tool_choice names function {named!r}, which is not among the tools")
        parallel = False
    elif tool_choice != "required":
        raise GrammarError(f"tool_choice {tool_choice!r} does not force a call")
    if not functions:
        raise GrammarError("tool_choice 'required' needs at least one function tool")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    schema["minItems"] = 1
    if not parallel:
        schema["maxItems"] = 1
    return schema


class _Vocabulary:
    """The view of a statelm Tokenizer that llguidance.TokenizerWrapper reads: token bytes, specials, encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [_token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        """Token ids of `text` (llguidance tokenizes forced text with it)."""
        return self._encode(text)


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    try:
        return tokenizer.token_bytes(token_id)
    except IndexError:  # a hole in the id range: a token no text can produce
        return b""


def _error_message(kind: str, detail: str) -> str:
    detail = detail.strip()
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + "…"
    return f"invalid {kind.replace('_', ' ')}: {detail}"
