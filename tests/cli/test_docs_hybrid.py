"""`statelm docs` against a real server that serves an embedding model beside the chat model (a tiny random decoder
and a tiny random BERT): retrieval is hybrid, and the passages' embeddings are kept with the workspace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.cli.helpers import run_cli
from tests.e2e.conftest import start_server, stop_server
from tests.models.tiny_encoders import make_tiny_bert_dir
from tests.models.tiny_model_dir import make_tiny_model_dir

QUESTION = "What is the launch code of the Zephyr project?"
ASK = ["--temperature", "0", "--max-tokens", "4", "-p"]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of a tiny decoder (context 4,096: a 3,072-token budget for documents) and tiny-bert."""
    root = tmp_path_factory.mktemp("docs-hybrid")
    decoder = make_tiny_model_dir("qwen2", root / "tiny-qwen2", max_position_embeddings=4096)
    encoder = make_tiny_bert_dir(root / "tiny-bert", shape={"max_position_embeddings": 512})
    args = ["--model", str(decoder), "--kv-cache-memory", "64MiB", "--threads", "1", "--embedding-model", str(encoder)]
    process, url = start_server(args, root / "server.log")
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def env(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The CLI's environment: this module's server, its own state dir."""
    return {"STATELM_URL": server_url, "XDG_STATE_HOME": str(tmp_path_factory.mktemp("cli-home"))}


def docs(args: list[str], env: dict[str, str]) -> str:
    """stdout of a `statelm docs` run that must succeed."""
    result = run_cli(["docs", *args], env)
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.output}"
    return result.stdout


def vectors_file(env: dict[str, str], workspace: str) -> Path:
    return Path(env["XDG_STATE_HOME"]) / "statelm" / "docs" / workspace / "embeddings.npz"


def test_docs_retrieves_with_bm25_and_embeddings_and_keeps_them(
    tmp_path: Path, env: dict[str, str], server_url: str
) -> None:
    filler = "The river market opens in summer and the winter school teaches music to the people of the city."
    paragraphs = [f"{filler} Paragraph {i}." for i in range(90)]
    paragraphs[61] = "The launch code of the Zephyr project is amber-falcon-42; it is kept in the vault."
    (tmp_path / "archive.txt").write_text("\n\n".join(paragraphs))

    out = docs(["hybrid", "--add", str(tmp_path / "archive.txt"), *ASK, QUESTION], env)
    assert "would overflow the context" in out
    assert "passages embedded with tiny-bert, kept with the workspace" in out
    assert "excerpts found by BM25 + embeddings of tiny-bert, fused by reciprocal rank" in out
    assert "archive.txt" in out.split("Sources: ", 1)[1]

    stored = vectors_file(env, "hybrid")
    answer = httpx.post(f"{server_url}/v1/embeddings", json={"model": "tiny-bert", "input": "x"}).json()
    with np.load(stored) as kept:
        assert str(kept["fingerprint"]) == answer["system_fingerprint"]
        assert kept["vectors"].shape[1] == len(answer["data"][0]["embedding"]) and len(kept["keys"]) > 10
    written = stored.stat().st_mtime_ns

    out = docs(["hybrid", *ASK, "Where is the launch code kept?"], env)  # the next start: nothing embedded again
    assert "passages embedded" not in out and "excerpts found by BM25 + embeddings of tiny-bert" in out
    assert stored.stat().st_mtime_ns == written

    with np.load(stored) as kept:  # as another model left them: every passage is embedded again
        other = {"fingerprint": np.str_("fp_another"), "keys": kept["keys"], "vectors": kept["vectors"]}
    with stored.open("wb") as handle:
        np.savez(handle, **other)
    out = docs(["hybrid", *ASK, QUESTION], env)
    assert f"{len(other['keys'])} passages embedded with tiny-bert" in out
    with np.load(stored) as kept:
        assert str(kept["fingerprint"]) == answer["system_fingerprint"]
