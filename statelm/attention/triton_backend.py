"""GPU attention backend in Triton: paged KV read in place, batch-invariant bit for bit, CUDA-graph capturable.

Invariance design. Every (query row, head) result comes out of one fixed sequence of float operations,
whatever else shares the step, however its prompt was chunked, and whether it is a decode or a prefill row:

- One kernel serves every row. A tile holds up to TILE_ROWS query rows (a few query tokens of one sequence
  times the query heads that share one KV head, so K/V are read once per group) and its configuration (tile
  sizes, warps) follows the model's shapes and dtypes only, never the batch; tl.dot then gives each row a
  result that depends neither on the other rows of the tile nor on the row's place in it.
- Keys are visited in tiles aligned to absolute positions (tile i covers keys [i * BLOCK_N, (i + 1) * BLOCK_N))
  in increasing order with an online softmax. Masking (causal, window, past the context) only sets scores
  to -inf; the rescaling is guarded so that a key tile a row sees nothing of leaves its state exactly as it
  was. A row therefore gets the same bits whichever other rows (and so key tiles) its tile spans.
- The key range is cut into partitions of PARTITION_SIZE absolute positions. Each partition gives a fresh
  (max, sum, acc) per row, and a row's partitions are folded in increasing order by one fixed formula
  (_fold_weights and explicit fma), under which an empty partition is an exact no-op. The fold runs either
  inside the attention kernel (one program walks all of its tile's partitions) or, when the step has too few
  tiles to fill the GPU (long contexts, few sequences), in _combine_kernel over a float32 workspace that the
  attention kernel fills with one program per (tile, KV head, partition): flash-decoding. Both paths do the
  same operations (FP contraction is off, so no mul+add is fused behind the code's back), hence the choice
  may follow the batch.

forward() launches two or three kernels and never synchronises with the host: the grid is sized from host-side
bounds (T, B, max_seq_len) and programs with nothing to do exit at once, so a CUDA graph captured at a bound
serves every smaller batch and length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from statelm.attention.base import AttentionMetadata
from statelm.attention.layer_kv import LayerKV

PARTITION_SIZE = 512  # keys per partition of the key range (a multiple of every key tile size)
TILE_ROWS = 32  # query rows (tokens x query heads of one KV head) per tile
SPLIT_MAX_PROGRAMS = 1024  # split the key range only while the unsplit grid has fewer programs than this
MAX_WORKSPACE_BYTES = 256 << 20  # and only while the partials fit in this much memory
LOG2E = 1.4426950408889634
Q8_GROUP: tl.constexpr = tl.constexpr(32)  # values per q8_0 scale (statelm.attention.kv_format)


@triton.jit
def _quantize_q8_0(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """q8_0 of x [ROWS, BLOCK_D] per 32 values, as statelm.attention.kv_format computes it: (int8 values, scales).

    Both divisions are correctly rounded (div_rn), and (y + 1.5 * 2^23) - 1.5 * 2^23 rounds |y| < 2^22 to the
    nearest integer, ties to even, in float32 arithmetic everywhere.
    """
    groups = tl.reshape(x, (ROWS, BLOCK_D // Q8_GROUP, Q8_GROUP))
    scales = tl.math.div_rn(tl.max(tl.abs(groups), 2), 127.0).to(tl.float16)
    divisor = scales.to(tl.float32)[:, :, None]
    zero = divisor == 0.0
    y = tl.math.div_rn(groups, tl.where(zero, 1.0, divisor))
    rounded = (y + 12582912.0) - 12582912.0
    values = tl.where(zero, 0.0, tl.minimum(tl.maximum(rounded, -127.0), 127.0)).to(tl.int8)
    return tl.reshape(values, (ROWS, BLOCK_D)), scales


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Write token t's K/V [kv_heads, head_dim] into its slot (none for slot -1): rounded to the cache dtype, or
    quantized (q8_0), in the pool's layout (keys [blocks, H, D, S], values [blocks, H, S, D])."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    head = block * num_kv_heads + h
    key_dst = (head * head_dim + d) * BLOCK_SIZE + offset
    value_dst = (head * BLOCK_SIZE + offset) * head_dim + d
    if QUANTIZED:
        groups = head_dim // Q8_GROUP
        g = tl.arange(0, BLOCK_D // Q8_GROUP)[None, :]
        g_mask = (h < num_kv_heads) & (g < groups)
        k_values, k_scales = _quantize_q8_0(k.to(tl.float32), BLOCK_H, BLOCK_D)
        v_values, v_scales = _quantize_q8_0(v.to(tl.float32), BLOCK_H, BLOCK_D)
        tl.store(k_cache_ptr + key_dst, k_values, mask=mask)
        tl.store(v_cache_ptr + value_dst, v_values, mask=mask)
        tl.store(k_scale_ptr + (head * groups + g) * BLOCK_SIZE + offset, k_scales, mask=g_mask)
        tl.store(v_scale_ptr + (head * BLOCK_SIZE + offset) * groups + g, v_scales, mask=g_mask)
    else:
        tl.store(k_cache_ptr + key_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + value_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_ptr, index, num_seqs, BLOCK_Q: tl.constexpr, TILES: tl.constexpr):
    """The last sequence b whose first tile (TILES: query_start[b] // BLOCK_Q + b) or first row is <= index."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid).to(tl.int32)
        if TILES:
            first = first // BLOCK_Q + mid
        if first <= index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _fold_weights(m_run, m):
    """New running max and the exact weights of the running state and of a partial folded into it."""
    m_new = tl.maximum(m_run, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    weight_run = tl.where(m_run == m_new, 1.0, tl.exp2(m_run - m_safe))
    weight = tl.where(m == m_new, 1.0, tl.exp2(m - m_safe))
    return m_new, weight_run, weight


@triton.jit
def _tanh(x):
    """tanh, element by element: below |x| = 0.55 its odd Taylor polynomial to x^15, above it
    (1 - e^(-2|x|)) / (1 + e^(-2|x|)) with the sign of x (as the CPU kernel computes it)."""
    x2 = x * x
    p = -929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = p * x2 * x + x
    t = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    large = (1.0 - t) / (1.0 + t)
    return tl.where(tl.abs(x) < 0.55, small, tl.where(x < 0, -large, large))


@triton.jit
def _partition(
    q,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_ptr,
    kv_head,
    part,
    key_lo,
    key_hi,
    pos,
    row_valid,
    qk_scale,
    softcap,
    window,
    num_kv_heads,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """(max, sum, acc) of the tile's rows over the keys of one partition, in log2 units, by online softmax (scores
    soft-capped, with SOFTCAP, at softcap in log2 units)."""
    start = tl.maximum(part * PARTITION, key_lo) // BLOCK_N * BLOCK_N
    end = tl.minimum((part + 1) * PARTITION, key_hi)
    d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_valid = (keys >= key_lo) & (keys < end)  # read no key that no row of the tile sees
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        head = block * num_kv_heads + kv_head  # the key's block of this head: keys [D, S], values [S, D]
        offset = keys % BLOCK_SIZE
        k_mask = key_valid[None, :] & (d[:, None] < head_dim)
        v_mask = key_valid[:, None] & (d[None, :] < head_dim)
        k_offsets = (head[None, :] * head_dim + d[:, None]) * BLOCK_SIZE + offset[None, :]  # [BLOCK_D, BLOCK_N]
        v_offsets = (head[:, None] * BLOCK_SIZE + offset[:, None]) * head_dim + d[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + k_offsets, mask=k_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_offsets, mask=v_mask, other=0.0)
        if QUANTIZED:  # scale * value: exact in float32
            groups = head_dim // Q8_GROUP
            g = d // Q8_GROUP
            k_scales = tl.load(
                k_scale_ptr + (head[None, :] * groups + g[:, None]) * BLOCK_SIZE + offset[None, :],
                mask=k_mask,
                other=0.0,
            )
            v_scales = tl.load(
                v_scale_ptr + (head[:, None] * BLOCK_SIZE + offset[:, None]) * groups + g[None, :],
                mask=v_mask,
                other=0.0,
            )
            k = k.to(tl.float32) * k_scales.to(tl.float32)
            v = v.to(tl.float32) * v_scales.to(tl.float32)
        s = tl.dot(q, k.to(q.dtype), input_precision="ieee")  # the precision applies to float32 operands only
        visible = row_valid[:, None] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible &= keys[None, :] > pos[:, None] - window
        s = s * qk_scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_safe))
        p = tl.exp2(s - m_safe[:, None])
        den = tl.fma(den, alpha, tl.sum(p, 1))
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision="ieee")
        m = m_new
    return m, den, acc


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    ws_m_ptr,
    ws_den_ptr,
    ws_acc_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    num_seqs,
    qk_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_heads,
    num_kv_heads,
    head_dim,
    num_partitions,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANTIZED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One tile of BLOCK_Q query tokens x GROUP heads over one KV head: all its partitions, or (SPLIT) one."""
    seq = _find_seq(query_start_ptr, tl.program_id(0), num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    tok0 = (tl.program_id(0) - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 >= q_len:
        return
    kv_head = tl.program_id(1)
    ctx_start = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
    key_hi = tl.maximum(ctx_start + tl.minimum(tok0 + BLOCK_Q, q_len), 0)  # past the tile's last visible key
    key_lo = 0
    if HAS_WINDOW:
        key_lo = tl.maximum(ctx_start + tok0 - window + 1, 0)
    part_lo = key_lo // PARTITION
    part_hi = (key_hi + PARTITION - 1) // PARTITION

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    t = (q_start + tok).to(tl.int64)
    pos = ctx_start + tok
    d = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (d[None, :] < head_dim)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    if SPLIT:
        part = tl.program_id(2)
        if (part < part_lo) | (part >= part_hi):
            return
        m, den, acc = _partition(
            q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, part, key_lo, key_hi, pos,
            row_valid, qk_scale, softcap, window, num_kv_heads, head_dim,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE, PARTITION, HAS_WINDOW, QUANTIZED, SOFTCAP,
        )  # fmt: skip
        index = (t * num_partitions + part) * num_heads + head  # workspace [T, partitions, heads(, BLOCK_D)]
        tl.store(ws_m_ptr + index, m, mask=row_valid)
        tl.store(ws_den_ptr + index, den, mask=row_valid)
        tl.store(ws_acc_ptr + index[:, None] * BLOCK_D + d[None, :], acc, mask=row_valid[:, None])
    else:
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for part in range(part_lo, part_hi):
            m, den, acc = _partition(
                q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, part, key_lo, key_hi,
                pos, row_valid, qk_scale, softcap, window, num_kv_heads, head_dim,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE, PARTITION, HAS_WINDOW, QUANTIZED, SOFTCAP,
            )  # fmt: skip
            m_run, weight_run, weight = _fold_weights(m_run, m)
            den_run = tl.fma(den_run, weight_run, den * weight)
            acc_run = tl.fma(acc_run, weight_run[:, None], acc * weight[:, None])
        out = acc_run * (1.0 / tl.where(den_run > 0, den_run, 1.0))[:, None]
        out_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(
    out_ptr,
    ws_m_ptr,
    ws_den_ptr,
    ws_acc_ptr,
    seq_lens_ptr,
    query_start_ptr,
    num_seqs,
    window,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    num_partitions,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Fold query row t's partitions in increasing order, every head at once (as _attention_kernel unsplit)."""
    t = tl.program_id(0)
    if t >= tl.load(query_start_ptr + num_seqs):
        return
    seq = _find_seq(query_start_ptr, t, num_seqs, 1, False)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    pos = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len + t - q_start
    key_hi = tl.maximum(pos + 1, 0)
    key_lo = 0
    if HAS_WINDOW:
        key_lo = tl.maximum(pos - window + 1, 0)
    part_hi = tl.minimum((key_hi + PARTITION - 1) // PARTITION, num_partitions)  # never past the workspace
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_valid = h < num_heads
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den_run = tl.zeros([BLOCK_H], tl.float32)
    acc_run = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for part in range(key_lo // PARTITION, part_hi):
        index = (t.to(tl.int64) * num_partitions + part) * num_heads + h
        m = tl.load(ws_m_ptr + index, mask=h_valid, other=float("-inf"))
        den = tl.load(ws_den_ptr + index, mask=h_valid, other=0.0)
        acc = tl.load(ws_acc_ptr + index[:, None] * BLOCK_D + d[None, :], mask=h_valid[:, None], other=0.0)
        m_run, weight_run, weight = _fold_weights(m_run, m)
        den_run = tl.fma(den_run, weight_run, den * weight)
        acc_run = tl.fma(acc_run, weight_run[:, None], acc * weight[:, None])
    out = acc_run * (1.0 / tl.where(den_run > 0, den_run, 1.0))[:, None]
    out_ptrs = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & (d[None, :] < head_dim))


class TritonAttentionBackend:
    """Paged attention in Triton on CUDA tensors (CPU tensors under TRITON_INTERPRET=1), batch-invariant.

    Reads meta.seq_lens_tensor, meta.query_start_tensor, meta.block_tables, meta.slot_mapping (device tensors)
    and meta.max_seq_len (a host-side bound that every sequence's context length must respect); never the host
    lists.
    Output rows of padding sequences (context 0) are zeros; rows past query_start[B] are left unwritten.
    """

    def __init__(self, sliding_window: int | None = None, softcap: float | None = None) -> None:
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
        self._workspace = torch.empty(0)
        self._retired: list[torch.Tensor] = []  # outgrown workspaces a captured CUDA graph may still point at

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache (rounded or quantized), then attend each query over its context."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k.shape[1], cache.block_size
        k_cache, v_cache = cache.k, cache.v
        quantized = cache.k_scale is not None
        k_scale, v_scale = (cache.k_scale, cache.v_scale) if quantized else (k_cache, v_cache)  # not read unless q8_0
        assert all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale)), "the pool's tensors are dense"
        assert meta.block_tables.stride(1) == 1, "block table rows must be contiguous"
        q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out
        block_d = max(16, triton.next_power_of_2(head_dim))
        _store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            num_kv_heads, head_dim,
            BLOCK_SIZE=block_size, BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d, QUANTIZED=quantized,
        )  # fmt: skip

        group = num_heads // num_kv_heads
        block_q = max(1, TILE_ROWS // group)
        num_seqs = meta.seq_lens_tensor.shape[0]
        num_tiles = num_tokens // block_q + num_seqs  # a bound on the tiles of all sequences together
        num_partitions = triton.cdiv(max(meta.max_seq_len, 1), PARTITION_SIZE)
        partials = num_tokens * num_heads * num_partitions
        split = (
            num_partitions > 1
            and num_tiles * num_kv_heads < SPLIT_MAX_PROGRAMS
            and partials * (block_d + 2) * 4 <= MAX_WORKSPACE_BYTES
        )
        ws_m = ws_den = ws_acc = out  # not read unless split
        if split:
            workspace = self._workspace_for(partials * (block_d + 2), q.device)
            ws_m, ws_den, ws_acc = workspace[:partials], workspace[partials : 2 * partials], workspace[2 * partials :]
        window = self.sliding_window or 0
        dot_f32 = q.dtype == torch.float32 or q.dtype != k_cache.dtype  # else q's 16-bit dtype on tensor cores
        grid = (num_tiles, num_kv_heads, num_partitions if split else 1)
        _attention_kernel[grid](
            q, k_cache, v_cache, k_scale, v_scale, out, ws_m, ws_den, ws_acc,
            meta.block_tables, meta.seq_lens_tensor, meta.query_start_tensor,
            num_seqs, scale * LOG2E, (self.softcap or 1.0) * LOG2E, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            num_heads, num_kv_heads, head_dim, num_partitions,
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
            BLOCK_N=16 if dot_f32 else 32 if block_d > 128 else 64,  # (float32 dots run on FMA units)
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            PARTITION=PARTITION_SIZE,
            HAS_WINDOW=self.sliding_window is not None,
            SPLIT=split,
            DOT_F32=dot_f32,
            QUANTIZED=quantized,
            SOFTCAP=self.softcap is not None,
            num_warps=4 if block_d <= 64 else 8,
            enable_fp_fusion=False,  # no mul+add contracted to fma behind our back: both fold paths stay alike
        )  # fmt: skip
        if split:
            block_h = triton.next_power_of_2(num_heads)
            _combine_kernel[(num_tokens,)](
                out, ws_m, ws_den, ws_acc, meta.seq_lens_tensor, meta.query_start_tensor, num_seqs, window,
                out.stride(0), out.stride(1), num_heads, head_dim, num_partitions,
                BLOCK_H=block_h, BLOCK_D=block_d, PARTITION=PARTITION_SIZE,
                HAS_WINDOW=self.sliding_window is not None,
                num_warps=4 if block_h * block_d <= 4096 else 8,
                enable_fp_fusion=False,
            )  # fmt: skip
        return out

    def _workspace_for(self, numel: int, device: torch.device) -> torch.Tensor:
        """A float32 buffer of at least numel elements; grown buffers are kept, never reallocated per step."""
        if self._workspace.numel() < numel or self._workspace.device != device:
            self._retired.append(self._workspace)
            self._workspace = torch.empty(triton.next_power_of_2(numel), dtype=torch.float32, device=device)
        return self._workspace[:numel]
