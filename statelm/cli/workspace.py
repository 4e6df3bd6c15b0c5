"""A `statelm docs` workspace on disk: the ingested texts, what is in the session's context, the saved snapshot."""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from statelm.paths import default_state_dir

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
DEFAULT_CHARS_PER_TOKEN = 3.0  # conservative for English prose until the workspace has measured its own


@dataclass
class Document:
    """One ingested file: where it came from, where its text is kept, and whether it is in the session's context."""

    source: str
    file: str
    chars: int
    resident: bool
    tokens: int | None = None  # measured when it went into the context
    added: float = field(default_factory=time.time)


@dataclass
class Workspace:
    """The documents of `statelm docs NAME`, kept under the state dir so they are never re-read from their origin."""

    name: str
    root: Path
    documents: list[Document] = field(default_factory=list)
    snapshot_id: str | None = None
    docs_messages: int = 0  # transcript messages that hold the documents; questions come after them

    @classmethod
    def open(cls, name: str, state_dir: Path | None = None) -> Workspace:
        """The workspace called name, empty if new."""
        if not NAME.match(name):
            raise ValueError(f"invalid workspace name {name!r}: use letters, digits, '.', '_' and '-'")
        root = (state_dir or default_state_dir()) / "docs" / name
        try:
            data = json.loads((root / "workspace.json").read_text())
        except FileNotFoundError:
            return cls(name, root)
        documents = [Document(**d) for d in data.pop("documents")]
        return cls(name, root, documents, **data)

    @property
    def session_id(self) -> str:
        """The server-side session holding the documents."""
        return f"docs-{self.name}"

    def save(self) -> None:
        """Write workspace.json atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        data = {
            "documents": [asdict(d) for d in self.documents],
            "snapshot_id": self.snapshot_id,
            "docs_messages": self.docs_messages,
        }
        tmp = self.root / "workspace.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.root / "workspace.json")

    def add(self, source: str, text: str, resident: bool, tokens: int | None) -> Document:
        """Keep a document's text in the workspace."""
        texts = self.root / "texts"
        texts.mkdir(parents=True, exist_ok=True)
        document = Document(source, f"{len(self.documents) + 1:05d}.txt", len(text), resident, tokens)
        (texts / document.file).write_text(text)
        self.documents.append(document)
        return document

    @property
    def vectors_file(self) -> Path:
        """Where the passages' embeddings are kept (statelm.cli.retrieval.PassageVectors)."""
        return self.root / "embeddings.npz"

    def text(self, document: Document) -> str:
        """A document's kept text."""
        return (self.root / "texts" / document.file).read_text()

    def texts(self) -> dict[str, str]:
        """Source → text of every document."""
        return {d.source: self.text(d) for d in self.documents}

    def clear(self) -> None:
        """Forget every document."""
        shutil.rmtree(self.root / "texts", ignore_errors=True)
        self.vectors_file.unlink(missing_ok=True)
        self.documents, self.snapshot_id, self.docs_messages = [], None, 0

    def resident_tokens(self) -> int:
        """Tokens of the documents in the context."""
        return sum(d.tokens or 0 for d in self.documents if d.resident)

    def chars_per_token(self) -> float:
        """Characters per token measured on this workspace's documents (a conservative guess before any)."""
        measured = [d for d in self.documents if d.resident and d.tokens]
        if not measured:
            return DEFAULT_CHARS_PER_TOKEN
        return sum(d.chars for d in measured) / sum(d.tokens or 0 for d in measured)
