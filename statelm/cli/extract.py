"""Turn paths, globs and folders into files, and files (text, Markdown, code, PDF) into text."""

from __future__ import annotations

import glob
from pathlib import Path

TEXT_SUFFIXES = frozenset(f".{suffix}" for suffix in (
    "txt", "md", "markdown", "rst", "adoc", "org", "tex", "csv", "tsv", "json", "jsonl", "yaml", "yml", "toml", "ini",
    "cfg", "conf", "xml", "html", "htm", "py", "pyi", "ipynb", "c", "h", "cc", "cpp", "hpp", "cu", "rs", "go", "java",
    "kt", "scala", "swift", "m", "js", "jsx", "ts", "tsx", "vue", "svelte", "rb", "php", "pl", "lua", "r", "jl", "sh",
    "bash", "zsh", "fish", "ps1", "sql", "graphql", "proto", "css", "scss", "mk", "cmake", "gradle", "el", "clj", "ex",
    "exs", "erl", "hs", "ml", "fs", "dart", "zig", "nim", "v", "sv", "vhd",
))  # fmt: skip
TEXT_NAMES = frozenset({"Makefile", "Dockerfile", "README", "LICENSE", "CHANGELOG", "CMakeLists.txt"})
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache"})
BINARY_SNIFF_BYTES = 8192


class ExtractError(Exception):
    """A file whose text cannot be read; the message says why."""


def is_document(path: Path) -> bool:
    """Whether a file found in a folder looks like text, Markdown, code or PDF."""
    return path.suffix.lower() in TEXT_SUFFIXES or path.suffix.lower() == ".pdf" or path.name in TEXT_NAMES


def expand(specs: list[str]) -> tuple[list[Path], list[str]]:
    """The files named by paths, globs and folders (folders: documents only, recursively), and specs matching none."""
    found: dict[Path, None] = {}
    unmatched = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_file():
            candidates = [path]
        elif path.is_dir():
            candidates = [p for p in sorted(path.rglob("*")) if p.is_file() and _visible(p, path) and is_document(p)]
        else:
            candidates = [p for p in sorted(Path(m) for m in glob.glob(str(path), recursive=True)) if p.is_file()]
        if not candidates:
            unmatched.append(spec)
        found.update(dict.fromkeys(p.resolve() for p in candidates))
    return list(found), unmatched


def _visible(path: Path, root: Path) -> bool:
    """Whether a file under root is outside hidden and tool folders."""
    parts = path.relative_to(root).parts
    return not any(part.startswith(".") or part in SKIPPED_DIRS for part in parts)


def display_name(path: Path) -> str:
    """A path relative to the working directory when it is under it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def extract_text(path: Path) -> str:
    """The text of a file: PDFs through pypdf, anything else as UTF-8 unless it looks binary."""
    try:
        if path.suffix.lower() == ".pdf":
            return _pdf_text(path)
        data = path.read_bytes()
    except OSError as exc:
        raise ExtractError(exc.strerror or str(exc)) from None
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        raise ExtractError("binary file")
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        raise ExtractError("empty")
    return text


def _pdf_text(path: Path) -> str:
    """The text layer of a PDF, page by page."""
    from pypdf import PdfReader  # imported here: it is slow to import and only PDFs need it
    from pypdf.errors import PdfReadError

    try:
        pages = [page.extract_text() or "" for page in PdfReader(path).pages]
    except PdfReadError as exc:
        raise ExtractError(f"unreadable PDF ({exc})") from None
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    if not text:
        raise ExtractError("PDF without a text layer (scanned?)")
    return text
