"""Sessions and snapshots in-process on the tiny model: snapshot metadata, damaged snapshots, ids and errors.

Turns compared with other turns are in tests/e2e: the default model's replies tokenize back to the tokens it
generated, which a random model's do not, so that only there a history re-rendered reaches the same tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from statelm.cpu import native_bf16
from tests.e2e.conftest import delete_state
from tests.e2e.test_sessions import SYSTEM, create_session, turn
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args


@pytest.fixture
def api(server: InProcessServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the shared app; every snapshot and session a test leaves behind is deleted after it."""
    with server.http() as http:
        yield http
        delete_state(http)


def test_snapshot_metadata_listing_and_deletion(api: httpx.Client) -> None:
    create_session(api, session_id="meta")
    snapshot = api.post("/v1/sessions/meta/snapshot", json={"title": "t", "description": "d", "tags": ["a"]}).json()
    assert snapshot["num_tokens"] == 0
    path = f"/v1/snapshots/{snapshot['id']}"
    patched = api.patch(path, json={"title": "new", "description": None}).json()
    assert (patched["title"], patched["description"], patched["tags"]) == ("new", None, ["a"])
    assert api.get(path).json()["title"] == "new"
    assert snapshot["id"] in [entry["id"] for entry in api.get("/v1/snapshots").json()["data"]]
    assert api.patch(path, json={"colour": "red"}).status_code == 400
    assert api.delete(path).json() == {"id": snapshot["id"], "object": "snapshot.deleted", "deleted": True}
    assert api.get(path).status_code == 404


def test_corrupt_snapshot_gives_422_and_foreign_one_409(api: httpx.Client, state_dir: Path) -> None:
    create_session(api, session_id="damaged", system=SYSTEM)
    corrupt = api.post("/v1/sessions/damaged/snapshot", json={}).json()["id"]
    foreign = api.post("/v1/sessions/damaged/snapshot", json={}).json()["id"]
    kv_file = state_dir / "snapshots" / corrupt / "kv.safetensors"
    data = bytearray(kv_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kv_file.write_bytes(bytes(data))
    response = api.post(f"/v1/snapshots/{corrupt}/load", json={})
    assert response.status_code == 422 and response.json()["error"]["code"] == "snapshot_corrupt"
    manifest_file = state_dir / "snapshots" / foreign / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["model"]["fingerprint"]["dtype"] = "float16"
    manifest_file.write_text(json.dumps(manifest))
    response = api.post(f"/v1/snapshots/{foreign}/load", json={})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "fingerprint_mismatch" and "dtype" in response.json()["error"]["message"]
    kv_file.write_bytes(bytes(data[:100]))
    assert api.post(f"/v1/snapshots/{corrupt}/load", json={}).status_code == 422
    assert api.get("/health").status_code == 200


def test_sessions_and_metrics_show_the_kv_format_and_its_bytes_per_token(
    api: httpx.Client, client: openai.OpenAI, model_name: str
) -> None:
    create_session(api, session_id="sized", system=SYSTEM)
    turn(client, model_name, "sized", "Hello there.")
    (listed,) = [entry for entry in api.get("/v1/sessions").json()["data"] if entry["id"] == "sized"]
    auto = "bfloat16" if native_bf16() else "float16"  # the model's own bfloat16 where native, else float16
    per_token = 2 * 2 * 2 * 16 * 2  # layers, K and V, KV heads, head dim, bytes
    assert (listed["kv_cache_dtype"], listed["kv_bytes_per_token"]) == (auto, per_token)
    assert listed["num_tokens"] > 0 and listed["kv_bytes"] == listed["num_tokens"] * per_token
    assert api.get("/v1/sessions/sized").json()["kv_bytes"] == listed["kv_bytes"]
    metrics = api.get("/metrics").text
    assert f'statelm_kv_cache_bytes_per_token{{dtype="{auto}"}} {per_token}.0' in metrics
    assert "statelm_kv_cache_capacity_tokens " in metrics


def test_a_snapshot_of_another_kv_format_is_refused_with_409_naming_the_setting(
    api: httpx.Client, tiny_model: Path, state_dir: Path, tmp_path: Path
) -> None:
    float32_args = tiny_args(tiny_model, tmp_path, "--kv-cache-dtype", "float32")
    with serve_in_process(float32_args) as float32_server, float32_server.http() as other:
        create_session(other, session_id="wide", system=SYSTEM)
        snapshot = other.post("/v1/sessions/wide/snapshot", json={}).json()
    assert snapshot["kv_cache_dtype"] == "float32"
    shutil.copytree(tmp_path / "snapshots" / snapshot["id"], state_dir / "snapshots" / snapshot["id"])
    response = api.post(f"/v1/snapshots/{snapshot['id']}/load", json={})
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "fingerprint_mismatch" and "--kv-cache-dtype float32 loads it" in error["message"]
    assert api.get("/health").status_code == 200


def test_a_saved_session_resumes_on_a_server_of_another_kv_format_and_recomputes_its_kv(
    tiny_model: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    first_args = tiny_args(tiny_model, state, "--kv-cache-dtype", "float32")
    with serve_in_process(first_args) as first, first.http() as http:
        create_session(http, session_id="moved", system=SYSTEM)
        body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert http.post("/v1/chat/completions", json={**body, "session_id": "moved"}).status_code == 200
        before = http.get("/v1/sessions/moved").json()
    assert before["kv_cache_dtype"] == "float32" and before["num_tokens"] > 0
    with serve_in_process(tiny_args(tiny_model, state)) as second, second.http() as http:  # 16-bit KV
        resumed = http.get("/v1/sessions/moved").json()
        assert resumed["num_messages"] == before["num_messages"] and resumed["kv_cache_dtype"] != "float32"
        reply = http.post("/v1/chat/completions", json={**body, "session_id": "moved"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # its float32 KV is not used
        assert http.get("/v1/sessions/moved").json()["num_messages"] == before["num_messages"] + 2


@pytest.mark.parametrize("bad_id", ["../escape", "/etc/passwd", "a/b", "..", ".hidden", "x" * 200, "sp ace"])
def test_ids_that_could_be_paths_are_rejected(api: httpx.Client, bad_id: str) -> None:
    response = api.post("/v1/sessions", json={"session_id": bad_id})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_id"
    create_session(api, session_id="ids")
    assert api.post("/v1/sessions/ids/fork", json={"session_id": bad_id}).status_code == 400
    snapshot_id = api.post("/v1/sessions/ids/snapshot", json={}).json()["id"]
    response = api.post(f"/v1/snapshots/{snapshot_id}/load", json={"session_id": bad_id})
    assert response.status_code == 400


@pytest.mark.parametrize("bad_id", ["%2E%2E", "..%2Fsnapshots", "a%00b"])
def test_ids_in_paths_are_validated(api: httpx.Client, bad_id: str) -> None:
    for path in (f"/v1/snapshots/{bad_id}", f"/v1/sessions/{bad_id}"):
        assert api.get(path).status_code in (400, 404)
    assert api.get("/v1/snapshots/%2E%2E").json()["error"]["code"] == "invalid_id"


def test_session_errors(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        turn(client, model_name, "missing", "Hi")
    assert api.get("/v1/sessions/missing").status_code == 404
    create_session(api, session_id="capped", max_tokens=60)
    assert api.post("/v1/sessions", json={"session_id": "capped"}).status_code == 409
    with pytest.raises(openai.BadRequestError) as error:
        turn(client, model_name, "capped", "Hello " * 80)
    assert error.value.body["code"] == "context_length_exceeded"
    assert api.get("/v1/sessions/capped").json()["num_messages"] == 0
    bad_kwargs = api.post("/v1/sessions", json={"chat_template_kwargs": {"messages": []}})
    assert bad_kwargs.status_code == 400
    assert api.post("/v1/sessions", json={"max_tokens": 0}).status_code == 400


def test_session_metadata_is_set_replaced_forked_and_cleared(api: httpx.Client) -> None:
    made = create_session(api, session_id="titled", metadata={"title": "Capitals", "conversation": "titled"})
    assert made["metadata"] == {"title": "Capitals", "conversation": "titled"}
    assert create_session(api, session_id="plain")["metadata"] == {}
    patched = api.patch("/v1/sessions/titled", json={"metadata": {"title": "Cities"}})
    assert patched.status_code == 200 and patched.json()["metadata"] == {"title": "Cities"}
    listed = {session["id"]: session["metadata"] for session in api.get("/v1/sessions").json()["data"]}
    assert listed == {"titled": {"title": "Cities"}, "plain": {}}
    assert api.post("/v1/sessions/titled/fork", json={"session_id": "copy"}).json()["metadata"] == {"title": "Cities"}
    branch = api.post("/v1/sessions/titled/fork", json={"session_id": "branch", "metadata": {"title": "B"}})
    assert branch.json()["metadata"] == {"title": "B"}
    assert api.patch("/v1/sessions/titled", json={"metadata": None}).json()["metadata"] == {}
    assert api.get("/v1/sessions/titled").json()["metadata"] == {}


@pytest.mark.parametrize(
    "body",
    [
        {"metadata": {"title": 1}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"title": "v" * 513}},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": ["title"]},
        {},
        {"metadata": {}, "title": "x"},
    ],
)
def test_session_metadata_is_validated(api: httpx.Client, body: dict[str, object]) -> None:
    create_session(api, session_id="checked")
    answer = api.patch("/v1/sessions/checked", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert api.patch("/v1/sessions/nobody", json={"metadata": {}}).status_code == 404


def test_session_created_with_messages_holds_them(api: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    ]
    made = create_session(api, session_id="imported", system=SYSTEM, messages=messages)
    assert made["num_messages"] == 3
    history = api.get("/v1/sessions/imported/history").json()["messages"]
    assert history == [{"role": "system", "content": SYSTEM}, *messages]
    refused = api.post("/v1/sessions", json={"messages": [{"role": "user", "reasoning_content": "no"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("messages")


def test_session_metadata_survives_a_restart(tiny_model: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with serve_in_process(tiny_args(tiny_model, state)) as first, first.http() as http:
        create_session(http, session_id="kept", metadata={"title": "Kept"})
        assert http.patch("/v1/sessions/kept", json={"metadata": {"title": "Renamed"}}).status_code == 200
    with serve_in_process(tiny_args(tiny_model, state)) as second, second.http() as http:
        assert http.get("/v1/sessions/kept").json()["metadata"] == {"title": "Renamed"}
