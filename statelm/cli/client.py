"""A small synchronous client for statelm's HTTP API: sessions, snapshots and streamed chat."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

BUSY_RETRY_S = 10.0  # a turn cancelled by the client may hold its session for a moment
REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
STREAM_TIMEOUT = httpx.Timeout(None, connect=5.0)  # a long prefill sends nothing for a while


class ClientError(Exception):
    """An API or connection failure, worded for a one-line message to the user."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class ChatChunk:
    """One streamed piece of a reply: new text, new reasoning, and at the end the finish reason and usage."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


@dataclass
class Embeddings:
    """A server's vectors of some texts, in order, and the fingerprint of the model that made them."""

    vectors: list[list[float]]
    fingerprint: str  # equal fingerprints: comparable vectors (same weights, tokenizer and pooling)


class StatelmClient:
    """Talks to one statelm server over HTTP; every failure surfaces as a ClientError."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A fresh connection per request: a pooled one the server has just closed as idle fails the next request.
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=REQUEST_TIMEOUT,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._model: dict[str, Any] | None = None

    # -- plumbing -------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Send one request and return its decoded JSON body."""
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._connection_error(exc) from None
        if response.status_code >= 400:
            raise self._api_error(response, method, path)
        return response.json()

    def _connection_error(self, exc: httpx.HTTPError) -> ClientError:
        reason = str(exc) or type(exc).__name__
        return ClientError(
            f"cannot reach the statelm server at {self.url} ({reason}); start one with `statelm server start` "
            "or point --url / STATELM_URL at a running one"
        )

    def _api_error(self, response: httpx.Response, method: str, path: str) -> ClientError:
        try:
            error = response.json()["error"]
            message, code = str(error.get("message") or response.reason_phrase), error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, code = response.text.strip() or response.reason_phrase, None
        status = response.status_code
        if status in (401, 403):
            message = (
                f"the server at {self.url} rejected the API key ({message}); pass --api-key or set STATELM_API_KEY"
            )
        elif status == 404 and message == "Not Found":
            message = f"the server at {self.url} does not serve {method} {path}; is it an older statelm?"
        return ClientError(message, status=status, code=code)

    # -- server ---------------------------------------------------------------------------------------------

    def model(self) -> dict[str, Any]:
        """The served model's card (id, max_model_len), fetched once."""
        if self._model is None:
            self._model = self.request("GET", "/v1/models")["data"][0]
        return self._model

    def embedding_model(self) -> str | None:
        """The name of an embedding model the server serves beside the chat model (`--embedding-model`), or None."""
        cards = self.request("GET", "/v1/models")["data"]
        return next((card["id"] for card in cards if card.get("kind") == "embedding"), None)

    def embed(self, model: str, texts: list[str]) -> Embeddings:
        """The embeddings of texts, in order, with the model's fingerprint."""
        answer = self.request("POST", "/v1/embeddings", {"model": model, "input": texts})
        vectors = [item["embedding"] for item in sorted(answer["data"], key=lambda item: item["index"])]
        return Embeddings(vectors, answer["system_fingerprint"])

    # -- sessions -------------------------------------------------------------------------------------------

    def create_session(self, session_id: str | None = None, system: str | None = None) -> dict[str, Any]:
        """Create a session; the server picks an id when none is given."""
        body = {"session_id": session_id, "system": system}
        return self.request("POST", "/v1/sessions", {k: v for k, v in body.items() if v is not None})

    def sessions(self) -> list[dict[str, Any]]:
        """All live sessions."""
        return self.request("GET", "/v1/sessions")["data"]

    def session(self, session_id: str) -> dict[str, Any]:
        """One session."""
        return self.request("GET", f"/v1/sessions/{session_id}")

    def delete_session(self, session_id: str) -> dict[str, Any]:
        """Delete a session."""
        return self.request("DELETE", f"/v1/sessions/{session_id}")

    def history(self, session_id: str) -> list[dict[str, Any]]:
        """The transcript of a session."""
        return self.request("GET", f"/v1/sessions/{session_id}/history")["messages"]

    def rollback(self, session_id: str, keep_messages: int) -> dict[str, Any]:
        """Cut a session's transcript to its first `keep_messages` messages."""
        return self.request("POST", f"/v1/sessions/{session_id}/rollback", {"keep_messages": keep_messages})

    def fork(self, session_id: str, new_id: str | None = None) -> dict[str, Any]:
        """A copy of a session (sharing its KV blocks) under a new id."""
        body = {"session_id": new_id} if new_id else {}
        return self.request("POST", f"/v1/sessions/{session_id}/fork", body)

    # -- snapshots ------------------------------------------------------------------------------------------

    def save_snapshot(self, session_id: str, **metadata: Any) -> dict[str, Any]:
        """Write a session to disk; metadata is title, description and tags."""
        body = {k: v for k, v in metadata.items() if v is not None}
        return self.request("POST", f"/v1/sessions/{session_id}/snapshot", body)

    def snapshots(self) -> list[dict[str, Any]]:
        """All snapshots on the server's disk."""
        return self.request("GET", "/v1/snapshots")["data"]

    def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot."""
        return self.request("GET", f"/v1/snapshots/{snapshot_id}")

    def edit_snapshot(self, snapshot_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a snapshot's title, description or tags (None clears a field)."""
        return self.request("PATCH", f"/v1/snapshots/{snapshot_id}", changes)

    def delete_snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """Delete a snapshot."""
        return self.request("DELETE", f"/v1/snapshots/{snapshot_id}")

    def load_snapshot(self, snapshot_id: str, session_id: str | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Bring a snapshot back as a live session."""
        body: dict[str, Any] = {"overwrite": overwrite}
        if session_id:
            body["session_id"] = session_id
        return self.request("POST", f"/v1/snapshots/{snapshot_id}/load", body)

    # -- chat -----------------------------------------------------------------------------------------------

    def stream_chat(self, body: dict[str, Any]) -> Iterator[ChatChunk]:
        """Stream a chat completion; closing the iterator early cancels the turn on the server."""
        body = {"model": self.model()["id"], **body, "stream": True, "stream_options": {"include_usage": True}}
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            try:
                with self._http.stream("POST", "/v1/chat/completions", json=body, timeout=STREAM_TIMEOUT) as response:
                    if response.status_code >= 400:
                        response.read()
                        error = self._api_error(response, "POST", "/v1/chat/completions")
                        if error.code == "session_busy" and time.monotonic() < deadline:
                            time.sleep(0.2)
                            continue
                        raise error
                    yield from _parse_events(response.iter_lines())
                    return
            except httpx.HTTPError as exc:
                raise self._connection_error(exc) from None


def _parse_events(lines: Iterator[str]) -> Iterator[ChatChunk]:
    """Chat chunks from the `data:` lines of a server-sent event stream."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ClientError(str(event["error"].get("message")), code=event["error"].get("code"))
        chunk = ChatChunk(usage=event.get("usage"))
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            chunk.content += delta.get("content") or ""
            chunk.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
        yield chunk
