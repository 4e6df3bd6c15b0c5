"""What a request is about, as far as routing goes: a session, a stored object, a prompt, or nothing in particular."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

PROMPT_FIELDS = ("system", "instructions", "tools", "messages", "input", "prompt")  # in the order a prompt renders them
PROMPT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})


class TargetKind(enum.StrEnum):
    """Where a request must go."""

    SESSION = "session"  # to the replica holding the session (sessions routes, session turns, snapshot loads into one)
    RESPONSE = "response"  # to the replica holding the response chain of a stored response
    COMPLETION = "completion"  # to the replica that stored a chat completion (kept in its memory)
    PROMPT = "prompt"  # stateless generation: the replica with the longest cached prefix, else the least loaded
    SESSION_LIST = "session_list"  # every replica's sessions together
    ANY = "any"  # any replica: the least loaded


@dataclass(frozen=True)
class Target:
    """A request's routing target: its kind, the id it is about, or the text whose prefix it shares with others."""

    kind: TargetKind
    key: str | None = None
    text: str | None = None


def classify(method: str, path: str, body: bytes) -> Target:
    """The routing target of a request to one of statelm's routes."""
    parts = path.strip("/").split("/")
    fields = _json_object(body) if method == "POST" else {}
    if parts[:2] == ["v1", "sessions"]:
        if len(parts) > 2:
            return Target(TargetKind.SESSION, parts[2])
        if method == "GET":
            return Target(TargetKind.SESSION_LIST)
        return _keyed(TargetKind.SESSION, fields.get("session_id"))
    if parts[:2] == ["v1", "snapshots"] and parts[3:] == ["load"]:
        return _keyed(TargetKind.SESSION, fields.get("session_id"))
    if parts[:2] == ["v1", "responses"] and len(parts) > 2:
        return Target(TargetKind.RESPONSE, parts[2])
    if parts[:3] == ["v1", "chat", "completions"] and len(parts) > 3:
        return Target(TargetKind.COMPLETION, parts[3])
    if path in PROMPT_PATHS and method == "POST":
        if path == "/v1/chat/completions" and isinstance(fields.get("session_id"), str):
            return Target(TargetKind.SESSION, fields["session_id"])
        if path == "/v1/responses" and isinstance(fields.get("previous_response_id"), str):
            return Target(TargetKind.RESPONSE, fields["previous_response_id"])
        return Target(TargetKind.PROMPT, text=prompt_text(fields))
    return Target(TargetKind.ANY)


def prompt_text(fields: dict[str, Any]) -> str:
    """The parts of a generation body that make its prompt, in rendering order, as one string whose prefixes stand
    for the prompt's prefixes (requests sharing a system prompt share a prefix of it)."""
    return "".join(
        json.dumps(fields[name], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        for name in PROMPT_FIELDS
        if name in fields
    )


def _keyed(kind: TargetKind, key: object) -> Target:
    return Target(kind, key) if isinstance(key, str) else Target(TargetKind.ANY)


def _json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; an empty dict for anything else (the replica answers what is wrong with it)."""
    try:
        fields = json.loads(body) if body else {}
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}
