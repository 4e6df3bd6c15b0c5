"""A GGUF file memory-mapped: its key/value metadata decoded, and its tensors as views of the mapped bytes.

gguf-py's GGUFReader builds a numpy view per element of every array it parses: 2.6 s and 170 MB for the 49k-token
vocabulary of the bundled 135M model, against a 5 s budget for a whole cold start. This parser reads the same
header (GGUF versions 2 and 3: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) in one pass, strings
with plain slicing and numeric arrays with one numpy call each, and maps the file once (private, read-only in
practice), so that a tensor is a view of the file: nothing is copied, and only the pages read are resident.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: struct format of the scalars, numpy dtype of their arrays.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file this parser reads."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, ggml type, shape (outermost first, as torch has it) and data offset."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # from the start of the file

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        values, size = GGML_QUANT_SIZES[self.qtype]
        count = int(np.prod(self.shape))
        return count // values * size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (see from_dict)."""
        return {"name": self.name, "type": int(self.qtype), "shape": list(self.shape), "offset": self.offset}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TensorInfo:
        """The tensor info back from to_dict's form."""
        return cls(raw["name"], GGMLQuantizationType(raw["type"]), tuple(raw["shape"]), raw["offset"])


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFFormatError("the header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        if self.at + length > len(self.data):
            raise GGUFFormatError("a string runs past the end of the file")
        value = bytes(self.data[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return value

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _DTYPES:
                raise GGUFFormatError(f"unsupported GGUF array item type {item}")
            dtype = np.dtype(_DTYPES[item])
            end = self.at + count * dtype.itemsize
            if end > len(self.data):
                raise GGUFFormatError("an array runs past the end of the file")
            values = np.frombuffer(self.data[self.at : end], dtype=dtype).tolist()
            self.at = end
            return values
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unsupported GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header says: decoded key/value metadata, tensor infos by name, where tensor data starts."""

    fields: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (see from_dict)."""
        tensors = [info.to_dict() for info in self.tensors.values()]
        return {"fields": self.fields, "tensors": tensors, "data_offset": self.data_offset}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GGUFHeader:
        """The header back from to_dict's form."""
        tensors = [TensorInfo.from_dict(info) for info in raw["tensors"]]
        return cls(raw["fields"], {info.name: info for info in tensors}, raw["data_offset"])


class GGUFFile:
    """A GGUF file mapped into memory, with its header (parsed, or as parsed before: a cached GGUFHeader)."""

    def __init__(self, path: Path, header: GGUFHeader | None = None) -> None:
        self.path = Path(path)
        with self.path.open("rb") as file:
            try:
                self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError as exc:  # an empty file
                raise GGUFFormatError(f"cannot map the file ({exc})") from exc
        if hasattr(mmap, "MADV_WILLNEED"):
            self.map.madvise(mmap.MADV_WILLNEED)  # start reading ahead; nothing waits for it
        self.header = header or _parse(memoryview(self.map))
        for info in self.header.tensors.values():
            if info.offset + info.nbytes > len(self.map):
                raise GGUFFormatError(f"tensor {info.name} runs past the end of the file")

    @property
    def header_bytes(self) -> bytes:
        """The bytes before the tensor data: magic, metadata and tensor infos."""
        return bytes(self.map[: self.header.data_offset])

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor viewing the mapped file (no copy)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def array(self, info: TensorInfo) -> np.ndarray:
        """The tensor viewing the mapped file as gguf-py's reader gives it: F32 and F16 as numbers, other types as
        bytes [..., row bytes] (what gguf.quants.dequantize takes)."""
        values, size = GGML_QUANT_SIZES[info.qtype]
        data = np.frombuffer(self.map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if info.qtype == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if info.qtype == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(info.shape)
        return data.reshape(*info.shape[:-1], info.shape[-1] // values * size)


def _parse(data: memoryview) -> GGUFHeader:
    cursor = _Cursor(data)
    if bytes(data[:4]) != MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cursor.at = 4
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, field_count = cursor.scalar("Q"), cursor.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("I"))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        kind, offset = cursor.scalar("I"), cursor.scalar("Q")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown ggml type {kind}") from None
        infos.append((name, qtype, tuple(reversed(dims)), offset))
    data_offset = -(-cursor.at // alignment) * alignment
    tensors = {name: TensorInfo(name, qtype, shape, data_offset + offset) for name, qtype, shape, offset in infos}
    return GGUFHeader(fields, tensors, data_offset)
