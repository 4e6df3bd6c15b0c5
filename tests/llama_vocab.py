"""llama.cpp's tokenizer test vocabularies: `models/ggml-vocab-*.gguf` and their `.inp`/`.out` vectors.

They come from the llama.cpp sources that the llama-cpp-python sdist vendors (PyPI is the one reachable
source). `python -m tests.llama_vocab` (run by `make test-data`, which `make test` depends on) downloads the
sdist once, keeps only those files and llama.cpp's vocabulary loader (`src/llama-vocab.cpp`, to check that every
pre-tokenizer it names is handled) in the user cache, and deletes the archive.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs
import pytest

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"
REQUIRED_ENV = "STATELM_REQUIRE_TEST_DATA"  # set by `make test`: missing data fails instead of skipping
_COMPLETE = ".complete"


def vocab_dir() -> Path:
    """Where the vocabularies live once fetched."""
    cache = Path(platformdirs.user_cache_dir("statelm"))
    return cache / "test-data" / f"llama.cpp-vocab-{LLAMA_CPP_PYTHON_VERSION}"


def require_vocab_dir() -> Path:
    """The fetched directory; skips the test (fails under `make test`) when it is not there."""
    directory = vocab_dir()
    if not (directory / _COMPLETE).is_file():
        message = f"llama.cpp's tokenizer test vocabularies are not in {directory}; run `make test-data`"
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(message)
        pytest.skip(message)
    return directory


def fetch() -> Path:
    """Download the sdist once and keep only the vocabularies, their vectors and llama-vocab.cpp."""
    directory = vocab_dir()
    if (directory / _COMPLETE).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent) as scratch:
        package = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, package, "-d", scratch], check=True)
        (archive,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
        staging = Path(scratch) / "vocab"
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.isfile() and _wanted(member.name):
                    source = tar.extractfile(member)
                    assert source is not None
                    (staging / Path(member.name).name).write_bytes(source.read())
        (staging / _COMPLETE).write_text(LLAMA_CPP_PYTHON_VERSION + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    return directory


def _wanted(name: str) -> bool:
    parts = Path(name).parts
    if parts[-3:-1] == ("llama.cpp", "models"):
        return parts[-1].startswith("ggml-vocab-")
    return parts[-4:] == ("vendor", "llama.cpp", "src", "llama-vocab.cpp")


def read_vectors(vocab: Path) -> dict[str, list[int]]:
    """The `.inp` texts and `.out` ids next to `vocab`, paired as llama.cpp's test-tokenizer-0 pairs them."""
    raw = Path(f"{vocab}.inp").read_text(encoding="utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        cut = raw.find(VECTOR_SEPARATOR, pos)
        if cut < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:cut])
        pos = cut + len(VECTOR_SEPARATOR)
    outputs = Path(f"{vocab}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(outputs), f"{vocab}: {len(texts)} inputs, {len(outputs)} outputs"
    return {text: [int(i) for i in line.split()] for text, line in zip(texts, outputs, strict=True)}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata as Python values, in a fraction of the gguf package's time.

    Same values as `field.contents()` gives the loader (lists for arrays, str, int, float, bool); the
    gguf package builds an object per array element, which takes tens of seconds on a 256k vocabulary.
    """
    data = Path(path).read_bytes()
    magic, _version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + size].decode("utf-8"), at + 8 + size

    def value(kind: int, at: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item == _STRING:
                items = []
                for _ in range(count):
                    text, at = string(at)
                    items.append(text)
                return items, at
            array = np.frombuffer(data, dtype=np.dtype(_SCALARS[item]), count=count, offset=at)
            return array.tolist(), at + array.nbytes
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        fields[key], pos = value(kind, pos + 4)
    return fields


if __name__ == "__main__":
    print(fetch())
