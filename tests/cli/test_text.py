"""The CLI's text handling without a server: file extraction, passages and BM25, think-tag splitting."""

from __future__ import annotations

from pathlib import Path

import pytest

from statelm.cli.client import Embeddings
from statelm.cli.extract import ExtractError, expand, extract_text
from statelm.cli.retrieval import (
    MAX_PASSAGE_CHARS,
    EmbeddingFailed,
    HybridIndex,
    PassageIndex,
    PassageVectors,
    passage_key,
    reciprocal_rank_fusion,
    split_passages,
)
from statelm.cli.turns import ThinkSplitter


def write_pdf(path: Path, text: str) -> None:
    """A one-page PDF whose text layer is text (Helvetica, no compression)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))


def test_extracts_pdf_markdown_and_code_and_rejects_binaries(tmp_path: Path) -> None:
    write_pdf(tmp_path / "report.pdf", "Revenue grew by 12 percent in 2024.")
    (tmp_path / "notes.md").write_text("# Notes\n\nCafé at 9.\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (tmp_path / "empty.txt").write_text("  \n")
    assert "Revenue grew by 12 percent" in extract_text(tmp_path / "report.pdf")
    assert extract_text(tmp_path / "notes.md") == "# Notes\n\nCafé at 9."
    with pytest.raises(ExtractError, match="binary"):
        extract_text(tmp_path / "image.png")
    with pytest.raises(ExtractError, match="empty"):
        extract_text(tmp_path / "empty.txt")


def test_expand_walks_folders_for_documents_and_takes_globs_as_given(tmp_path: Path) -> None:
    for name in ("a.md", "src/b.py", "src/c.png", ".git/config.txt", "node_modules/x.js", "docs/d.pdf"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    files, unmatched = expand([str(tmp_path), str(tmp_path / "src" / "*"), str(tmp_path / "nothing*")])
    names = sorted(str(f.relative_to(tmp_path)) for f in files)
    assert names == ["a.md", "docs/d.pdf", "src/b.py", "src/c.png"]  # the png only through the glob
    assert unmatched == [str(tmp_path / "nothing*")]


def test_passages_merge_short_paragraphs_and_cut_long_ones() -> None:
    text = "Short one.\n\nShort two.\n\n" + ("word " * 800)
    passages = split_passages(text)
    assert passages[0].startswith("Short one.\n\nShort two.")
    assert all(len(p) <= MAX_PASSAGE_CHARS for p in passages)
    assert sum(len(p.split()) for p in passages) == 804


def test_bm25_finds_the_document_that_answers() -> None:
    index = PassageIndex(
        {
            "pets.md": "The office cat is named Biscuit.\n\nShe sleeps on the printer.",
            "travel.txt": "The train to Lyon leaves at 9:15 from platform 4.",
            "tools.py": "def deploy():\n    return 'staging'",
        }
    )
    assert index.search("which platform does the Lyon train use", k=1)[0][0].source == "travel.txt"
    assert index.sources("What is the name of the office cat?") == ["pets.md"]
    assert index.search("zebra quantum", k=3) == []


def test_think_splitter_handles_tags_cut_across_chunks() -> None:
    splitter = ThinkSplitter()
    chunks = ["<thi", "nk>plan: add", " 2+2</th", "ink>It is", " 4.", "<", "b> <"]
    pieces = [*(splitter.feed(chunk) for chunk in chunks), splitter.flush()]
    answer = "".join(a for a, _ in pieces)
    reasoning = "".join(r for _, r in pieces)
    assert (answer, reasoning) == ("It is 4.<b> <", "plan: add 2+2")


def test_reciprocal_rank_fusion_rewards_agreement_between_rankings() -> None:
    fused = reciprocal_rank_fusion([[3, 1, 2], [1, 4]], k=60)
    assert [item for item, _ in fused] == [1, 3, 4, 2]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)
    assert reciprocal_rank_fusion([]) == []


def test_hybrid_retrieval_goes_on_with_bm25_when_the_embeddings_fail() -> None:
    def refuse(texts: list[str]) -> Embeddings:
        raise EmbeddingFailed("context_length_exceeded")

    documents = {"pets.md": "The office cat is named Biscuit.", "travel.txt": "The train to Lyon leaves at 9:15."}
    index = HybridIndex(documents, refuse)
    assert index.search("Lyon train", k=2) == PassageIndex(documents).search("Lyon train", k=2)
    assert index.failure == "context_length_exceeded"


class WordEmbedder:
    """Unit vectors of texts' word counts over a fixed vocabulary, as a model of some fingerprint; it counts the
    texts it embeds."""

    VOCABULARY = ("cat", "biscuit", "train", "lyon", "printer", "platform", "deploy", "staging")

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.texts: list[str] = []

    def __call__(self, texts: list[str]) -> Embeddings:
        self.texts += texts
        vectors = []
        for text in texts:
            counts = [text.lower().count(word) + 0.01 for word in self.VOCABULARY]
            norm = sum(c * c for c in counts) ** 0.5
            vectors.append([c / norm for c in counts])
        return Embeddings(vectors, self.fingerprint)


def test_passage_vectors_are_kept_and_embedded_again_only_for_new_passages_or_another_model(tmp_path: Path) -> None:
    documents = {"pets.md": "The office cat is named Biscuit. " * 7 + "\n\n" + "She sleeps on the printer. " * 12,
                 "travel.txt": "The train to Lyon leaves at 9:15 from platform 4."}  # fmt: skip
    store = PassageVectors(tmp_path / "embeddings.npz")
    first = WordEmbedder("fp_a")
    fresh = HybridIndex(documents, first, store)
    fresh.prepare()
    assert fresh.embedded == len(fresh.passages) == 3 and store.path.is_file()
    ranked = fresh.search("which train goes to Lyon", k=3)

    again = WordEmbedder("fp_a")
    kept = HybridIndex(documents, again, store)
    assert kept.search("which train goes to Lyon", k=3) == ranked and kept.embedded == 0
    assert again.texts == ["which train goes to Lyon"]  # the query alone

    grown = {**documents, "deploy.py": "def deploy(): push to staging"}
    added = WordEmbedder("fp_a")
    index = HybridIndex(grown, added, store)
    index.prepare()
    assert index.embedded == 1 and added.texts[-1] == "def deploy(): push to staging"
    assert set(store.load("fp_a")) == {passage_key(p.text) for p in index.passages}

    other = WordEmbedder("fp_b")
    switched = HybridIndex(grown, other, store)
    switched.prepare()
    assert switched.embedded == 4 and store.load("fp_a") == {} and len(store.load("fp_b")) == 4


def test_a_model_changing_while_passages_are_embedded_leaves_bm25_and_keeps_nothing(tmp_path: Path) -> None:
    answers = iter(["fp_a", "fp_b"])

    def changing(texts: list[str]) -> Embeddings:
        return Embeddings([[1.0, 0.0] for _ in texts], next(answers))

    store = PassageVectors(tmp_path / "embeddings.npz")
    index = HybridIndex({"a.md": "alpha beta"}, changing, store)
    index.prepare()
    assert index.failure is not None and "changed" in index.failure and not store.path.exists()
