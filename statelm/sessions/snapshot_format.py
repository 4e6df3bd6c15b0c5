"""The snapshot format: a bundle of files with a manifest, the token ids, the transcript and the KV.

```
manifest.json     schema version, model fingerprint, KV format (kv_dtype), counts, metadata, sha256 and size of every
                  file
tokens.json       the token ids whose K/V are stored
transcript.json   the conversation's messages
kv.safetensors    k.<layer> and v.<layer>, each [tokens, kv_heads, width]: the pool's rows
                  (statelm.attention.kv_format), [tokens, kv_heads, head_dim] of float32/float16/bfloat16, or q8_0
                  blocks [tokens, kv_heads, head_dim / 32 * 34] of uint8
```

Schema 2 adds `kv_dtype` and q8_0 rows; schema 1 snapshots (float rows, their format named by the fingerprint's
`kv_cache_dtype`, or by its model `dtype` in the oldest) still load into a pool of their format. KV is never converted
from one format to another: a layer's K/V come out of attention over the layers before it as the pool stored them,
so from the second layer on, KV made in one format is not the rounding of another format's, and a converted session
would no longer equal the stateless request. A snapshot of another format is refused (409), naming the setting that
loads it; its transcript alone (a saved session's, at start) is read whatever its KV format.

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

from statelm.engine.client import KVFormat, SessionKVData, format_of_rows, kv_format
from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import FingerprintMismatchError, SnapshotCorruptError, SnapshotQuotaError
from statelm.sessions.state_store import Area, StateStore

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
KV_FORMAT_PART = "kv_cache_dtype"  # the fingerprint part naming the KV format the server's pool keeps
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
        "kv_dtype": kv.kv_format.name if kv.kv_format else None,
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
    if manifest.get("schema_version") not in READABLE_VERSIONS:
        raise SnapshotCorruptError(
            f"snapshot schema version {manifest.get('schema_version')!r} is not supported (expected one of "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    return manifest


def check_fingerprint(manifest: dict[str, Any], fingerprint: ModelFingerprint, kv: bool = True) -> None:
    """FingerprintMismatchError naming what differs unless the snapshot was made with this model and KV format.

    With kv False (the transcript alone is read) the KV format is not checked.
    """
    stored = manifest.get("model", {}).get("fingerprint")
    if not isinstance(stored, dict):
        raise SnapshotCorruptError("snapshot manifest has no model fingerprint")
    differences = fingerprint.differences(stored)
    if KV_FORMAT_PART in differences and (not kv or snapshot_kv_format(manifest).name == _served_kv(fingerprint)):
        differences.remove(KV_FORMAT_PART)  # the transcript alone, or a schema 1 fingerprint without the part
    if differences == [KV_FORMAT_PART]:
        made = snapshot_kv_format(manifest).name
        raise FingerprintMismatchError(
            f"snapshot KV is {made} and this server keeps {_served_kv(fingerprint)} KV; KV is not converted between"
            f" formats (each layer's K/V follow attention over the stored KV of the layers before it, so no conversion"
            f" gives what this server computes): a server started with --kv-cache-dtype {made} loads it"
        )
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
    content = decode_content(data)
    stored = content.kv.kv_format
    if stored is not None and stored != snapshot_kv_format(manifest):
        raise SnapshotCorruptError(f"kv.safetensors holds {stored.name} KV, not the manifest's")
    return manifest, content


def snapshot_kv_format(manifest: dict[str, Any]) -> KVFormat:
    """The format of a snapshot's KV: the manifest's kv_dtype (schema 2), else its fingerprint's (schema 1)."""
    parts = manifest.get("model", {}).get("fingerprint", {})
    name = manifest.get("kv_dtype") or parts.get(KV_FORMAT_PART) or parts.get("dtype")
    try:
        return kv_format(str(name))
    except ValueError as exc:
        raise SnapshotCorruptError(f"snapshot manifest names no KV format statelm knows: {exc}") from None


def _served_kv(fingerprint: ModelFingerprint) -> str | None:
    """The KV format the server keeps (None for a fingerprint without one)."""
    return fingerprint.parts.get(KV_FORMAT_PART)


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
    """Manifest and verified transcript of a snapshot, without reading its KV (whose format is not checked)."""
    manifest = read_manifest(store, area, name)
    check_fingerprint(manifest, fingerprint, kv=False)
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
    try:
        formats = {format_of_rows(tensor) for tensor in keys + values}
    except ValueError as exc:
        raise SnapshotCorruptError(f"kv.safetensors holds KV of no format statelm knows: {exc}") from None
    if len(formats) > 1 or any(tensor.shape[1:] != keys[0].shape[1:] for tensor in keys + values):
        raise SnapshotCorruptError("kv.safetensors tensors differ in dtype or shape")
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
