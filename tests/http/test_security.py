"""API keys and ownership in-process on the tiny model: 401 without an accepted key, no key reaches another's state."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.http.conftest import InProcessServer, serve_in_process, tiny_args

KEY_A, KEY_B, ADMIN_KEY, ENV_KEY = "key-a-0123456789", "key-b-0123456789", "admin-0123456789", "env-key-0123456789"


@dataclass
class Keyed:
    """An app with API keys, the key file it reads, and its state dir."""

    server: InProcessServer
    key_file: Path
    state_dir: Path


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    """An app with keys A and B as flags, one in STATELM_API_KEY, one in a file, an admin key; /metrics keyed."""
    root = tmp_path_factory.mktemp("keyed")
    key_file = root / "keys.txt"
    key_file.write_text("# keys read from a file\nfile-key-1\n")
    args = ["--max-model-len", "512", "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN_KEY]
    args += ["--api-key-file", str(key_file), "--metrics-require-key"]
    with serve_in_process(tiny_args(tiny_model, root / "state", *args), {"STATELM_API_KEY": ENV_KEY}) as running:
        yield Keyed(running, key_file, root / "state")


@pytest.fixture(scope="module")
def secured(keyed: Keyed) -> InProcessServer:
    """The keyed app."""
    return keyed.server


def chat(server: InProcessServer, key: str, session_id: str, content: str = "Say hi.") -> Any:
    """A short greedy session turn through the openai SDK."""
    return server.openai(key).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=4,
        extra_body={"session_id": session_id},
    )


def operations(server: InProcessServer) -> list[tuple[str, str]]:
    """(method, path) of every operation in the app's OpenAPI schema, path parameters filled in."""
    with server.http(KEY_A) as client:
        schema = client.get("/openapi.json").json()
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "some-id", path))
        for path, methods in schema["paths"].items()
        for method in methods
    ]


def assert_refused(response: httpx.Response, code: str) -> None:
    """Response is a 401 with code (in OpenAI's shape; Anthropic's, which has no code, on its routes) that asks for
    a bearer token."""
    assert response.status_code == 401, (response.request.url, response.text)
    assert response.json()["error"]["type"] == "authentication_error"
    if response.request.url.path.startswith("/v1/messages"):
        assert response.json()["type"] == "error"
    else:
        assert response.json()["error"]["code"] == code
    assert response.headers["www-authenticate"] == "Bearer"


def test_every_protected_route_refuses_a_missing_or_wrong_key(secured: InProcessServer) -> None:
    routes = operations(secured)
    assert len(routes) >= 15 and ("POST", "/v1/chat/completions") in routes
    with secured.http() as anonymous, secured.http("wrong-key") as wrong, secured.http() as x_header:
        for method, path in [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]:
            if path == "/health":
                continue
            assert_refused(anonymous.request(method, path, json={}), "missing_api_key")
            assert_refused(wrong.request(method, path, json={}), "invalid_api_key")
            assert_refused(x_header.request(method, path, headers={"X-Api-Key": KEY_A[:-1]}), "invalid_api_key")
        assert anonymous.get("/health").json()["status"] == "ok"
        assert x_header.get("/metrics", headers={"X-Api-Key": KEY_A}).status_code == 200  # --metrics-require-key


def test_keys_from_flags_environment_and_file_are_accepted_in_either_header(secured: InProcessServer) -> None:
    with secured.http() as anonymous:
        for key in (KEY_A, KEY_B, ADMIN_KEY, ENV_KEY, "file-key-1"):
            assert anonymous.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert anonymous.get("/v1/models", headers={"X-Api-Key": key}).status_code == 200


def test_the_key_file_is_read_again_when_it_changes(keyed: Keyed) -> None:
    replacement = keyed.key_file.with_suffix(".new")
    replacement.write_text("file-key-2\n")
    os.replace(replacement, keyed.key_file)
    with keyed.server.http() as anonymous:
        assert anonymous.get("/v1/models", headers={"X-Api-Key": "file-key-1"}).status_code == 401
        assert anonymous.get("/v1/models", headers={"X-Api-Key": "file-key-2"}).status_code == 200


def test_key_b_can_neither_see_nor_touch_key_a_sessions_and_snapshots(secured: InProcessServer) -> None:
    with secured.http(KEY_A) as a, secured.http(KEY_B) as b, secured.http(ADMIN_KEY) as admin:
        assert a.post("/v1/sessions", json={"session_id": "a-private"}).status_code == 201
        chat(secured, KEY_A, "a-private")
        snapshot = a.post("/v1/sessions/a-private/snapshot", json={"title": "a's"}).json()["id"]
        assert b.post("/v1/sessions", json={"session_id": "b-own"}).status_code == 201

        for method, path, body in [
            ("GET", "/v1/sessions/a-private", None),
            ("GET", "/v1/sessions/a-private/history", None),
            ("POST", "/v1/sessions/a-private/rollback", {"keep_messages": 0}),
            ("POST", "/v1/sessions/a-private/fork", {"session_id": "b-fork"}),
            ("POST", "/v1/sessions/a-private/snapshot", {}),
            ("DELETE", "/v1/sessions/a-private", None),
            ("GET", f"/v1/snapshots/{snapshot}", None),
            ("PATCH", f"/v1/snapshots/{snapshot}", {"title": "b was here"}),
            ("POST", f"/v1/snapshots/{snapshot}/load", {"session_id": "b-loaded"}),
            ("DELETE", f"/v1/snapshots/{snapshot}", None),
        ]:
            response = b.request(method, path, json=body)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"]["code"] == "not_found"
        with pytest.raises(openai.NotFoundError):
            chat(secured, KEY_B, "a-private")
        assert [s["id"] for s in b.get("/v1/sessions").json()["data"]] == ["b-own"]
        assert b.get("/v1/snapshots").json()["data"] == []
        b_snapshot = b.post("/v1/sessions/b-own/snapshot", json={}).json()["id"]
        overwrite = b.post(f"/v1/snapshots/{b_snapshot}/load", json={"session_id": "a-private", "overwrite": True})
        assert overwrite.status_code == 409  # ids are global, but a foreign session is never replaced

        assert a.get("/v1/sessions/a-private/history").json()["messages"][0] == {"role": "user", "content": "Say hi."}
        assert a.get(f"/v1/snapshots/{snapshot}").json()["title"] == "a's"
        assert [s["id"] for s in a.get("/v1/snapshots").json()["data"]] == [snapshot]

        assert {s["id"] for s in admin.get("/v1/sessions").json()["data"]} >= {"a-private", "b-own"}
        assert {s["id"] for s in admin.get("/v1/snapshots").json()["data"]} >= {snapshot, b_snapshot}
        assert admin.get("/v1/sessions/a-private/history").status_code == 200
        assert admin.delete(f"/v1/snapshots/{b_snapshot}").status_code == 200
        assert admin.delete("/v1/sessions/b-own").status_code == 200
        assert b.get("/v1/sessions").json()["data"] == []
        assert a.delete(f"/v1/snapshots/{snapshot}").status_code == 200
        assert a.delete("/v1/sessions/a-private").status_code == 200


def test_manifests_record_a_hash_of_the_key_never_the_key(keyed: Keyed) -> None:
    state = keyed.state_dir
    with keyed.server.http(KEY_A) as a:
        assert a.post("/v1/sessions", json={"session_id": "hashed"}).status_code == 201
        snapshot = a.post("/v1/sessions/hashed/snapshot", json={}).json()["id"]
        manifest_text = (state / "snapshots" / snapshot / "manifest.json").read_text()
        a.delete(f"/v1/snapshots/{snapshot}")
        a.delete("/v1/sessions/hashed")
    manifest = json.loads(manifest_text)
    assert KEY_A not in manifest_text
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", manifest["owner"]) and manifest["session"]["owner"] == manifest["owner"]
