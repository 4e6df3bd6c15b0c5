"""The start-up self-check that picks the compute path (compute_path.py): a row's result must not depend on how
many rows share its kernel call.

Before serving, the engine probes the loaded model's own linears and its attention backend on the model's
shapes: a few rows computed alone against the same rows inside calls of 2, 7, 16 and 64 rows (and, for
attention, a decode row against the same row inside prefill chunks and beside another sequence), compared
bit for bit. The first compute path that passes serves; the ones that failed are named in one log line and
in `/health`. A CPU or library version whose kernels block by row count therefore costs speed, never
batch-invariant answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from statelm.attention.base import AttentionBackend, AttentionMetadata
from statelm.attention.kv_format import KVFormat, kv_format
from statelm.attention.layer_kv import LayerKV
from statelm.cpu import describe
from statelm.models.compute_path import compute_paths, use_compute_path
from statelm.models.llama import LlamaForCausalLM
from statelm.models.moe import MoEMLP
from statelm.models.variants import VariantForCausalLM

log = logging.getLogger(__name__)

PROBE_BATCHES = (2, 7, 16, 64)
PROBED_ROWS = (0, 1, 6, 15, 63)  # rows checked inside every batch that holds them
ATTENTION_CONTEXT = 70  # tokens of the probe's paged context: crosses block boundaries and KEY_PAD
PROBED_POSITIONS = (0, 5, 17, 63, 69)


@dataclass
class InvarianceReport:
    """Which compute path serves, whether it passed the probe, and why the paths before it were rejected."""

    path: str
    verified: bool
    cpu: str
    rejected: dict[str, list[str]] = field(default_factory=dict)
    probe_ms: float = 0.0

    def summary(self) -> str:
        """One log line."""
        state = "batch-invariant (verified)" if self.verified else "NOT batch-invariant: no path passed"
        line = f"compute path {self.path!r}: {state} on {self.cpu}, probe {self.probe_ms:.0f} ms"
        for path, failures in self.rejected.items():
            more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
            line += f"; rejected {path!r}: {failures[0]}{more}"
        return line

    def as_dict(self) -> dict[str, object]:
        """The report as `/health` shows it."""
        return {"path": self.path, "verified": self.verified, "cpu": self.cpu, "rejected": self.rejected}


def select_compute_path(model: LlamaForCausalLM, forced: str = "auto", kv: KVFormat | None = None) -> InvarianceReport:
    """Probe the model's compute paths fastest first and keep the first that is batch-invariant.

    forced: a path name to use whatever its probe says (the probe still runs and is reported), or `auto`.
    kv: the KV cache's format the attention is probed with (default: the model's dtype).
    """
    started = time.perf_counter()
    rejected: dict[str, list[str]] = {}
    paths = compute_paths(model)
    if forced != "auto":
        if forced not in paths:
            raise ValueError(f"compute path {forced!r} is not available here; choose from auto, {', '.join(paths)}")
        paths = [forced]
    log.info("self-check: probing the compute paths %s for batch invariance", ", ".join(paths))
    failures: list[str] = []
    for path in paths:
        try:
            use_compute_path(model, path)
            failures = probe_model(model, kv)
        except Exception as exc:  # a path that cannot even run its probe is rejected like one that fails it
            failures = [f"probe raised {type(exc).__name__}: {exc}"]
        if not failures:
            break
        rejected[path] = failures
    report = InvarianceReport(
        path=model.compute_path,
        verified=not failures,
        cpu=describe(),
        rejected=rejected,
        probe_ms=(time.perf_counter() - started) * 1000,
    )
    (log.info if report.verified and not rejected else log.warning)(report.summary())
    return report


def probe_model(model: LlamaForCausalLM, kv: KVFormat | None = None) -> list[str]:
    """Failures of the model's current path: its first layer's linears, the LM head and attention (over kv)."""
    generator = torch.Generator().manual_seed(0)
    failures: list[str] = []
    layer = model.layers[0]
    mlp = layer.mlp.experts[0] if isinstance(layer.mlp, MoEMLP) else layer.mlp  # an expert's linears are the MLP's
    linears: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
        "qkv_proj": (layer.self_attn.qkv_proj, layer.self_attn.qkv_proj.in_features),
        "o_proj": (layer.self_attn.o_proj, layer.self_attn.o_proj.in_features),
        "gate_up_proj": (mlp.gate_up_proj, mlp.gate_up_proj.in_features),
        "down_proj": (mlp.down_proj, mlp.down_proj.in_features),
    }
    device = model.device
    with torch.inference_mode():
        for kind in ("generated", "prompt"):
            for name, (linear, in_features) in linears.items():
                x = torch.randn(max(PROBE_BATCHES), in_features, generator=generator).to(device, model.dtype)
                rows = lambda count, kind=kind: model.chunking.set_rows(  # noqa: E731
                    torch.full((count,), kind == "prompt", device=device)
                )
                failures += [f"{name} ({kind} rows): {f}" for f in probe_rows(linear, x, rows)]
        model.chunking.set_rows(None)  # logits are computed for sampling rows only, all of one kind
        x = torch.randn(max(PROBE_BATCHES), model.config.hidden_size, generator=generator).to(device, model.dtype)
        failures += [f"lm_head: {f}" for f in probe_rows(model.compute_logits, x)]
        attention = model.layers[0].self_attn
        shape = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
        for name, backend in attention_backends(model).items():
            failures += [f"{name}: {f}" for f in probe_attention(backend, *shape, model.dtype, device, kv)]
    return failures


def attention_backends(model: LlamaForCausalLM) -> dict[str, AttentionBackend]:
    """The model's attention backends by name: one, or (a variant with sliding layers) one per kind of layer."""
    backends = {"attention": model.backend}
    if isinstance(model, VariantForCausalLM) and model.local_backend is not model.backend:
        backends["sliding attention"] = model.local_backend
    return backends


def probe_rows(
    function: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    before_call: Callable[[int], None] = lambda _: None,
) -> list[str]:
    """Rows of x through function alone versus inside calls of PROBE_BATCHES rows; before_call(rows) runs first."""
    alone = {}
    for row in PROBED_ROWS:
        before_call(1)
        alone[row] = function(x[row : row + 1])[0]
    failures = []
    for count in PROBE_BATCHES:
        before_call(count)
        out = function(x[:count])
        differ = [r for r in PROBED_ROWS if r < count and not _same(out[r], alone[r])]
        failures += [f"row {r} differs inside {count} rows" for r in differ]
    return failures


def probe_attention(
    backend: AttentionBackend,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv: KVFormat | None = None,
    block_size: int = 16,
) -> list[str]:
    """Decode rows alone versus the same rows inside a whole prefill, prefill chunks and a two-sequence step.

    kv: the KV cache's format (default: dtype's).
    """
    generator = torch.Generator().manual_seed(1)
    length = ATTENTION_CONTEXT
    num_blocks = 2 * (-(-length // block_size)) + 1
    q, k, v = (
        torch.randn(length, h, head_dim, generator=generator).to(device, dtype) for h in (heads, kv_heads, kv_heads)
    )
    table = torch.arange(1, num_blocks, device=device).view(2, -1)  # two sequences' blocks; block 0 stays unused

    def run(calls: list[tuple[int, int]]) -> torch.Tensor:
        """One step over sequences given as (first, last) query positions, each over its own copy of the context."""
        cache = LayerKV.allocate(num_blocks, block_size, kv_heads, head_dim, kv or kv_format(dtype), device)
        slots, rows = [], []
        for seq, (first, last) in enumerate(calls):
            seq_slots = [int(table[seq, p // block_size]) * block_size + p % block_size for p in range(last)]
            cache.store(k[:first], v[:first], torch.tensor(seq_slots[:first], dtype=torch.int64, device=device))
            slots += seq_slots[first:]
            rows += range(first, last)
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        query_lens = [last - first for first, last in calls]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=table[: len(calls)],
            query_lens=query_lens,
            seq_lens=[last for _, last in calls],
            query_start=[sum(query_lens[:i]) for i in range(len(calls) + 1)],
        )
        return backend.forward(q[row_index], k[row_index], v[row_index], cache, meta, head_dim**-0.5)

    alone = {p: run([(p, p + 1)])[0] for p in PROBED_POSITIONS}
    failures = []
    prefill = run([(0, length)])
    differ = [p for p in alone if not _same(prefill[p], alone[p])]
    failures += [f"decode row {p} differs inside a {length}-row prefill" for p in differ]
    for count in PROBE_BATCHES:
        for p in PROBED_POSITIONS:
            first = max(0, p + 1 - count)
            out = run([(first, p + 1)])
            if not _same(out[-1], alone[p]):
                failures.append(f"decode row {p} differs as the last of a {p + 1 - first}-row chunk")
    for p in PROBED_POSITIONS:
        beside = run([(p, p + 1), (length - 7, length)])
        if not _same(beside[0], alone[p]):
            failures.append(f"decode row {p} differs beside another sequence's prefill")
    return failures


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))
