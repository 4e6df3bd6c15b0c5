"""The output constraint a request asks for (response_format, vLLM's and llama.cpp's fields, forced tool calls).

Every way of asking comes down to one `OutputConstraint`; `ConstraintCompiler` turns it into the engine's
`CompiledGrammar` off the event loop, with a 400 naming the field for a schema, regex or grammar that is wrong.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from statelm.api.errors import APIError
from statelm.api.protocol import (
    GenerationRequest,
    JSONObjectResponseFormat,
    JSONSchemaResponseFormat,
    StructuredOutputs,
)
from statelm.engine.client import CompiledGrammar, GrammarBackend, GrammarError, tool_call_schema
from statelm.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputConstraint:
    """A constraint kind (see `statelm.engine.grammar.GRAMMAR_KINDS`), its spec, and the field that asked for it."""

    kind: str
    spec: str | Mapping[str, Any] | None
    param: str


def requested_constraint(request: GenerationRequest) -> OutputConstraint | None:
    """The one constraint the request's fields ask for, or None; 400 when it sets more than one."""
    found = [
        constraint
        for constraint in (
            _response_format(request),
            _structured_outputs(request.structured_outputs, "structured_outputs"),
            _json("guided_json", request.guided_json),
            _text("regex", "guided_regex", request.guided_regex),
            _text("grammar", "guided_grammar", request.guided_grammar),
            _choice("guided_choice", request.guided_choice),
            _text("grammar", "grammar", request.grammar),
            _json("json_schema", request.json_schema),
        )
        if constraint is not None
    ]
    if len(found) > 1:
        raise APIError(
            f"{found[0].param} and {found[1].param} both constrain the output; send one of them", param=found[1].param
        )
    return found[0] if found else None


# A forced call is written compactly, as json.dumps writes it: small models wander in free whitespace.
_COMPACT_JSON = {
    "whitespace_flexible": False,
    "whitespace_pattern": None,
    "item_separator": ", ",
    "key_separator": ": ",
}


def forced_tool_constraint(
    tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any], parallel: bool
) -> OutputConstraint:
    """The JSON list of calls that tool_choice `required` or a named function forces the output to be.

    Arguments hold only the properties a function declares (objects that leave `additionalProperties`
    unsaid get false, as OpenAI's strict mode asks): every call still validates against the tool's schema.
    """
    try:
        schema = tool_call_schema(tools, tool_choice, parallel=parallel)
    except GrammarError as exc:
        raise APIError(str(exc), param="tool_choice") from exc
    return OutputConstraint("json_schema", {**_closed(schema), "x-guidance": _COMPACT_JSON}, "tools")


def _closed(schema: Any) -> Any:
    """A copy of schema in which every object with `properties` and no `additionalProperties` admits no others."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _response_format(request: GenerationRequest) -> OutputConstraint | None:
    response_format = request.response_format
    if isinstance(response_format, JSONObjectResponseFormat):
        if response_format.json_schema is not None:  # llama.cpp's form
            return OutputConstraint("json_schema", response_format.json_schema, "response_format.schema")
        return OutputConstraint("json_object", None, "response_format")
    if isinstance(response_format, JSONSchemaResponseFormat):
        if response_format.schema_ is not None:  # llama.cpp's form
            return OutputConstraint("json_schema", response_format.schema_, "response_format.schema")
        schema = response_format.json_schema.json_schema if response_format.json_schema is not None else None
        if schema is None:
            return OutputConstraint("json_object", None, "response_format")
        return OutputConstraint("json_schema", schema, "response_format")
    return None  # absent, or {"type": "text"}


def _structured_outputs(fields: StructuredOutputs | None, param: str) -> OutputConstraint | None:
    if fields is None:
        return None
    return (
        _json(param, fields.json_schema)
        or _text("regex", param, fields.regex)
        or _text("grammar", param, fields.grammar)
        or _choice(param, fields.choice)
    )


def _json(param: str, schema: Mapping[str, Any] | str | None) -> OutputConstraint | None:
    return None if schema is None else OutputConstraint("json_schema", schema, param)


def _text(kind: str, param: str, value: str | None) -> OutputConstraint | None:
    return None if value is None else OutputConstraint(kind, value, param)


def _choice(param: str, choices: list[str] | None) -> OutputConstraint | None:
    """One of the given strings exactly, as a GBNF grammar of string literals."""
    if choices is None:
        return None
    if any(not choice for choice in choices):
        raise APIError("choices must not be empty strings", param=param)
    return OutputConstraint("grammar", "root ::= " + " | ".join(json.dumps(choice) for choice in choices), param)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer; the llguidance backend is built on first use (it reads the vocab)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    async def compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        """The constraint as a grammar, compiled (or taken from the cache) in a worker thread; 400 if invalid."""
        return await asyncio.to_thread(self._compile, constraint)

    def _compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        with self._lock:
            if self._backend is None:
                self._backend = GrammarBackend(self._tokenizer)
        try:
            return self._backend.compile(constraint.kind, constraint.spec)
        except GrammarError as exc:
            raise APIError(str(exc), param=constraint.param) from exc
