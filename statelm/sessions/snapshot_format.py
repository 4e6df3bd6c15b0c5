"""The snapshot format: a bundle of files with a manifest, the token ids, the transcript and the KV.

```
manifest.json     schema version, model fingerprint, counts, metadata, sha256 and size of every file
tokens.json       the token ids whose K/V are stored
transcript.json   the conversation's messages
kv.safetensors    k.<layer> and v.<layer>, each [tokens, kv_heads, head_dim]
```

A snapshot (a user's, or a session saved or spilled) is a bundle in a state store (statelm.sessions.state_store),
which writes it atomically and durably, so a crash never leaves a visible half-written snapshot. Reading verifies the
schema, the model fingerprint and every checksum before anything is used. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from statelm.engine.client import SessionKVData
from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import FingerprintMismatchError, SnapshotCorruptError, SnapshotQuotaError
from statelm.sessions.state_store import Area, StateStore

SCHEMA_VERSION = 1
FORMAT_NAME = "statelm-snapshot"
MANIFEST = "manifest.json"
TOKENS = "tokens.json"
TRANSCRIPT = "transcript.json"
KV = "kv.safetensors"


@dataclass
class SnapshotContent:
    """Everything a snapshot holds besides its manifest."""

    transcript: list[dict[str, Any]]
    kv: SessionKVData


def write_snapshot(
    store: StateStore,
    area: Area,
    name: str,
    manifest: dict[str, Any],
    content: SnapshotContent,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """Write content and manifest (completed with counts and checksums) as the bundle name, atomically.

    With max_bytes, a snapshot whose files would take more raises SnapshotQuotaError before anything is written.
    """
    manifest, files = encode_snapshot(manifest, content)
    size = sum(len(data) for data in files.values())
    if max_bytes is not None and size > max_bytes:
        raise SnapshotQuotaError(
            f"the snapshot needs {size} bytes but only {max(max_bytes, 0)} bytes of this key's snapshot quota "
            "are left; delete snapshots to make room"
        )
    store.write_bundle(area, name, files)
    return manifest


def encode_snapshot(manifest: dict[str, Any], content: SnapshotContent) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest completed with counts and checksums, and the snapshot's files (the manifest last)."""
    kv = content.kv
    tensors = {f"k.{layer}": key for layer, key in enumerate(kv.keys)}
    tensors.update({f"v.{layer}": value for layer, value in enumerate(kv.values)})
    files = {
        TOKENS: json.dumps(kv.tokens).encode(),
        TRANSCRIPT: json.dumps(content.transcript, ensure_ascii=False).encode(),
        KV: save_tensors(tensors),
    }
    manifest = {
        **manifest,
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "num_tokens": len(kv.tokens),
        "num_messages": len(content.transcript),
        "files": {name: _file_entry(blob) for name, blob in files.items()},
    }
    files[MANIFEST] = _encode_manifest(manifest)
    return manifest, files


def rewrite_manifest(store: StateStore, area: Area, name: str, manifest: dict[str, Any]) -> None:
    """Replace a snapshot's manifest atomically."""
    store.replace_file(area, name, MANIFEST, _encode_manifest(manifest))


def read_manifest(store: StateStore, area: Area, name: str) -> dict[str, Any]:
    """The manifest of a snapshot, checked for format and schema version."""
    try:
        return decode_manifest(store.read_file(area, name, MANIFEST))
    except OSError as exc:
        raise SnapshotCorruptError(f"snapshot manifest is unreadable: {exc}") from exc


def decode_manifest(data: bytes) -> dict[str, Any]:
    """A manifest from its bytes, checked for format and schema version."""
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise SnapshotCorruptError(f"snapshot manifest is unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise SnapshotCorruptError("not a statelm snapshot (manifest format field missing or wrong)")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise SnapshotCorruptError(
            f"snapshot schema version {manifest.get('schema_version')!r} is not supported (expected {SCHEMA_VERSION})"
        )
    return manifest


def check_fingerprint(manifest: dict[str, Any], fingerprint: ModelFingerprint) -> None:
    """FingerprintMismatchError naming what differs unless the snapshot was made with this model."""
    stored = manifest.get("model", {}).get("fingerprint")
    if not isinstance(stored, dict):
        raise SnapshotCorruptError("snapshot manifest has no model fingerprint")
    differences = fingerprint.differences(stored)
    if differences:
        made_with = manifest.get("model", {}).get("name", "another model")
        raise FingerprintMismatchError(
            f"snapshot was made with {made_with!r} and differs from the served model in: {', '.join(differences)}"
        )


def read_snapshot(
    store: StateStore, area: Area, name: str, fingerprint: ModelFingerprint
) -> tuple[dict[str, Any], SnapshotContent]:
    """Manifest and content of a snapshot, after checking schema, fingerprint, checksums and shapes."""
    manifest = read_manifest(store, area, name)
    check_fingerprint(manifest, fingerprint)
    data = {file: _read_checked(store, area, name, file, manifest) for file in (TOKENS, TRANSCRIPT, KV)}
    return manifest, decode_content(data)


def decode_content(files: dict[str, bytes]) -> SnapshotContent:
    """Transcript and KV from a snapshot's verified tokens, transcript and KV files."""
    transcript = _parse_transcript(files[TRANSCRIPT])
    try:
        tokens = json.loads(files[TOKENS])
        tensors = load_tensors(files[KV])
    except (ValueError, SafetensorError) as exc:
        raise SnapshotCorruptError(f"snapshot content is unreadable: {exc}") from exc
    if not (isinstance(tokens, list) and all(type(token) is int for token in tokens)):
        raise SnapshotCorruptError("tokens.json is not a list of token ids")
    return SnapshotContent(transcript, _kv_from_tensors(tokens, tensors))


def read_transcript(
    store: StateStore, area: Area, name: str, fingerprint: ModelFingerprint
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Manifest and verified transcript of a snapshot, without reading its KV."""
    manifest = read_manifest(store, area, name)
    check_fingerprint(manifest, fingerprint)
    return manifest, _parse_transcript(_read_checked(store, area, name, TRANSCRIPT, manifest))


def _parse_transcript(data: bytes) -> list[dict[str, Any]]:
    try:
        transcript = json.loads(data)
    except ValueError as exc:
        raise SnapshotCorruptError(f"transcript.json is unreadable: {exc}") from exc
    if not (isinstance(transcript, list) and all(isinstance(message, dict) for message in transcript)):
        raise SnapshotCorruptError("transcript.json is not a list of messages")
    return transcript


def _kv_from_tensors(tokens: list[int], tensors: dict[str, torch.Tensor]) -> SessionKVData:
    num_layers = len(tensors) // 2
    names = {f"{kind}.{layer}" for kind in "kv" for layer in range(num_layers)}
    if set(tensors) != names:
        raise SnapshotCorruptError("kv.safetensors does not hold k.<layer> and v.<layer> for every layer")
    keys = [tensors[f"k.{layer}"] for layer in range(num_layers)]
    values = [tensors[f"v.{layer}"] for layer in range(num_layers)]
    if any(tensor.dim() != 3 or tensor.shape[0] != len(tokens) for tensor in keys + values):
        raise SnapshotCorruptError(f"kv.safetensors tensors do not hold {len(tokens)} tokens each")
    return SessionKVData(tokens, keys, values)


def _read_checked(store: StateStore, area: Area, name: str, file: str, manifest: dict[str, Any]) -> bytes:
    """A file of a snapshot, checked against the size and checksum its manifest lists."""
    expected = manifest.get("files", {}).get(file)
    if not isinstance(expected, dict):
        raise SnapshotCorruptError(f"snapshot manifest lists no checksum for {file}")
    try:
        data = store.read_file(area, name, file)
    except OSError as exc:
        raise SnapshotCorruptError(f"cannot read {file}: {exc.strerror}") from exc
    if _file_entry(data) != {"sha256": expected.get("sha256"), "size": expected.get("size")}:
        raise SnapshotCorruptError(f"{file} is corrupt or truncated (checksum mismatch)")
    return data


def _file_entry(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=2, ensure_ascii=False).encode()
