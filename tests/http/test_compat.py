"""What real clients send: OpenAI's request tags, stored completions, system_fingerprint, llama.cpp's dialects,
streamed logprobs, and text that is not Unicode, through the official openai SDK and raw HTTP."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_chat import QUESTION
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args
from tests.http.test_chat import assert_openai_error


def test_user_and_safety_identifier_go_to_the_access_log(
    client: openai.OpenAI, model_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="statelm.access"):
        reply = client.chat.completions.create(
            model=model_name,
            messages=QUESTION,
            max_tokens=2,
            user="user-7\nforged line",
            safety_identifier="hash-42",
            prompt_cache_key="tenant-a",
        )
    lines = [record.getMessage() for record in caplog.records if record.name == "statelm.access"]
    line = next(line for line in lines if line.startswith(reply.id))
    assert '"user-7\\nforged line"' in line and "\n" not in line  # quoted: no client text makes a line
    assert 'safety_identifier="hash-42"' in line and 'prompt_cache_key="tenant-a"' in line


def test_user_never_becomes_a_metric_label(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1, user="label-canary-9")
    assert "label-canary-9" not in api.get("/metrics").text


def _responses_counted(api: httpx.Client, route: str, status: int) -> float:
    """statelm_http_responses_total for that route and status on /metrics (0 before the first)."""
    pattern = rf'^statelm_http_responses_total{{route="{re.escape(route)}",status="{status}"}} ([0-9.e+]+)$'
    match = re.search(pattern, api.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_responses_are_counted_by_route_and_status(client: openai.OpenAI, model_name: str, api: httpx.Client) -> None:
    route = "/v1/chat/completions"
    streamed, refused, unmatched = (
        _responses_counted(api, route, 200),
        _responses_counted(api, route, 400),
        _responses_counted(api, "unmatched", 404),
    )
    for _ in client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=3, stream=True):
        pass
    assert api.post(route, json={"model": model_name, "messages": QUESTION, "max_tokens": -1}).status_code == 400
    assert api.get("/v1/no-such-route").status_code == 404
    assert _responses_counted(api, route, 200) == streamed + 1  # a stream counts once, not per chunk
    assert _responses_counted(api, route, 400) == refused + 1
    assert _responses_counted(api, "unmatched", 404) == unmatched + 1


def test_service_tier_is_echoed_and_unknown_tiers_are_refused(client: openai.OpenAI, model_name: str) -> None:
    for sent, served in (("auto", "default"), ("default", "default"), ("flex", "flex"), ("priority", "priority")):
        reply = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1, service_tier=sent)
        assert reply.service_tier == served
    assert client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1).service_tier == "default"
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=QUESTION, max_tokens=2, stream=True, service_tier="priority"
        )
    )
    assert {chunk.service_tier for chunk in chunks} == {"priority"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1, service_tier="scale")
    assert refused.value.body["param"] == "service_tier"


def test_system_fingerprint_is_in_responses_and_chunks(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2)
    fingerprint = reply.system_fingerprint
    assert isinstance(fingerprint, str) and fingerprint.startswith("fp_")
    stream = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2, stream=True)
    assert {chunk.system_fingerprint for chunk in stream} == {fingerprint}
    text = client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
    assert text.system_fingerprint == fingerprint


def test_store_keeps_the_completion_with_its_metadata(client: openai.OpenAI, model_name: str) -> None:
    metadata = {"topic": "geography", "run": "7"}
    reply = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=3, temperature=0, store=True, metadata=metadata
    )
    stored = client.chat.completions.retrieve(reply.id)
    assert stored.id == reply.id and stored.metadata == metadata
    assert stored.choices[0].message.content == reply.choices[0].message.content
    assert stored.usage == reply.usage and stored.system_fingerprint == reply.system_fingerprint
    deleted = client.chat.completions.delete(reply.id)
    assert deleted.deleted and deleted.id == reply.id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(reply.id)


def test_a_stored_stream_is_kept_whole(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=QUESTION, max_tokens=4, temperature=0, stream=True, store=True
        )
    )
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    stored = client.chat.completions.retrieve(chunks[0].id)
    assert stored.choices[0].message.content == content and stored.metadata == {}


def test_store_false_keeps_nothing(client: openai.OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(reply.id)


def test_metadata_is_checked_against_openai_limits(client: openai.OpenAI, model_name: str) -> None:
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k": "v" * 513}, {"k" * 65: "v"}, {"k": 1}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=1, metadata=metadata)
        assert refused.value.body["param"].startswith("metadata")


def test_stored_completions_belong_to_their_key(tiny_model: Path, tmp_path: Path) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--api-key", "alice", "--api-key", "bob")
    with serve_in_process(args) as server:
        alice, bob = server.openai("alice"), server.openai("bob")
        reply = alice.chat.completions.create(model="default", messages=QUESTION, max_tokens=1, store=True)
        assert alice.chat.completions.retrieve(reply.id).id == reply.id
        with pytest.raises(openai.NotFoundError):
            bob.chat.completions.retrieve(reply.id)
        with pytest.raises(openai.NotFoundError):
            bob.chat.completions.delete(reply.id)


def test_store_is_refused_when_the_server_keeps_nothing(tiny_model: Path, tmp_path: Path) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--max-stored-completions", "0")
    with serve_in_process(args) as server, pytest.raises(openai.BadRequestError) as refused:
        server.openai().chat.completions.create(model="default", messages=QUESTION, max_tokens=1, store=True)
    assert refused.value.body["param"] == "store"


def test_models_show_the_sampling_defaults_in_effect(client: openai.OpenAI) -> None:
    card = client.models.list().data[0].model_dump()
    assert card["sampling_defaults"]["temperature"] == 1.0 and card["sampling_defaults"]["top_p"] == 1.0


def test_llama_cpp_tokenize_and_detokenize(api: httpx.Client) -> None:
    ours = api.post("/tokenize", json={"prompt": "Hello world é", "add_special_tokens": False}).json()
    theirs = api.post("/tokenize", json={"content": "Hello world é", "add_special": False}).json()
    assert theirs["tokens"] == ours["tokens"]
    pieces = api.post("/tokenize", json={"content": "Hello world é", "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == ours["tokens"]
    assert "".join(piece["piece"] for piece in pieces if isinstance(piece["piece"], str)).startswith("Hello")
    back = api.post("/detokenize", json={"tokens": ours["tokens"]}).json()
    assert back["content"] == back["prompt"] == "Hello world é"
    both = api.post("/tokenize", json={"prompt": "a", "content": "a"})
    assert "content" in assert_openai_error(both, 400)["message"]


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_llama_cpp_response_format_schema(api: httpx.Client, model_name: str, kind: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {
        "model": model_name,
        "messages": QUESTION,
        "max_tokens": 40,
        "response_format": {"type": kind, "schema": schema},
        "seed": 3,
    }
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["n"], int)
    else:  # the tiny model may write digits until max_tokens: still the schema's beginning
        assert re.fullmatch(r'\{\s*"n"\s*:\s*-?\d*', choice["message"]["content"])
    bad = {**body, "response_format": {"type": kind, "schema": {"type": "nonsense"}}}
    assert_openai_error(api.post("/v1/chat/completions", json=bad), 400, "response_format.schema")


def test_lone_surrogates_are_a_400_naming_the_field(api: httpx.Client, model_name: str) -> None:
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 1}'
    response = api.post(
        "/v1/chat/completions", content=(raw % model_name).encode(), headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 400, "messages.0.content")
    pair = raw.replace("\\ud800", "\\ud83d\\ude00") % model_name  # a pair is a character (😀)
    response = api.post("/v1/chat/completions", content=pair.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    tokenize = api.post("/tokenize", content=b'{"prompt": "\\udfff"}', headers={"content-type": "application/json"})
    assert_openai_error(tokenize, 400, "prompt")
    assert api.get("/health").status_code == 200


def test_streamed_logprobs_match_each_delta_and_the_whole(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Write a few words in French, with accents: é, à, ç."}]
    # the tiny model writes random bytes, characters split over tokens among them (invalid ones shown as �)
    kwargs = {"model": model_name, "messages": messages, "max_tokens": 48, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kwargs, top_logprobs=2).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, top_logprobs=2, stream=True))
    streamed = []
    for chunk in chunks:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        entries = chunk.choices[0].logprobs.content or []
        delta = chunk.choices[0].delta.content or ""
        assert bytes(b for entry in entries for b in entry.bytes).decode(errors="replace") == delta
        streamed += entries
    assert [entry.model_dump() for entry in streamed] == [entry.model_dump() for entry in whole.logprobs.content]
    assert bytes(b for entry in streamed for b in entry.bytes).decode(errors="replace") == whole.message.content


def test_cors_preflight_and_keyed_requests(tiny_model: Path, tmp_path: Path) -> None:
    origin = "http://localhost:5173"
    args = tiny_args(tiny_model, tmp_path / "state", "--api-key", "k1", "--allowed-origins", origin)
    with serve_in_process(args) as server:
        _check_cors(server, origin)


def _check_cors(server: InProcessServer, origin: str) -> None:
    with server.http() as browser:
        preflight = browser.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200  # no key: a browser never sends one with a preflight
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        body = {"model": "default", "messages": QUESTION, "max_tokens": 1}
        keyed = browser.post(
            "/v1/chat/completions", json=body, headers={"Origin": origin, "Authorization": "Bearer k1"}
        )
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == origin
        refused = browser.post("/v1/chat/completions", json=body, headers={"Origin": origin})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
        other = browser.options(
            "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_no_cors_unless_told(api: httpx.Client) -> None:
    preflight = api.options(
        "/v1/chat/completions", headers={"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
