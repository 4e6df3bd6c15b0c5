"""Paragraph-level search over a workspace's documents: BM25 (bm25s), and when the server serves an embedding model,
BM25 and embeddings fused by reciprocal rank."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_PASSAGE_CHARS = 1500
MIN_PASSAGE_CHARS = 200
_BLANK_LINES = re.compile(r"\n\s*\n")
RRF_K = 60  # reciprocal rank fusion's constant, as Cormack, Clarke and Büttcher set it
CANDIDATES = 50  # how deep each ranking goes before fusion
EMBED_BATCH = 64  # passages per embeddings request


@dataclass(frozen=True)
class Passage:
    """A paragraph-sized piece of a document."""

    source: str
    text: str


def split_passages(text: str) -> list[str]:
    """Paragraphs of text, short neighbours merged and long ones cut at line ends, about MAX_PASSAGE_CHARS at most."""
    pieces: list[str] = []
    for paragraph in (p.strip() for p in _BLANK_LINES.split(text)):
        while len(paragraph) > MAX_PASSAGE_CHARS:
            cut = paragraph.rfind("\n", 0, MAX_PASSAGE_CHARS)
            cut = cut if cut > MIN_PASSAGE_CHARS else paragraph.rfind(" ", 0, MAX_PASSAGE_CHARS)
            cut = cut if cut > MIN_PASSAGE_CHARS else MAX_PASSAGE_CHARS
            pieces.append(paragraph[:cut].strip())
            paragraph = paragraph[cut:].strip()
        if paragraph:
            pieces.append(paragraph)
    merged: list[str] = []
    for piece in pieces:
        if merged and len(merged[-1]) < MIN_PASSAGE_CHARS and len(merged[-1]) + len(piece) < MAX_PASSAGE_CHARS:
            merged[-1] += "\n\n" + piece
        else:
            merged.append(piece)
    return merged


def _bm25() -> Any:
    """The bm25s module, imported on first use: it pulls in numpy, which every other command can do without."""
    import bm25s

    return bm25s


def _tokens(texts: list[str]) -> list[list[str]]:
    """Lower-cased word tokens without English stop words."""
    return _bm25().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class PassageIndex:
    """A BM25 index over the passages of some documents."""

    def __init__(self, documents: dict[str, str]) -> None:
        self.passages = [Passage(source, piece) for source, text in documents.items() for piece in split_passages(text)]
        self._bm25 = _bm25().BM25()
        if self.passages:
            self._bm25.index(_tokens([p.text for p in self.passages]), show_progress=False)

    def search(self, query: str, k: int = 10) -> list[tuple[Passage, float]]:
        """The passages that best match query, best first, with their scores (only those that match at all)."""
        return [(self.passages[i], score) for i, score in self.lexical(query, k)]

    def lexical(self, query: str, k: int) -> list[tuple[int, float]]:
        """Indices of the k passages BM25 scores highest for query, with their scores (only those above 0)."""
        k = min(k, len(self.passages))
        query_tokens = _tokens([query])
        if not k or not query_tokens[0]:
            return []
        ids, scores = self._bm25.retrieve(query_tokens, k=k, show_progress=False)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def sources(self, query: str, limit: int = 3, ratio: float = 0.5) -> list[str]:
        """Documents whose passages match query well: the best one, and others scoring within ratio of it."""
        hits = self.search(query, k=10)
        best = hits[0][1] if hits else 0.0
        found = dict.fromkeys(p.source for p, score in hits if score >= ratio * best)
        return list(found)[:limit]


def reciprocal_rank_fusion(rankings: list[list[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Items of several rankings (best first) by the sum of 1 / (k + rank) over the rankings that hold them."""
    scores: dict[int, float] = defaultdict(float)
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] += 1 / (k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


Embedder = Callable[[list[str]], list[list[float]]]  # unit vectors of texts, one per text (a server's embeddings)


class EmbeddingFailed(Exception):
    """The embedding model could not embed a text (the server refused it, or could not be reached)."""


class HybridIndex(PassageIndex):
    """BM25 and an embedding model over the same passages, their rankings fused by reciprocal rank; BM25 alone
    from the first time the embeddings fail (`failure` says why)."""

    def __init__(self, documents: dict[str, str], embed: Embedder) -> None:
        super().__init__(documents)
        self.embed = embed
        self.failure: str | None = None
        self._vectors: Any = None  # numpy [passages, dimensions], embedded on the first search

    def search(self, query: str, k: int = 10) -> list[tuple[Passage, float]]:
        """The passages ranked best by BM25 and by cosine similarity together, with their fused scores."""
        if not self.passages or self.failure is not None:
            return super().search(query, k)
        lexical = [i for i, _ in self.lexical(query, CANDIDATES)]
        try:
            semantic = self.semantic(query, CANDIDATES)
        except EmbeddingFailed as exc:
            self.failure = str(exc)
            return super().search(query, k)
        fused = reciprocal_rank_fusion([lexical, semantic])
        return [(self.passages[i], score) for i, score in fused[:k]]

    def semantic(self, query: str, k: int) -> list[int]:
        """Indices of the k passages whose embeddings are closest to the query's, closest first."""
        import numpy as np

        if self._vectors is None:
            texts = [passage.text for passage in self.passages]
            batches = (texts[start : start + EMBED_BATCH] for start in range(0, len(texts), EMBED_BATCH))
            rows = [row for batch in batches for row in self.embed(batch)]
            self._vectors = np.asarray(rows, dtype=np.float32)
        similarity = self._vectors @ np.asarray(self.embed([query])[0], dtype=np.float32)
        return [int(i) for i in np.argsort(-similarity, kind="stable")[:k]]
