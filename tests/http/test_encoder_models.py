"""Encoder models served beside the decoder (`--embedding-model`): a BERT embedder from a Hugging Face folder and
from a GGUF file, and a BERT cross-encoder from a folder and from GGUF files (with its pooler, and without it as
llama.cpp's converter writes it), each compared with transformers on the same weights; a nomic-bert
embedder from a folder and a GGUF file, compared with a float64 forward written here from nomic's published
architecture; routing by `model` and /v1/models."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from statelm.models.encoder_loader import load_encoder
from statelm.models.loader import ModelLoadError
from statelm.server.launch import LaunchError
from tests.http.conftest import SERVED_NAME, InProcessServer, built_app, serve_in_process, tiny_args
from tests.models.tiny_encoders import (
    WORDS,
    make_tiny_bert_dir,
    make_tiny_nomic_dir,
    write_bert_gguf,
    write_nomic_gguf,
    write_sentence_transformers_pooling,
    write_sparse_safetensors,
)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France!", "a cat sat", "Weather?"]
QUERY = "which city is the capital of france?"
RANK_POOLING = 4  # llama.cpp's pooling_type of a reranker


@dataclass
class Encoders:
    """The tiny encoders' folders and files."""

    bert: Path  # mean pooling, Matryoshka
    cls_bert: Path  # CLS pooling, declared by sentence-transformers' files
    gguf: Path  # bert's weights, mean pooling
    reranker: Path
    reranker_gguf: Path  # its weights, the pooler as `cls`, pooling type rank
    reranker_no_pooler: Path  # its weights as llama.cpp's converter writes them: no pooler, no pooling type
    nomic: Path  # nomic-bert, mean pooling
    nomic_gguf: Path  # its weights


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> Encoders:
    """Tiny random encoders."""
    root = tmp_path_factory.mktemp("encoders")
    bert = make_tiny_bert_dir(root / "tiny-bert", matryoshka_dimensions=[16, 32])
    cls_bert = make_tiny_bert_dir(root / "tiny-bert-cls", seed=1)
    write_sentence_transformers_pooling(cls_bert, "cls")
    gguf = write_bert_gguf(bert, root / "tiny-bert-f32.gguf")
    reranker = make_tiny_bert_dir(root / "tiny-reranker", cross_encoder=True, seed=2)
    reranker_gguf = write_bert_gguf(reranker, root / "tiny-reranker-f32.gguf", pooling_type=RANK_POOLING)
    no_pooler = write_bert_gguf(reranker, root / "tiny-reranker-no-pooler.gguf", pooling_type=None, pooler=False)
    nomic = make_tiny_nomic_dir(root / "tiny-nomic")
    nomic_gguf = write_nomic_gguf(nomic, root / "tiny-nomic-f32.gguf")
    return Encoders(bert, cls_bert, gguf, reranker, reranker_gguf, no_pooler, nomic, nomic_gguf)


@pytest.fixture(scope="module")
def app(tiny_model: Path, encoders: Encoders, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The tiny decoder and the eight encoders in one app."""
    extra = [arg for path in vars(encoders).values() for arg in ("--embedding-model", str(path))]
    with serve_in_process(tiny_args(tiny_model, tmp_path_factory.mktemp("encoders") / "state", *extra)) as running:
        yield running


@pytest.fixture(scope="module")
def client(app: InProcessServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the app."""
    with app.http() as http:
        yield http


def hf_embeddings(folder: Path, texts: list[str], pooling: str) -> torch.Tensor:
    """transformers' pooled, normalised embeddings of texts, with the folder's own tokenizer."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        mask = batch["attention_mask"].unsqueeze(-1).float()
        vectors = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    return F.normalize(vectors, dim=-1)


def hf_relevance(folder: Path, query: str, documents: list[str], pooler: bool = True) -> list[float]:
    """transformers' cross-encoder scores (sigmoid of the one logit) of (query, document) pairs; without pooler, its
    classifier on the [CLS] state, as llama.cpp runs a GGUF made by its converter."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits if pooler else model.classifier(model.bert(**batch).last_hidden_state[:, 0])
    return torch.sigmoid(logits[:, 0]).tolist()


def nomic_reference(folder: Path, texts: list[str]) -> torch.Tensor:
    """nomic-bert's mean-pooled, normalised embeddings of texts in float64, from the folder's weights and tokenizer.

    transformers builds nomic-bert from remote code only (nomic's modeling_hf_nomic_bert.py), which the tests cannot
    fetch, so this is the published architecture written out here, independently of statelm's: word and segment-0
    embeddings, then LayerNorm `emb_ln`; per layer, a fused Wqkv split into q, k, v thirds of (heads, head_dim),
    rotary positions on q and k (GPT-NeoX layout: the first half of each head's dimensions paired with the second,
    frequencies base^(-2i/head_dim)), softmax(q k^T / sqrt(head_dim)) v, out_proj, residual and LayerNorm `norm1`;
    then fc2(silu(fc12(x)) * fc11(x)), residual and LayerNorm `norm2`.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    weights = {name: tensor.double() for name, tensor in load_file(folder / "model.safetensors").items()}
    hidden, heads, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    head_dim = hidden // heads
    inv_freq = config["rotary_emb_base"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (hidden,), weights[f"{name}.weight"], weights[f"{name}.bias"], eps)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [n, heads, head_dim]
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    tokenizer = AutoTokenizer.from_pretrained(folder)
    vectors = []
    for text in texts:
        encoded = tokenizer(text, truncation=False, padding=False)  # its tokenizer.json pads and truncates
        ids = torch.tensor([i for i, m in zip(encoded["input_ids"], encoded["attention_mask"], strict=True) if m])
        n = len(ids)
        angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        cos, sin = (torch.cat([f(angles), f(angles)], dim=-1)[:, None, :] for f in (torch.cos, torch.sin))
        x = weights["embeddings.word_embeddings.weight"][ids] + weights["embeddings.token_type_embeddings.weight"][0]
        x = norm(x, "emb_ln")
        for layer in range(config["n_layer"]):
            w = {name.split(f"encoder.layers.{layer}.")[1]: t for name, t in weights.items()
                 if name.startswith(f"encoder.layers.{layer}.")}  # fmt: skip
            q, k, v = (x @ w["attn.Wqkv.weight"].T).view(n, 3, heads, head_dim).unbind(1)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim), dim=-1)
            attended = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hidden)
            x = norm(x + attended @ w["attn.out_proj.weight"].T, f"encoder.layers.{layer}.norm1")
            gated = F.silu(x @ w["mlp.fc12.weight"].T) * (x @ w["mlp.fc11.weight"].T)
            x = norm(x + gated @ w["mlp.fc2.weight"].T, f"encoder.layers.{layer}.norm2")
        vectors.append(F.normalize(x.mean(dim=0), dim=0))
    return torch.stack(vectors)


def embed(client: httpx.Client, model: str, input: Any, **extra: Any) -> torch.Tensor:
    """The vectors /v1/embeddings answers, [inputs, dimensions]."""
    response = client.post("/v1/embeddings", json={"model": model, "input": input, **extra})
    assert response.status_code == 200, response.text
    return torch.tensor([item["embedding"] for item in response.json()["data"]])


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Every row's cosine similarity is at least 0.9999."""
    assert F.cosine_similarity(ours, theirs.float(), dim=-1).min() >= 0.9999


def test_models_lists_the_decoder_then_the_encoders(client: httpx.Client) -> None:
    cards = client.get("/v1/models").json()["data"]
    kinds = {card["id"]: card["kind"] for card in cards}
    assert cards[0]["id"] == SERVED_NAME and cards[0]["sampling_defaults"] is not None
    embedders = ["tiny-bert", "tiny-bert-cls", "tiny-bert-f32", "tiny-nomic", "tiny-nomic-f32"]
    rerankers = ["tiny-reranker", "tiny-reranker-f32", "tiny-reranker-no-pooler"]
    encoders = {**dict.fromkeys(embedders, "embedding"), **dict.fromkeys(rerankers, "reranker")}
    assert kinds == {SERVED_NAME: "generation", **encoders}
    lengths = {card["id"]: card["max_model_len"] for card in cards[1:]}
    assert lengths == {name: 2048 if "nomic" in name else 64 for name in kinds if name != SERVED_NAME}


def test_bert_from_a_folder_matches_transformers(client: httpx.Client, encoders: Encoders) -> None:
    assert_close(embed(client, "tiny-bert", TEXTS), hf_embeddings(encoders.bert, TEXTS, "mean"))


def test_sentence_transformers_cls_pooling_matches_transformers(client: httpx.Client, encoders: Encoders) -> None:
    assert_close(embed(client, "tiny-bert-cls", TEXTS), hf_embeddings(encoders.cls_bert, TEXTS, "cls"))


def test_bert_from_gguf_matches_transformers_on_the_same_weights(client: httpx.Client, encoders: Encoders) -> None:
    ours = embed(client, "tiny-bert-f32", TEXTS)
    assert_close(ours, hf_embeddings(encoders.bert, TEXTS, "mean"))
    assert_close(ours, embed(client, "tiny-bert", TEXTS))  # the WordPiece vocabulary tokenizes as the folder's


def test_nomic_bert_from_a_folder_and_from_gguf_matches_the_published_architecture(
    client: httpx.Client, encoders: Encoders
) -> None:
    texts = [*TEXTS, " ".join(WORDS * 8)]  # the last is 274 tokens: rotary positions far past BERT's 64
    expected = nomic_reference(encoders.nomic, texts)
    assert_close(embed(client, "tiny-nomic", texts), expected)
    assert_close(embed(client, "tiny-nomic-f32", texts), expected)


@pytest.mark.parametrize("model", ["tiny-bert", "tiny-nomic"])
def test_a_vector_does_not_depend_on_its_batch(client: httpx.Client, model: str) -> None:
    batch = embed(client, model, TEXTS)
    for i, text in enumerate(TEXTS):
        assert torch.equal(embed(client, model, text)[0], batch[i])


def test_a_matryoshka_model_shortens_and_renormalises(client: httpx.Client) -> None:
    whole = embed(client, "tiny-bert", TEXTS[0])[0]
    short = embed(client, "tiny-bert", TEXTS[0], dimensions=16)[0]
    assert short.shape == (16,)
    assert torch.allclose(short, F.normalize(whole[:16], dim=0), atol=1e-6)
    response = client.post("/v1/embeddings", json={"model": "tiny-bert-cls", "input": "x", "dimensions": 16})
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"


def test_an_input_longer_than_the_encoder_s_context_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/embeddings", json={"model": "tiny-bert", "input": "the dog " * 40})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("model", "pooler"), [("tiny-reranker", True), ("tiny-reranker-f32", True), ("tiny-reranker-no-pooler", False)]
)
def test_the_reranker_matches_transformers_and_orders_the_documents(
    client: httpx.Client, encoders: Encoders, model: str, pooler: bool
) -> None:
    body = {"model": model, "query": QUERY, "documents": TEXTS, "top_n": 3}
    response = client.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = hf_relevance(encoders.reranker, QUERY, TEXTS, pooler)
    assert [result["index"] for result in results] == sorted(range(len(TEXTS)), key=lambda i: -expected[i])[:3]
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": TEXTS[result["index"]]}
    scored = client.post("/v1/score", json={"model": model, "text_1": QUERY, "text_2": TEXTS})
    assert [item["score"] for item in scored.json()["data"]] == pytest.approx(expected, abs=1e-5)


def test_a_gguf_reranker_without_its_pooler_is_named_and_a_rank_file_without_a_classifier_is_refused(
    encoders: Encoders, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="statelm.models.encoder_loader"):
        assert load_encoder(str(encoders.reranker_no_pooler)).cross_encoder
    assert "the reranker has no pooler" in caplog.text
    headless = write_bert_gguf(encoders.bert, tmp_path / "headless.gguf", pooling_type=RANK_POOLING)
    with pytest.raises(ModelLoadError, match=r"pooling type rank, but the file holds no classifier \(cls.output\)"):
        load_encoder(str(headless))


def test_a_reranker_makes_no_embeddings_and_an_unknown_model_is_404(client: httpx.Client) -> None:
    response = client.post("/v1/embeddings", json={"model": "tiny-reranker", "input": "x"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_supported"
    response = client.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_the_openai_sdk_embeds_with_an_encoder(app: InProcessServer, client: httpx.Client) -> None:
    result = app.openai().embeddings.create(model="tiny-bert", input=TEXTS)
    assert torch.allclose(torch.tensor([item.embedding for item in result.data]), embed(client, "tiny-bert", TEXTS))


def test_an_embedding_s_fingerprint_names_the_model_that_made_it(client: httpx.Client, encoders: Encoders) -> None:
    def fingerprint(model: str) -> str:
        response = client.post("/v1/embeddings", json={"model": model, "input": "a cat sat"})
        return response.json()["system_fingerprint"]

    prints = {model: fingerprint(model) for model in ("tiny-bert", "tiny-bert-cls", "tiny-bert-f32", SERVED_NAME)}
    assert all(value.startswith("fp_") for value in prints.values()) and len(set(prints.values())) == 4
    assert fingerprint(str(encoders.bert)) == prints["tiny-bert"]  # by its alias: the same model


def test_hybrid_retrieval_fuses_the_bm25_and_embedding_rankings(client: httpx.Client) -> None:
    from statelm.cli.client import Embeddings
    from statelm.cli.retrieval import HybridIndex, reciprocal_rank_fusion

    def embed_texts(texts: list[str]) -> Embeddings:
        return Embeddings(embed(client, "tiny-bert", texts).tolist(), "fp_tiny-bert")

    documents = {f"doc{i}.md": text for i, text in enumerate(TEXTS)}
    index = HybridIndex(documents, embed_texts)
    query = "the capital city"
    lexical = [i for i, _ in index.lexical(query, 10)]
    semantic = index.semantic(query, 10)
    assert lexical and sorted(semantic) == list(range(len(TEXTS)))
    expected = [index.passages[i].source for i, _ in reciprocal_rank_fusion([lexical, semantic])]
    assert [passage.source for passage, _ in index.search(query, k=10)] == expected
    assert len(index.search("the of a", k=2)) == 2  # no word BM25 counts: the embeddings still rank every passage


def test_an_encoder_larger_than_the_memory_left_stops_the_start(
    tiny_model: Path, encoders: Encoders, tmp_path: Path
) -> None:
    huge = shutil.copytree(encoders.bert, tmp_path / "huge-bert")
    write_sparse_safetensors(huge / "model.safetensors", 2**37)  # 512 GiB of float32, none of it on disk
    encoder_args = ["--embedding-model", str(encoders.gguf), "--embedding-model", str(huge)]
    weights = rf"{re.escape(str(encoders.gguf))}'s weights 0\.\d MiB, {re.escape(str(huge))}'s weights 524,288\.0 MiB"
    expected = rf"not enough memory: the chat model's weights \d.* MiB, its KV pool 64\.0 MiB, {weights} need "
    with (
        pytest.raises(LaunchError, match=expected),
        built_app(tiny_args(tiny_model, tmp_path / "state", *encoder_args)),
    ):
        pass
