"""/v1/embeddings, /v1/rerank and /v1/score on the served decoder model, in-process on the tiny model: every field,
every error, the official SDK, and the vectors against transformers' hidden states of the same weights."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.http.conftest import SERVED_NAME, InProcessServer, serve_in_process, tiny_args

KEY = "embeddings-key"
MAX_PROMPT_TOKENS = 40
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "def add(a, b):"]


@pytest.fixture(scope="module")
def mean_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """An app that mean-pools, with a key and a prompt cap."""
    extra = ["--pooling", "mean", "--api-key", KEY, "--max-prompt-tokens", str(MAX_PROMPT_TOKENS)]
    with serve_in_process(tiny_args(tiny_model, tmp_path_factory.mktemp("embeddings") / "state", *extra)) as running:
        yield running


@pytest.fixture(scope="module")
def client(mean_server: InProcessServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the mean-pooling app, with its key."""
    with mean_server.http(KEY) as http:
        yield http


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """transformers' model of the same checkpoint."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()


def embed(client: httpx.Client, input: Any, **extra: Any) -> httpx.Response:
    """POST /v1/embeddings."""
    return client.post("/v1/embeddings", json={"model": SERVED_NAME, "input": input, **extra})


def vectors(response: httpx.Response) -> list[list[float]]:
    """The float vectors of a 200 response, in index order."""
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return [item["embedding"] for item in data]


def token_ids(client: httpx.Client, text: str) -> list[int]:
    """The ids /tokenize gives a text with the model's special tokens, as /v1/embeddings tokenizes it."""
    response = client.post("/tokenize", json={"model": SERVED_NAME, "prompt": text, "add_special_tokens": True})
    return response.json()["tokens"]


def hf_hidden(reference: Any, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states [T, H] of ids."""
    with torch.no_grad():
        return reference(torch.tensor([ids])).last_hidden_state[0]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    """The response is an OpenAI-shaped error of that status (and param, code where given)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_mean_pooling_matches_transformers(client: httpx.Client, reference: Any) -> None:
    (vector,) = vectors(embed(client, TEXTS[0]))
    expected = F.normalize(hf_hidden(reference, token_ids(client, TEXTS[0])).mean(dim=0), dim=0)
    assert F.cosine_similarity(torch.tensor(vector), expected, dim=0) >= 0.9999
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-5


def test_last_token_pooling_is_the_default_and_matches_transformers(server: InProcessServer, reference: Any) -> None:
    with server.http() as http:
        (vector,) = vectors(embed(http, TEXTS[1]))
        expected = F.normalize(hf_hidden(reference, token_ids(http, TEXTS[1]))[-1], dim=0)
    assert F.cosine_similarity(torch.tensor(vector), expected, dim=0) >= 0.9999


def test_every_input_form_gives_the_same_vectors_and_counts_its_tokens(client: httpx.Client) -> None:
    ids = [token_ids(client, text) for text in TEXTS]
    singles = [vectors(embed(client, text))[0] for text in TEXTS]
    batch = embed(client, TEXTS)
    assert vectors(batch) == singles  # each input's vector is the one it gets alone
    assert batch.json()["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert batch.json()["object"] == "list" and batch.json()["model"] == SERVED_NAME
    assert vectors(embed(client, ids)) == singles
    assert vectors(embed(client, ids[0])) == singles[:1]


def test_base64_is_the_float32_bytes_of_the_vector(client: httpx.Client) -> None:
    (floats,) = vectors(embed(client, TEXTS[0]))
    (encoded,) = vectors(embed(client, TEXTS[0], encoding_format="base64"))
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == np.asarray(floats, dtype=np.float32).tolist()


def test_dimensions_of_the_model_s_own_size_pass_and_a_shortening_is_refused(
    client: httpx.Client, mean_server: InProcessServer
) -> None:
    size = len(vectors(embed(client, TEXTS[0]))[0])
    assert len(vectors(embed(client, TEXTS[0], dimensions=size))[0]) == size
    assert_error(embed(client, TEXTS[0], dimensions=size // 2), 400, "dimensions")  # not a Matryoshka model
    assert_error(embed(client, TEXTS[0], dimensions=size + 1), 400, "dimensions")
    assert_error(embed(client, TEXTS[0], dimensions=0), 400)


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": [[]]},
        {"input": ["a", 1]},
        {"input": [1, [2]]},
        {"input": [-1]},
        {"input": True},
        {"input": None},
        {"input": "x", "encoding_format": "int8"},
        {"input": "x", "dimensions": "8"},
        {"input": "x", "temperature": 0},
        {"input": ["x"] * 2049},
    ],
)
def test_malformed_bodies_get_400(client: httpx.Client, body: dict[str, Any]) -> None:
    assert_error(client.post("/v1/embeddings", json={"model": SERVED_NAME, **body}), 400)


def test_inputs_out_of_vocabulary_too_long_or_for_another_model_are_refused(client: httpx.Client) -> None:
    assert_error(embed(client, [10**6]), 400, "input")
    assert_error(embed(client, ["short", "word " * 100]), 400, "input", "prompt_too_long")
    assert_error(embed(client, [1] * (MAX_PROMPT_TOKENS + 1)), 400, "input", "prompt_too_long")
    response = client.post("/v1/embeddings", json={"model": "other", "input": "x"})
    assert_error(response, 404, "model", "model_not_found")
    assert_error(client.post("/v1/embeddings", json={"input": "x"}), 400)


def test_a_missing_key_gets_401_and_the_engine_keeps_no_kv(mean_server: InProcessServer) -> None:
    with mean_server.http() as anonymous:
        assert embed(anonymous, "x").status_code == 401
    with mean_server.http(KEY) as http:
        vectors(embed(http, TEXTS * 4))
    assert mean_server.app.state.engine.engine.pool.num_used_blocks == 0


def test_the_openai_sdk_reads_floats_and_base64(mean_server: InProcessServer, client: httpx.Client) -> None:
    sdk = mean_server.openai(KEY)
    expected = vectors(embed(client, TEXTS))
    as_floats = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
    assert [item.embedding for item in as_floats.data] == expected
    as_base64 = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert np.allclose([item.embedding for item in as_base64.data], expected, atol=0, rtol=1e-7)
    assert as_base64.usage.prompt_tokens == as_floats.usage.prompt_tokens > 0
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="other", input="x")


def test_rerank_orders_documents_by_cosine_similarity(client: httpx.Client) -> None:
    query = TEXTS[0]
    documents = [TEXTS[1], {"text": TEXTS[0]}, TEXTS[2]]
    body = {"model": SERVED_NAME, "query": query, "documents": documents}
    response = client.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert results[0]["index"] == 1 and results[0]["document"] == {"text": TEXTS[0]}
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    scores = [result["relevance_score"] for result in results]
    assert scores == sorted(scores, reverse=True) and len(results) == 3
    top = client.post("/v1/rerank", json={**body, "top_n": 2, "return_documents": False}).json()["results"]
    assert [result["index"] for result in top] == [result["index"] for result in results[:2]]
    assert all(result["document"] is None for result in top)
    pairs = client.post("/v1/score", json={"model": SERVED_NAME, "text_1": query, "text_2": [TEXTS[1], TEXTS[0]]})
    assert pairs.status_code == 200, pairs.text
    by_index = {result["index"]: result["relevance_score"] for result in results}
    assert [item["score"] for item in pairs.json()["data"]] == pytest.approx([by_index[0], by_index[1]], abs=1e-6)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}),
        ("/v1/rerank", {"query": "", "documents": ["d"]}),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}),
        ("/v1/rerank", {"query": "q", "documents": [{"txt": "d"}]}),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        ("/v1/score", {"text_1": "a"}),
    ],
)
def test_malformed_rerank_and_score_bodies_get_400(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    assert_error(client.post(path, json={"model": SERVED_NAME, **body}), 400)


def test_langchain_openai_embeddings_embed_documents_and_queries(
    mean_server: InProcessServer, client: httpx.Client
) -> None:
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=SERVED_NAME,
        base_url=f"{mean_server.url}/v1",
        api_key=KEY,
        max_retries=0,
        http_client=mean_server.http(KEY),
        check_embedding_ctx_length=False,  # else it tokenizes with tiktoken (OpenAI's vocabulary) and sends ids
    )
    expected = vectors(embed(client, TEXTS))
    assert np.allclose(embeddings.embed_documents(TEXTS), expected, atol=1e-7)
    assert np.allclose(embeddings.embed_query(TEXTS[1]), expected[1], atol=1e-7)


def test_litellm_embeds_through_its_openai_provider(
    mean_server: InProcessServer, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list from the package, not the network
    import litellm

    def litellm_embedding(model: str, input: Any, **extra: Any) -> Any:
        client = mean_server.openai(KEY)  # LiteLLM's OpenAI provider on the in-process app's transport
        return litellm.embedding(model=f"openai/{model}", api_base=f"{mean_server.url}/v1", api_key=KEY, input=input,
                                 client=client, **extra)  # fmt: skip

    expected = vectors(embed(client, TEXTS))
    tokens = client.post("/v1/embeddings", json={"model": SERVED_NAME, "input": TEXTS}).json()["usage"]
    for encoding in ({}, {"encoding_format": "float"}):
        result = litellm_embedding(SERVED_NAME, TEXTS, **encoding)
        assert [item["index"] for item in result.data] == list(range(len(TEXTS)))
        assert np.allclose([item["embedding"] for item in result.data], expected, atol=0, rtol=1e-7)
        assert result.usage.prompt_tokens == tokens["prompt_tokens"] > 0
    with pytest.raises(litellm.NotFoundError):
        litellm_embedding("other", "x")
