"""Streams whose server-sent events are typed (`event:` names the `type` of its `data:`): Responses and Messages."""

from __future__ import annotations

import json
from typing import Any

import httpx


def typed_events(api: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST body with `stream: true` to path; the events' data, each checked against its `event:` line."""
    with api.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    named = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [event["type"] for event in events] == named
    return events
