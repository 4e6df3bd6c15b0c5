"""Reading JSON tool calls (`{"name": ..., "arguments": {...}}`) from text that is still growing."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from statelm.api.parsers.tools.base import BlockScan, CallDraft, ToolParser

ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI/Hermes/Mistral say "arguments", Llama 3 "parameters"
_SPACE = re.compile(r"\s*")
_STRING_REST = r'(?P<body>[^"\\]*(?:\\.[^"\\]*)*)(?:(?P<close>")|\\?\Z)'  # a string after its opening quote
_STRING = re.compile('"' + _STRING_REST, re.DOTALL)
_STRING_TAIL = re.compile(_STRING_REST, re.DOTALL)
_STRUCTURE = re.compile('"' + _STRING_REST + r"|[{}\[\]]", re.DOTALL)
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SCALAR_START = re.compile(r"-|t(?:r(?:u)?)?|f(?:a(?:l(?:s)?)?)?|n(?:u(?:l)?)?")
_NUMBER_CHARS = frozenset("0123456789.eE+-")
_MAX_REMEMBERED = 16


class MalformedJson(ValueError):
    """Text that cannot begin a JSON value."""


def skip_space(text: str, pos: int) -> int:
    """Index of the first non-whitespace character at or after `pos`."""
    match = _SPACE.match(text, pos)
    return match.end() if match else pos


@dataclass
class CallObject:
    """How far one JSON call object has been read."""

    name: str | None = None
    arguments: str | None = None  # the arguments value's text so far
    end: int | None = None  # index past the closing brace, or where the object broke off; None while incomplete
    broken: bool = False

    def draft(self, require_arguments: bool) -> CallDraft | None:
        """The call to report: once the name is known and the arguments have begun (or the object closed well)."""
        if self.name is None or (self.arguments is None and (require_arguments or self.end is None or self.broken)):
            return None
        return CallDraft(self.name, self.arguments or "")


class JsonCallReader:
    """Reads JSON values and call objects from a text that only grows between calls.

    A container still open at the end of the text is remembered with the depth reached, so the next call
    resumes there instead of rescanning long arguments from their start (checked by comparing the text).
    """

    def __init__(self) -> None:
        # container start -> (text scanned so far, depth there, whether that point is inside a string)
        self._scanned: dict[int, tuple[str, int, bool]] = {}

    def value_end(self, text: str, pos: int, final: bool) -> int | None:
        """Index just past the JSON value starting at `pos`, or None while the text stops inside it.

        Strings and brackets are matched (a string's brackets do not count); what lies between them is not
        validated, so arguments the model got wrong pass through as written.
        """
        if pos >= len(text):
            return None
        first = text[pos]
        if first == '"':
            string = _STRING.match(text, pos)
            return string.end() if string and string.group("close") else None
        if first in "{[":
            return self._container_end(text, pos)
        scalar = _SCALAR.match(text, pos)
        if scalar and (final or (scalar.end() < len(text) and text[scalar.end()] not in _NUMBER_CHARS)):
            return scalar.end()
        if not final and (scalar or _SCALAR_START.fullmatch(text, pos)):
            return None
        raise MalformedJson(f"no JSON value at {text[pos : pos + 10]!r}")

    def read_call_object(self, text: str, pos: int, final: bool) -> CallObject:
        """Read the call object whose `{` is at `pos`; other keys are skipped, the first of each key counts."""
        call = CallObject()
        pos += 1
        first = True
        while True:
            pos = skip_space(text, pos)
            if pos < len(text) and text[pos] == "}":
                call.end = pos + 1
                return call
            if not first and pos < len(text):
                if text[pos] != ",":
                    return _broken(call, pos)
                pos = skip_space(text, pos + 1)
            first = False
            if pos == len(text):
                return _unfinished(call, pos, final)
            if text[pos] != '"':
                return _broken(call, pos)
            key_end = self.value_end(text, pos, final)
            if key_end is None:
                return _unfinished(call, len(text), final)
            key = _loads(text[pos:key_end])
            pos = skip_space(text, key_end)
            if pos == len(text):
                return _unfinished(call, pos, final)
            if text[pos] != ":" or not isinstance(key, str):
                return _broken(call, pos)
            pos = skip_space(text, pos + 1)
            if pos == len(text):
                return _unfinished(call, pos, final)
            try:
                end = self.value_end(text, pos, final)
            except MalformedJson:
                return _broken(call, pos)
            if key in ARGUMENT_KEYS and call.arguments is None:
                if text[pos] in "{[":
                    call.arguments = text[pos:end]
                elif end is not None:  # arguments sent as a JSON-encoded string, or a bare scalar
                    value = _loads(text[pos:end])
                    call.arguments = value if isinstance(value, str) else text[pos:end]
            elif key == "name" and call.name is None and end is not None:
                name = _loads(text[pos:end])
                if not isinstance(name, str) or not name:
                    return _broken(call, pos)
                call.name = name
            if end is None:
                return _unfinished(call, len(text), final)
            pos = end

    def scan_call_list(
        self,
        text: str,
        pos: int,
        final: bool,
        *,
        separator: str,
        closer: str | None = None,
        require_arguments: bool = False,
    ) -> BlockScan | None:
        """Call objects from `pos` on, separated by `separator`, ended by `closer` or by anything else."""
        calls: list[CallDraft] = []
        done = pos  # where the block ends if nothing more belongs to it
        while True:
            pos = skip_space(text, pos)
            if pos == len(text):
                return _unfinished_list(calls, done, final)
            if text[pos] != "{":
                return BlockScan(calls, done) if calls else None
            call = self.read_call_object(text, pos, final)
            draft = call.draft(require_arguments)
            if call.end is None:
                return BlockScan([*calls, draft] if draft else calls)
            if draft is None:
                return BlockScan(calls, done) if calls else None
            calls.append(draft)
            if call.broken:
                return BlockScan(calls, call.end)
            done = call.end
            pos = skip_space(text, done)
            if pos == len(text):
                return _unfinished_list(calls, done, final)
            if closer is not None and text[pos] == closer:
                return BlockScan(calls, pos + 1)
            if text[pos] != separator:
                return BlockScan(calls, done)
            pos += 1

    def _container_end(self, text: str, pos: int) -> int | None:
        resume, depth, in_string = pos, 0, False
        remembered = self._scanned.get(pos)
        if remembered and text.startswith(remembered[0], pos):
            resume, depth, in_string = pos + len(remembered[0]), remembered[1], remembered[2]
        if in_string:
            tail = _STRING_TAIL.match(text, resume)
            if tail is None or tail.group("close") is None:
                self._remember(text, pos, tail.end("body") if tail else resume, depth, True)
                return None
            resume = tail.end()
        for token in _STRUCTURE.finditer(text, resume):
            if token.group()[0] == '"':
                if token.group("close") is None:
                    self._remember(text, pos, token.end("body"), depth, True)
                    return None
                continue
            depth += 1 if token.group() in "{[" else -1
            if depth == 0:
                return token.end()
        self._remember(text, pos, len(text), depth, False)
        return None

    def _remember(self, text: str, start: int, stop: int, depth: int, in_string: bool) -> None:
        if len(self._scanned) >= _MAX_REMEMBERED:
            self._scanned.clear()
        self._scanned[start] = (text[start:stop], depth, in_string)


class JsonToolParser(ToolParser):
    """A tool parser for a format whose calls are JSON objects."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._json = JsonCallReader()


def _unfinished_list(calls: list[CallDraft], done: int, final: bool) -> BlockScan | None:
    if not final:
        return BlockScan(calls)
    return BlockScan(calls, done) if calls else None


def _unfinished(call: CallObject, pos: int, final: bool) -> CallObject:
    return _broken(call, pos) if final else call


def _broken(call: CallObject, pos: int) -> CallObject:
    call.end, call.broken = pos, True
    return call


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
