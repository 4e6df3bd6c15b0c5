"""Paragraph-level search over a workspace's documents: BM25 (bm25s), and when the server serves an embedding model,
BM25 and embeddings fused by reciprocal rank."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statelm.cli.client import Embeddings

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


Embedder = Callable[[list[str]], Embeddings]  # a server's unit vectors of texts, one per text, and its fingerprint


class EmbeddingFailed(Exception):
    """The embedding model could not embed a text (the server refused it, or could not be reached)."""


def passage_key(text: str) -> str:
    """What a passage's vector is kept under: its text's sha256 (the same text has the same vector)."""
    return hashlib.sha256(text.encode()).hexdigest()


class PassageVectors:
    """Passages' embeddings kept in a file beside the workspace's texts, by passage, for one model fingerprint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, fingerprint: str) -> dict[str, Any]:
        """Passage key → vector, as kept for the model of this fingerprint (none when another model made them)."""
        import numpy as np

        try:
            with np.load(self.path) as kept:
                if str(kept["fingerprint"]) != fingerprint:
                    return {}
                return dict(zip(kept["keys"].tolist(), kept["vectors"], strict=True))
        except (OSError, KeyError, ValueError):  # none yet, or a file this version cannot read: embed again
            return {}

    def save(self, fingerprint: str, keys: list[str], vectors: Any) -> None:
        """Keep these passages' vectors (and no others) for the model of this fingerprint, atomically."""
        import numpy as np

        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        with partial.open("wb") as handle:
            np.savez(handle, fingerprint=np.str_(fingerprint), keys=np.array(keys, dtype=str), vectors=vectors)
        partial.replace(self.path)


class HybridIndex(PassageIndex):
    """BM25 and an embedding model over the same passages, their rankings fused by reciprocal rank; BM25 alone
    from the first time the embeddings fail (`failure` says why). With a store, passages' vectors are kept and
    only those of new passages, or of every passage when the model's fingerprint changes, are embedded."""

    def __init__(self, documents: dict[str, str], embed: Embedder, store: PassageVectors | None = None) -> None:
        super().__init__(documents)
        self.embed = embed
        self.store = store
        self.failure: str | None = None
        self.embedded = 0  # passages embedded by this index (the others came from the store)
        self._vectors: Any = None  # numpy [passages, dimensions], on the first search
        self._fingerprint: str | None = None  # of the model that made _vectors

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

        asked = self.embed([query])
        self._use_model(asked.fingerprint)
        similarity = self._vectors @ np.asarray(asked.vectors[0], dtype=np.float32)
        return [int(i) for i in np.argsort(-similarity, kind="stable")[:k]]

    def prepare(self) -> None:
        """Every passage's vector now, kept or embedded, so that the first search embeds only its query."""
        if not self.passages or self.failure is not None:
            return
        try:
            self._use_model(self.embed([self.passages[0].text]).fingerprint)
        except EmbeddingFailed as exc:
            self.failure = str(exc)

    def _use_model(self, fingerprint: str) -> None:
        """The passages' vectors by the model of fingerprint, unless they are already its."""
        if self._fingerprint != fingerprint:
            self._vectors = self._passage_vectors(fingerprint)
            self._fingerprint = fingerprint

    def _passage_vectors(self, fingerprint: str) -> Any:
        """Every passage's vector by the model of fingerprint: kept ones from the store, the rest embedded (and
        kept)."""
        import numpy as np

        keys = [passage_key(passage.text) for passage in self.passages]
        known = self.store.load(fingerprint) if self.store is not None else {}
        missing = {key: passage.text for key, passage in zip(keys, self.passages, strict=True) if key not in known}
        texts, new_keys = list(missing.values()), list(missing)
        for start in range(0, len(texts), EMBED_BATCH):
            answer = self.embed(texts[start : start + EMBED_BATCH])
            if answer.fingerprint != fingerprint:
                raise EmbeddingFailed("the server's embedding model changed while the passages were embedded")
            known.update(zip(new_keys[start : start + EMBED_BATCH], answer.vectors, strict=True))
        vectors = np.asarray([known[key] for key in keys], dtype=np.float32)
        self.embedded += len(missing)
        if missing and self.store is not None:
            self.store.save(fingerprint, keys, vectors)
        return vectors
