"""Paragraph-level BM25 search over a workspace's documents (bm25s)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_PASSAGE_CHARS = 1500
MIN_PASSAGE_CHARS = 200
_BLANK_LINES = re.compile(r"\n\s*\n")


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
        k = min(k, len(self.passages))
        query_tokens = _tokens([query])
        if not k or not query_tokens[0]:
            return []
        ids, scores = self._bm25.retrieve(query_tokens, k=k, show_progress=False)
        return [(self.passages[i], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def sources(self, query: str, limit: int = 3, ratio: float = 0.5) -> list[str]:
        """Documents whose passages match query well: the best one, and others scoring within ratio of it."""
        hits = self.search(query, k=10)
        best = hits[0][1] if hits else 0.0
        found = dict.fromkeys(p.source for p, score in hits if score >= ratio * best)
        return list(found)[:limit]
