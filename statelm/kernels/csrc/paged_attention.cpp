// Paged attention over the KV block pool, read in place, batch-invariant by construction, and the store of a
// step's K/V into the pool.
//
// torch.ops.statelm.paged_attention(q [T, H, D], k_cache, v_cache, block_tables [B, W] int32/int64, seq_lens [B],
//     query_start [B + 1], scale, sliding_window, k_scale, v_scale, softcap) -> [T, H, D]
// torch.ops.statelm.kv_store(k [T, KVH, D], v, k_cache, v_cache, k_scale, v_scale, slot_mapping [T])
//
// The pool's layout (statelm/engine/kv_cache.py), per block of S tokens: keys [blocks, KVH, D, S], transposed so
// that one head's S keys of each dimension are contiguous (the score products read them as they lie, no
// transpose), values [blocks, KVH, S, D]. The caches are float32, bfloat16, float16 (widened to float32 as they
// are read) or int8 with float16 scales per 32 values of a token's head (q8_0: key scales [blocks, KVH, D/32, S],
// value scales [blocks, KVH, S, D/32]), read as scale * value, which float32 holds exactly. q and the output are
// float32, bfloat16 or float16 (the output has q's dtype).
//
// Query rows of sequence b are tokens query_start[b]..query_start[b + 1] - 1, the last positions of its
// context of seq_lens[b] tokens; a row at position p sees keys 0..p (only keys > p - window with a window).
// With a softcap c > 0 (Gemma 2) each score s becomes c * tanh(s / c) before the softmax.
//
// Every (row, head) result comes out of one fixed sequence of float operations, whatever else is in the
// call: keys are visited in position order in chunks of kChunk keys aligned to absolute positions, with an
// online softmax per chunk; a score is an FMA chain over d in order, a value accumulator an FMA chain over
// the keys in order, and the softmax denominator is kept as kChunk lane-wise partial sums added up in a fixed
// tree at the end. The keys are cut into partitions of kPartition positions (aligned too): each gives a fresh
// (max, partial sums, accumulator) per row, folded into the row's running state partition by partition, in
// increasing order, by one formula under which a partition the row sees nothing of is an exact no-op. Vector lanes
// only ever hold independent elements, so it does not matter which lanes or register blocks a row's work lands in.
// Threads split the work over (sequence, KV head, query heads, query rows), and, when that leaves threads idle (a
// few long decodes), over partitions: each partition's state is then kept apart and folded, in the same order by the
// same formula, once all are done, so a row's bits do not depend on the split. Rows that see a whole chunk are processed together (one load of each K/V row
// for all of them); a row that sees part of a chunk (the diagonal, a window's start) is processed alone,
// over exactly its own keys.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"

namespace {

constexpr int kChunk = 32;  // keys per online-softmax step, aligned to multiples of kChunk in position
constexpr int64_t kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kGroup = 32;  // values per q8_0 scale

// ---------------------------------------------------------------------------------------------------------
// Vector primitives. Every operation is lane-wise except the horizontal max (exact in any order) and the
// horizontal sum (one fixed tree per build).

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
constexpr int kMaxRowBlock = 8;
constexpr int kAccumulators = 24;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vabs(Vec x) { return _mm512_abs_ps(x); }
inline Vec vcopysign(Vec magnitude, Vec sign) {
  return _mm512_or_ps(magnitude, _mm512_and_ps(_mm512_set1_ps(-0.0f), sign));
}
inline Vec vselect_below(Vec x, float limit, Vec below, Vec otherwise) {  // lane by lane: x < limit ? below : ...
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_LT_OQ), otherwise, below);
}
inline float hmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline float hsum(Vec v) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
inline Vec vexp(Vec x) {
  const Vec lowest = vset(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  Vec p = vset(1.0f / 5040.0f);
  p = vfma(p, r, vset(1.0f / 720.0f));
  p = vfma(p, r, vset(1.0f / 120.0f));
  p = vfma(p, r, vset(1.0f / 24.0f));
  p = vfma(p, r, vset(1.0f / 6.0f));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
constexpr int kMaxRowBlock = 6;
constexpr int kAccumulators = 12;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vabs(Vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline Vec vcopysign(Vec magnitude, Vec sign) {
  return _mm256_or_ps(magnitude, _mm256_and_ps(_mm256_set1_ps(-0.0f), sign));
}
inline Vec vselect_below(Vec x, float limit, Vec below, Vec otherwise) {
  return _mm256_blendv_ps(otherwise, below, _mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_LT_OQ));
}
inline float hmax(Vec v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}
inline float hsum(Vec v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
// e^x for x <= 88: Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-7 Taylor polynomial, exact 0 below -87.
inline Vec vexp(Vec x) {
  const Vec lowest = vset(-87.0f);
  const Vec underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, vset(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  Vec p = vset(1.0f / 5040.0f);
  p = vfma(p, r, vset(1.0f / 720.0f));
  p = vfma(p, r, vset(1.0f / 120.0f));
  p = vfma(p, r, vset(1.0f / 24.0f));
  p = vfma(p, r, vset(1.0f / 6.0f));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#else
constexpr int kLanes = 1;
constexpr int kRegisters = 16;
constexpr int kMaxRowBlock = 4;
constexpr int kAccumulators = 8;
using Vec = float;
inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vset(float x) { return x; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vsub(Vec a, Vec b) { return a - b; }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
inline Vec vabs(Vec x) { return std::fabs(x); }
inline Vec vcopysign(Vec magnitude, Vec sign) { return std::copysign(magnitude, sign); }
inline Vec vselect_below(Vec x, float limit, Vec below, Vec otherwise) { return x < limit ? below : otherwise; }
inline float hmax(Vec v) { return v; }
inline float hsum(Vec v) { return v; }
inline Vec vexp(Vec x) { return std::exp(x); }
#endif

constexpr int kChunkVecs = kChunk / kLanes;
static_assert(kChunk % kLanes == 0 && kGroup % kLanes == 0, "a chunk is whole vectors, a q8_0 group too");

// tanh, lane by lane: below |x| = 0.55 its odd Taylor polynomial to x^15 (the next term is under 4e-8 of x there),
// above it (1 - e^(-2|x|)) / (1 + e^(-2|x|)) with the sign of x (no cancellation: e^(-2|x|) < 1/3).
inline Vec vtanh(Vec x) {
  const Vec x2 = vmul(x, x);
  Vec p = vset(-929569.0f / 638512875.0f);
  p = vfma(p, x2, vset(21844.0f / 6081075.0f));
  p = vfma(p, x2, vset(-1382.0f / 155925.0f));
  p = vfma(p, x2, vset(62.0f / 2835.0f));
  p = vfma(p, x2, vset(-17.0f / 315.0f));
  p = vfma(p, x2, vset(2.0f / 15.0f));
  p = vfma(p, x2, vset(-1.0f / 3.0f));
  const Vec small = vfma(vmul(p, x2), x, x);
  const Vec magnitude = vabs(x);
  const Vec t = vexp(vmul(magnitude, vset(-2.0f)));
  const Vec large = vcopysign(vdiv(vsub(vset(1.0f), t), vadd(vset(1.0f), t)), x);
  return vselect_below(magnitude, 0.55f, small, large);
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// One vector of consecutive elements widened to float32 (read in place from a narrower cache).
inline Vec vload_widened(const float* p) { return vload(p); }
#if defined(__AVX512F__)
inline Vec vload_widened(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vload_widened(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec vload_widened(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec vload_widened(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float x[8];
  for (int i = 0; i < 8; ++i) x[i] = to_float(p[i]);
  return _mm256_load_ps(x);
#endif
}
inline Vec vload_widened(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec vload_widened(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
inline Vec vload_widened(const at::Half* p) { return to_float(*p); }
inline Vec vload_widened(const at::BFloat16* p) { return to_float(*p); }
inline Vec vload_widened(const int8_t* p) { return to_float(*p); }
#endif

// The cache's element types: float formats widen as they load; int8 (q8_0) carries float16 scales.
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t>;

// ---------------------------------------------------------------------------------------------------------
// B operands of the products: element (k, j) of a [depth][cols] matrix, loaded kLanes columns at a time as
// float32 (widened, or scale * value for q8_0).

// A row pointer per k, its columns contiguous: the values of the chunk's keys (k = key, j = dimension), or
// keys gathered into scratch (k = dimension, j = key). scales: per row, the float32 scale of each 32 columns.
template <typename T>
struct Rows {
  const T* const* rows;
  const float* scales = nullptr;  // q8_0: [k][cols / 32]
  int64_t groups = 0;

  Vec load(int64_t k, int64_t col) const {
    const Vec x = vload_widened(rows[k] + col);
    if constexpr (kQuantized<T>) return vmul(x, vset(scales[k * groups + col / kGroup]));
    return x;
  }
  Rows from(int64_t k) const { return {rows + k, scales ? scales + k * groups : nullptr, groups}; }
};

// The chunk's keys in place in the transposed blocks (k = dimension, j = key): vector v of the chunk's columns
// starts at columns[v], and dimension d of it lies d * stride elements further (stride = block size); q8_0 scales
// likewise, one row per 32 dimensions.
template <typename T>
struct KeyColumns {
  const T* columns[kChunkVecs];
  const at::Half* scales[kChunkVecs];
  int64_t stride;

  Vec load(int64_t d, int64_t col) const {
    const int64_t v = col / kLanes;
    const Vec x = vload_widened(columns[v] + d * stride);
    if constexpr (kQuantized<T>) return vmul(x, vload_widened(scales[v] + d / kGroup * stride));
    return x;
  }
};

// ---------------------------------------------------------------------------------------------------------
// C[i][j] = (accumulate ? C[i][j] : 0) + sum over k in order of A[i][k] * B[k][j]: one FMA chain per element,
// so register blocking never changes a result. A is row-major (lda), B an operand above (b.load(k, j) gives
// kLanes float32 columns from j), C row-major (ldc).

template <int MR, int NV, typename B>
inline void gemm_block(const float* a, int64_t lda, const B& b, int64_t col, int64_t depth, float* c,
                       int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? vload(c + i * ldc + col + j * kLanes) : vset(0.0f);
  }
  for (int64_t k = 0; k < depth; ++k) {
    if constexpr (NV + 1 + MR * NV <= kRegisters) {  // hold the B vectors, broadcast A one row at a time
      Vec bv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) bv[j] = b.load(k, col + j * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const Vec av = vset(a[i * lda + k]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[i][j] = vfma(av, bv[j], acc[i][j]);
      }
    } else {  // hold the A broadcasts, load B one vector at a time
      Vec av[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) av[i] = vset(a[i * lda + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const Vec bv = b.load(k, col + j * kLanes);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[i][j] = vfma(av[i], bv, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vstore(c + i * ldc + col + j * kLanes, acc[i][j]);
  }
}

// The last `vecs` (< NV + 1) column vectors of a row block in one register block.
template <int MR, int NV, typename B>
void gemm_tail(int64_t vecs, const float* a, int64_t lda, const B& b, int64_t col, int64_t depth, float* c,
               int64_t ldc, bool accumulate) {
  if constexpr (NV > 1) {
    if (vecs < NV) return gemm_tail<MR, NV - 1>(vecs, a, lda, b, col, depth, c, ldc, accumulate);
  }
  gemm_block<MR, NV>(a, lda, b, col, depth, c, ldc, accumulate);
}

template <int MR, typename B>
void gemm_rows(const float* a, int64_t lda, const B& b, int64_t cols, int64_t depth, float* c,
               int64_t ldc, bool accumulate) {
  constexpr int kWide = std::min(4, std::max(1, kAccumulators / MR));
  int64_t col = 0;
  for (; col + kWide * kLanes <= cols; col += kWide * kLanes) {
    gemm_block<MR, kWide>(a, lda, b, col, depth, c, ldc, accumulate);
  }
  if constexpr (kWide > 1) {
    if (col < cols) gemm_tail<MR, kWide - 1>((cols - col) / kLanes, a, lda, b, col, depth, c, ldc, accumulate);
  }
}

// Dispatches a block of at most MR rows to the kernel for exactly that many rows.
template <int MR, typename B>
void gemm_dispatch(int64_t rows, const float* a, int64_t lda, const B& b, int64_t cols, int64_t depth,
                   float* c, int64_t ldc, bool accumulate) {
  if constexpr (MR > 1) {
    if (rows < MR) return gemm_dispatch<MR - 1>(rows, a, lda, b, cols, depth, c, ldc, accumulate);
  }
  gemm_rows<MR>(a, lda, b, cols, depth, c, ldc, accumulate);
}

// cols is a multiple of kLanes.
template <typename B>
void gemm(int64_t rows, const float* a, int64_t lda, const B& b, int64_t cols, int64_t depth, float* c,
          int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < rows; i += kMaxRowBlock) {
    gemm_dispatch<kMaxRowBlock>(std::min<int64_t>(kMaxRowBlock, rows - i), a + i * lda, lda, b, cols, depth,
                                c + i * ldc, ldc, accumulate);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The attention itself.

constexpr int64_t kTileQueries = 48;  // query vectors (rows x heads) per KV head an item aims for: shared K/V loads
constexpr int64_t kPartition = 512;   // keys per partition, a multiple of kChunk
constexpr int64_t kSplitBelow = 2;    // split items over partitions when there are fewer than this many per thread
constexpr int64_t kSerialCost = 2048;  // below this many head-key visits a call stays on the calling thread
constexpr int64_t kMaxGroups = kMaxHeadDim / kGroup;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread buffers, grown on demand and kept across calls.
struct Scratch {
  std::vector<float> storage;
  float* queries = nullptr;  // [m][padded] scaled query vectors, m = (kv * rows + row) * heads + head
  float* acc = nullptr;      // [m][padded] unnormalised outputs
  float* scores = nullptr;   // [m][kChunk] scores, then probabilities
  float* sums = nullptr;     // [m][kChunk] lane-wise partial softmax denominators
  float* maxes = nullptr;    // [m] running maxima
  float* keys = nullptr;     // [dim][kChunk] the chunk's keys, when they cannot be read in place
  float* values = nullptr;   // [kChunk][padded] the chunk's values widened to float32 (when not read in place)
  float* scales = nullptr;   // [kChunk][kMaxGroups] the chunk's value scales (q8_0)
  float* run_acc = nullptr;  // [m][padded] the running state over the partitions folded so far
  float* run_sums = nullptr;  // [m][kChunk]
  float* run_maxes = nullptr;  // [m]

  void reserve(int64_t m, int64_t padded, int64_t dim) {
    const int64_t sizes[] = {m * padded, m * padded, m * kChunk, m * kChunk, m, dim * kChunk,
                             kChunk * padded, kChunk * kMaxGroups, m * padded, m * kChunk, m};
    int64_t total = 16;
    for (int64_t size : sizes) total += round_up(size, 16);
    if (static_cast<int64_t>(storage.size()) < total) storage.assign(total, 0.0f);
    const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    float* p = storage.data() + (round_up(base, 64) - base) / sizeof(float);
    float** slots[] = {&queries, &acc, &scores, &sums, &maxes, &keys, &values, &scales, &run_acc, &run_sums,
                       &run_maxes};
    for (int i = 0; i < 11; ++i) {
      *slots[i] = p;
      p += round_up(sizes[i], 16);
    }
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Block table rows in either index dtype.
struct Tables {
  const int32_t* narrow = nullptr;
  const int64_t* wide = nullptr;
  int64_t width = 0;
  int64_t at(int64_t seq, int64_t i) const { return narrow ? narrow[seq * width + i] : wide[seq * width + i]; }
};

// Where one token's K and V of one KV head lie in the pool (element offsets, see the layout at the top).
struct Layout {
  int64_t kv_heads, dim, groups, block_size;

  int64_t key(int64_t block, int64_t head, int64_t offset) const {  // dimension 0; dimension d is d * S further
    return (block * kv_heads + head) * dim * block_size + offset;
  }
  int64_t key_scale(int64_t block, int64_t head, int64_t offset) const {  // group 0; group g is g * S further
    return (block * kv_heads + head) * groups * block_size + offset;
  }
  int64_t value(int64_t block, int64_t head, int64_t offset) const {
    return ((block * kv_heads + head) * block_size + offset) * dim;
  }
  int64_t value_scale(int64_t block, int64_t head, int64_t offset) const {
    return ((block * kv_heads + head) * block_size + offset) * groups;
  }
};

struct Problem {
  const char* q;  // [T, H, D] with q_row / q_head element strides
  int64_t q_row, q_head;
  at::ScalarType q_type;
  char* out;  // [T, H, D] contiguous, q_type
  const void* k_cache;
  const void* v_cache;
  const at::Half* k_scale;  // q8_0 only
  const at::Half* v_scale;
  Layout layout;
  Tables tables;
  const int64_t* seq_lens;
  const int64_t* query_start;
  int64_t heads, kv_heads, group, dim, padded, block_size, window;
  float scale;
  float softcap;  // > 0: scores soft-capped (Gemma 2)
};

// One unit of work: some query rows of one sequence, for some KV heads and some of the query heads of each.
struct Item {
  int64_t seq, kv_head0, kv_heads, head0, heads, row0, rows;
  double cost;
  int64_t part = -1;           // >= 0: only this partition, its state written to partials (a split item)
  float* partials = nullptr;   // [max, sums, accumulator] of every query vector (see partial_floats)
};

// Floats of one partition's state of an item's query vectors: a max, kChunk partial sums and the accumulator each.
int64_t partial_floats(const Problem& pb, const Item& it) {
  return it.kv_heads * it.rows * it.heads * (1 + kChunk + pb.padded);
}

// The key positions an item's rows read, [first, last), and the first query row's position.
struct KeyRange {
  int64_t first, last, first_pos;
};

KeyRange key_range(const Problem& pb, const Item& it) {
  const int64_t qlen = pb.query_start[it.seq + 1] - pb.query_start[it.seq];
  const int64_t first_pos = pb.seq_lens[it.seq] - qlen + it.row0;
  const int64_t first = pb.window > 0 ? std::max<int64_t>(0, first_pos - pb.window + 1) : 0;
  return {first, first_pos + it.rows, first_pos};
}

// Query row of pb.q, widened and scaled, zero-padded to pb.padded.
template <typename Q>
void load_query(const Problem& pb, int64_t offset, float* dst) {
  const Q* src = reinterpret_cast<const Q*>(pb.q) + offset;
  for (int64_t d = 0; d < pb.dim; ++d) dst[d] = to_float(src[d]) * pb.scale;
  for (int64_t d = pb.dim; d < pb.padded; ++d) dst[d] = 0.0f;
}

// out row = acc / (fixed-tree sum of the partial denominators), converted to the output dtype.
void store_output(const Problem& pb, const float* acc, const float* sums, float* tmp, int64_t token, int64_t head) {
  Vec total = vload(sums);
  for (int v = 1; v < kChunkVecs; ++v) total = vadd(total, vload(sums + v * kLanes));
  const Vec denominator = vset(hsum(total));
  for (int64_t d = 0; d < pb.padded; d += kLanes) vstore(tmp + d, vdiv(vload(acc + d), denominator));
  const int64_t offset = (token * pb.heads + head) * pb.dim;
  switch (pb.q_type) {
    case at::kBFloat16: {
      auto* dst = reinterpret_cast<at::BFloat16*>(pb.out) + offset;
      for (int64_t d = 0; d < pb.dim; ++d) dst[d] = at::BFloat16(tmp[d]);
      break;
    }
    case at::kHalf: {
      auto* dst = reinterpret_cast<at::Half*>(pb.out) + offset;
      for (int64_t d = 0; d < pb.dim; ++d) dst[d] = at::Half(tmp[d]);
      break;
    }
    default: std::memcpy(reinterpret_cast<float*>(pb.out) + offset, tmp, pb.dim * sizeof(float)); break;
  }
}

// The cache lines of the next chunk's K/V for one KV head, requested in two batches around this chunk's products so
// that they arrive while it computes (the blocks of a sequence lie anywhere in the pool: no hardware prefetcher
// follows a block table). A span is `count` runs of `bytes` bytes, `stride` bytes apart. The lines are asked into
// L2 (as the matmuls' Ahead asks): asked into L1, a batch of them filled its few outstanding misses and the thread
// stalled on the prefetches themselves (a 1B model's 16 layers at 3,000 keys of float16 KV from memory: 340 us a
// layer against 650, decodes of 16 sequences at 2,048 keys 1.7x faster).
struct Prefetcher {
  static constexpr int kMaxSpans = 4 * (kChunk + 1);
  struct Span {
    const char* start;
    int64_t bytes, stride, count;
  };
  Span spans[kMaxSpans];
  int num_spans = 0, span = 0;
  int64_t run = 0, line = 0;  // the run of the current span and the line in it to request next

  void add(const void* start, int64_t bytes, int64_t stride = 0, int64_t count = 1) {
    if (bytes == stride) bytes *= std::exchange(count, 1);  // contiguous runs: one
    if (num_spans < kMaxSpans && bytes > 0) spans[num_spans++] = {static_cast<const char*>(start), bytes, stride, count};
  }

  int64_t lines() const {
    int64_t total = 0;
    for (int i = 0; i < num_spans; ++i) total += spans[i].count * ((spans[i].bytes + 127) / 64);
    return total;
  }

  void issue(int64_t n) {
    while (n > 0 && span < num_spans) {
      const Span& sp = spans[span];
      const auto first = reinterpret_cast<std::uintptr_t>(sp.start + run * sp.stride) / 64 * 64;
      const auto last = reinterpret_cast<std::uintptr_t>(sp.start + run * sp.stride + sp.bytes - 1) / 64 * 64;
      for (; n > 0 && first + 64 * line <= last; --n, ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(first + 64 * line), _MM_HINT_T1);
      }
      if (first + 64 * line > last) {
        line = 0;
        if (++run == sp.count) {
          run = 0;
          ++span;
        }
      }
    }
  }
};

// Requests for the keys at positions [begin, end) of one KV head: key columns, values and their scales.
template <typename T>
void plan_prefetch(const Problem& pb, int64_t seq, int64_t head, int64_t begin, int64_t end, Prefetcher& prefetcher) {
  const Layout& layout = pb.layout;
  const int64_t size = layout.block_size, sz = sizeof(T);
  const T* k_cache = static_cast<const T*>(pb.k_cache);
  const T* v_cache = static_cast<const T*>(pb.v_cache);
  for (int64_t pos = begin; pos < end;) {
    const int64_t block = pb.tables.at(seq, pos / size), first = pos % size;
    const int64_t last = std::min(size, first + (end - pos));  // past the last key wanted in this block
    const int64_t keys = last - first;
    prefetcher.add(k_cache + layout.key(block, head, first), keys * sz, size * sz, layout.dim);
    prefetcher.add(v_cache + layout.value(block, head, first), keys * layout.dim * sz);
    if constexpr (kQuantized<T>) {
      prefetcher.add(pb.k_scale + layout.key_scale(block, head, first), keys * 2, size * 2, layout.groups);
      prefetcher.add(pb.v_scale + layout.value_scale(block, head, first), keys * layout.groups * 2);
    }
    pos += keys;
  }
}

// One online-softmax step of query vectors [m0, m0 + count) over the chunk's keys [lo, hi) (chunk offsets).
// The rest of prefetcher's requests go out between its score and value products.
template <typename KB, typename VB>
void softmax_step(Scratch& s, const Problem& pb, const KB& keys, const VB& values, int64_t m0, int64_t count,
                  int lo, int hi, Prefetcher& prefetcher) {
  float* scores = s.scores + m0 * kChunk;
  gemm(count, s.queries + m0 * pb.padded, pb.padded, keys, kChunk, pb.dim, scores, kChunk, false);
  prefetcher.issue(std::numeric_limits<int64_t>::max());
  const Vec cap = vset(pb.softcap), inverse = vset(pb.softcap > 0.0f ? 1.0f / pb.softcap : 0.0f);
  for (int64_t m = 0; m < count; ++m) {
    float* row = scores + m * kChunk;
    if (pb.softcap > 0.0f) {
      for (int v = 0; v < kChunkVecs; ++v) {
        vstore(row + v * kLanes, vmul(cap, vtanh(vmul(vload(row + v * kLanes), inverse))));
      }
    }
    for (int j = 0; j < lo; ++j) row[j] = kNegInf;
    for (int j = hi; j < kChunk; ++j) row[j] = kNegInf;
    Vec top = vload(row);
    for (int v = 1; v < kChunkVecs; ++v) top = vmax(top, vload(row + v * kLanes));
    const float old_max = s.maxes[m0 + m];
    const float new_max = std::max(old_max, hmax(top));
    const bool rescale = new_max > old_max;
    const Vec alpha = rescale ? vexp(vset(old_max - new_max)) : vset(1.0f);
    const Vec shift = vset(new_max);
    float* sums = s.sums + (m0 + m) * kChunk;
    for (int v = 0; v < kChunkVecs; ++v) {
      const Vec p = vexp(vsub(vload(row + v * kLanes), shift));
      vstore(row + v * kLanes, p);
      vstore(sums + v * kLanes, vfma(vload(sums + v * kLanes), alpha, p));
    }
    if (rescale) {
      float* acc = s.acc + (m0 + m) * pb.padded;
      for (int64_t d = 0; d < pb.padded; d += kLanes) vstore(acc + d, vmul(vload(acc + d), alpha));
    }
    s.maxes[m0 + m] = new_max;
  }
  gemm(count, scores + lo, kChunk, values.from(lo), pb.padded, hi - lo, s.acc + m0 * pb.padded, pb.padded, true);
}

// out[0..dim) = float(row[0..dim)), zeros up to padded.
template <typename T>
void widen_row(const T* row, int64_t dim, int64_t padded, float* out) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) vstore(out + d, vload_widened(row + d));
  for (; d < dim; ++d) out[d] = to_float(row[d]);
  for (; d < padded; ++d) out[d] = 0.0f;
}

// The chunk's keys [lo, hi) of one head as float32 rows s.keys[d][j] (zero outside): for a block size that does
// not hold whole vectors, where they cannot be read in place. The same values KeyColumns loads.
template <typename T>
void gather_keys(const Problem& pb, const int64_t* blocks, const int64_t* offsets, int64_t head, int lo, int hi,
                 float* keys) {
  const Layout& layout = pb.layout;
  const T* k_cache = static_cast<const T*>(pb.k_cache);
  std::fill(keys, keys + pb.dim * kChunk, 0.0f);
  for (int j = lo; j < hi; ++j) {
    const int64_t block = blocks[j], offset = offsets[j];
    const T* src = k_cache + layout.key(block, head, offset);
    for (int64_t d = 0; d < pb.dim; ++d) {
      float x = to_float(src[d * layout.block_size]);
      if constexpr (kQuantized<T>) x *= to_float(pb.k_scale[layout.key_scale(block, head, offset) + d / kGroup * layout.block_size]);
      keys[d * kChunk + j] = x;
    }
  }
}

// Fold a partition's state (max, sums, acc) into the running state of `count` query vectors, in a fixed formula:
// each side weighted by e^(its max - the new max), exactly 1 for the side holding the new max, so that an empty
// partition (max -inf, sums and acc 0) leaves the running state as it was, bit for bit.
void fold(int64_t count, int64_t padded, float* run_maxes, float* run_sums, float* run_acc, const float* maxes,
          const float* sums, const float* acc) {
  for (int64_t m = 0; m < count; ++m) {
    const float new_max = std::max(run_maxes[m], maxes[m]);
    const Vec run_weight = run_maxes[m] == new_max ? vset(1.0f) : vexp(vset(run_maxes[m] - new_max));
    const Vec weight = maxes[m] == new_max ? vset(1.0f) : vexp(vset(maxes[m] - new_max));
    float* rs = run_sums + m * kChunk;
    const float* ps = sums + m * kChunk;
    for (int v = 0; v < kChunkVecs; ++v) {
      vstore(rs + v * kLanes, vfma(vload(rs + v * kLanes), run_weight, vmul(vload(ps + v * kLanes), weight)));
    }
    float* ra = run_acc + m * padded;
    const float* pa = acc + m * padded;
    for (int64_t d = 0; d < padded; d += kLanes) vstore(ra + d, vfma(vload(ra + d), run_weight, vmul(vload(pa + d), weight)));
    run_maxes[m] = new_max;
  }
}

// An item's output rows from its running state.
void store_outputs(const Problem& pb, const Item& it, Scratch& s) {
  const int64_t first_token = pb.query_start[it.seq] + it.row0;
  for (int64_t kv = 0; kv < it.kv_heads; ++kv) {
    for (int64_t r = 0; r < it.rows; ++r) {
      for (int64_t h = 0; h < it.heads; ++h) {
        const int64_t m = (kv * it.rows + r) * it.heads + h;
        store_output(pb, s.run_acc + m * pb.padded, s.run_sums + m * kChunk, s.values, first_token + r,
                     (it.kv_head0 + kv) * pb.group + it.head0 + h);
      }
    }
  }
}

// Fresh running states for `count` query vectors (or, with maxes, a partition's).
void clear_state(int64_t count, int64_t padded, float* maxes, float* sums, float* acc) {
  std::fill(acc, acc + count * padded, 0.0f);
  std::fill(sums, sums + count * kChunk, 0.0f);
  std::fill(maxes, maxes + count, kNegInf);
}

// The outputs of an item whose partitions were computed apart (split items): their states folded in order.
void combine_item(const Problem& pb, const Item& it, const float* partials, int64_t parts, Scratch& s) {
  const int64_t count = it.kv_heads * it.rows * it.heads, stride = partial_floats(pb, it);
  s.reserve(count, pb.padded, pb.dim);
  clear_state(count, pb.padded, s.run_maxes, s.run_sums, s.run_acc);
  for (int64_t p = 0; p < parts; ++p) {
    const float* state = partials + p * stride;
    fold(count, pb.padded, s.run_maxes, s.run_sums, s.run_acc, state, state + count, state + count * (1 + kChunk));
  }
  store_outputs(pb, it, s);
}

template <typename T>
void run_item(const Problem& pb, const Item& it, Scratch& s) {
  const int64_t heads = it.heads, per_kv = it.rows * heads, dim = pb.dim, padded = pb.padded;
  s.reserve(it.kv_heads * per_kv, padded, dim);
  const int64_t qlen = pb.query_start[it.seq + 1] - pb.query_start[it.seq];
  const int64_t first_token = pb.query_start[it.seq] + it.row0;
  const int64_t first_pos = pb.seq_lens[it.seq] - qlen + it.row0;
  // Query vector m = (kv * rows + row) * heads + head, kv counted from it.kv_head0.
  for (int64_t kv = 0; kv < it.kv_heads; ++kv) {
    for (int64_t r = 0; r < it.rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t head = (it.kv_head0 + kv) * pb.group + it.head0 + h;
        const int64_t offset = (first_token + r) * pb.q_row + head * pb.q_head;
        float* dst = s.queries + ((kv * it.rows + r) * heads + h) * padded;
        switch (pb.q_type) {
          case at::kBFloat16: load_query<at::BFloat16>(pb, offset, dst); break;
          case at::kHalf: load_query<at::Half>(pb, offset, dst); break;
          default: load_query<float>(pb, offset, dst); break;
        }
      }
    }
  }
  const int64_t count = it.kv_heads * per_kv;
  clear_state(count, padded, s.run_maxes, s.run_sums, s.run_acc);

  const Layout& layout = pb.layout;
  const T* k_cache = static_cast<const T*>(pb.k_cache);
  const T* v_cache = static_cast<const T*>(pb.v_cache);
  const bool keys_in_place = layout.block_size % kLanes == 0;  // a vector of keys never straddles two blocks
  const bool values_in_place = dim % kLanes == 0;          // whole vectors: the PV products widen T as they load
  const T* value_src[kChunk];
  const float* value_rows[kChunk];  // values widened into s.values (not in place)
  const float* key_rows[kMaxHeadDim];
  for (int64_t d = 0; d < dim; ++d) key_rows[d] = s.keys + d * kChunk;

  const auto first_key = [&](int64_t pos) { return pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0; };
  const KeyRange range = key_range(pb, it);
  const int64_t tile_lo = range.first, tile_hi = range.last;  // keys the tile reads
  const int64_t last_block = (pb.seq_lens[it.seq] - 1) / layout.block_size;  // the table's last block of the sequence
  const int64_t part_lo = it.part >= 0 ? it.part : tile_lo / kPartition;
  const int64_t part_hi = it.part >= 0 ? it.part + 1 : (tile_hi + kPartition - 1) / kPartition;
  const int64_t fetch_hi = it.part >= 0 ? std::min(tile_hi, part_hi * kPartition) : tile_hi;  // keys it will read
  int64_t blocks[kChunk];  // the block of each key of the chunk (past the sequence: its last block, never read)
  int64_t offsets[kChunk];  // and its place in the block (counted on: a division a key cost as much as its products)
  for (int64_t part = part_lo; part < part_hi; ++part) {
    clear_state(count, padded, s.maxes, s.sums, s.acc);
    const int64_t keys_lo = std::max(tile_lo, part * kPartition), keys_hi = std::min(tile_hi, (part + 1) * kPartition);
    for (int64_t c = keys_lo / kChunk * kChunk; c < keys_hi; c += kChunk) {
      const int lo = static_cast<int>(std::max(c, keys_lo) - c), hi = static_cast<int>(std::min(c + kChunk, keys_hi) - c);
      for (int64_t j = 0, index = c / layout.block_size, offset = c % layout.block_size; j < kChunk; ++j) {
        blocks[j] = j > 0 && offset > 0 ? blocks[j - 1] : pb.tables.at(it.seq, std::min(index, last_block));
        offsets[j] = offset;
        if (++offset == layout.block_size) offset = 0, ++index;
      }
      for (int64_t kv = 0; kv < it.kv_heads; ++kv) {
        const int64_t head = it.kv_head0 + kv;
        Prefetcher prefetcher;
        if (const int64_t next = c + kChunk; next < fetch_hi) {
          plan_prefetch<T>(pb, it.seq, head, next, std::min(next + kChunk, fetch_hi), prefetcher);
        }
        const int64_t half = (prefetcher.lines() + 1) / 2;
        prefetcher.issue(half);
        KeyColumns<T> columns;
        columns.stride = layout.block_size;
        if (keys_in_place) {
          for (int v = 0; v < kChunkVecs; ++v) {
            const int j = v * kLanes;
            columns.columns[v] = k_cache + layout.key(blocks[j], head, offsets[j]);
            if constexpr (kQuantized<T>) columns.scales[v] = pb.k_scale + layout.key_scale(blocks[j], head, offsets[j]);
          }
        } else {
          gather_keys<T>(pb, blocks, offsets, head, lo, hi, s.keys);
        }
        for (int j = lo; j < hi; ++j) {
          const T* row = v_cache + layout.value(blocks[j], head, offsets[j]);
          if constexpr (kQuantized<T>) {
            const at::Half* scales = pb.v_scale + layout.value_scale(blocks[j], head, offsets[j]);
            for (int64_t g = 0; g < layout.groups; ++g) s.scales[j * layout.groups + g] = to_float(scales[g]);
          }
          if (values_in_place) {
            value_src[j] = row;
          } else {
            widen_row(row, dim, padded, s.values + j * padded);
            value_rows[j] = s.values + j * padded;
          }
        }
        const auto step = [&](int64_t m0, int64_t n, int a, int b) {
          const auto with_keys = [&](const auto& keys) {
            if (values_in_place) {
              softmax_step(s, pb, keys, Rows<T>{value_src, s.scales, layout.groups}, m0, n, a, b, prefetcher);
            } else {
              softmax_step(s, pb, keys, Rows<float>{value_rows}, m0, n, a, b, prefetcher);
            }
          };
          if (keys_in_place) {
            with_keys(columns);
          } else {
            with_keys(Rows<float>{key_rows});
          }
        };
        // Rows that see the whole chunk go together; a row that sees part of it goes alone, over its own keys.
        const int64_t base = kv * per_kv;
        int64_t r = 0;
        while (r < it.rows) {
          const int64_t pos = first_pos + r;
          const int64_t a = std::max(c, first_key(pos)), b = std::min(c + kChunk, pos + 1);
          if (a >= b) {
            ++r;
          } else if (a == c && b == c + kChunk) {
            int64_t end = r + 1;
            while (end < it.rows && first_key(first_pos + end) <= c && first_pos + end >= c + kChunk - 1) ++end;
            step(base + r * heads, (end - r) * heads, 0, kChunk);
            r = end;
          } else {
            step(base + r * heads, heads, static_cast<int>(a - c), static_cast<int>(b - c));
            ++r;
          }
        }
      }
    }
    if (it.partials != nullptr) {  // a split item: this partition's state, folded later with the others'
      std::copy(s.maxes, s.maxes + count, it.partials);
      std::copy(s.sums, s.sums + count * kChunk, it.partials + count);
      std::copy(s.acc, s.acc + count * padded, it.partials + count * (1 + kChunk));
    } else {
      fold(count, padded, s.run_maxes, s.run_sums, s.run_acc, s.maxes, s.sums, s.acc);
    }
  }
  if (it.partials == nullptr) store_outputs(pb, it, s);
}

// Splits the call into items: query-row tiles per sequence over all its KV heads; when that leaves too few
// items to keep the threads busy, one KV head per item, then parts of the query heads sharing a KV head.
std::vector<Item> plan_items(const Problem& pb, int64_t num_seqs, int64_t threads) {
  const auto tile_rows = [](int64_t heads) { return std::clamp<int64_t>(kTileQueries / heads, 1, kChunk); };
  const auto count_items = [&](int64_t kv_heads, int64_t part) {
    int64_t n = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
      const int64_t qlen = pb.query_start[b + 1] - pb.query_start[b];
      n += (qlen + tile_rows(part) - 1) / tile_rows(part);
    }
    return n * (pb.kv_heads / kv_heads) * ((pb.group + part - 1) / part);
  };
  int64_t kv_heads = pb.kv_heads, part = pb.group;
  if (count_items(kv_heads, part) < threads) kv_heads = 1;
  while (part > 1 && count_items(kv_heads, part) < threads) part = (part + 1) / 2;
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t qlen = pb.query_start[b + 1] - pb.query_start[b];
    const int64_t rows = tile_rows(part);
    for (int64_t row0 = 0; row0 < qlen; row0 += rows) {
      const int64_t n = std::min(rows, qlen - row0);
      const int64_t mid = pb.seq_lens[b] - qlen + row0 + n / 2 + 1;
      const double keys = static_cast<double>(pb.window > 0 ? std::min(mid, pb.window) : mid);
      for (int64_t g = 0; g < pb.kv_heads; g += kv_heads) {
        for (int64_t h0 = 0; h0 < pb.group; h0 += part) {
          const int64_t heads = std::min(part, pb.group - h0);
          const double cost = static_cast<double>(n * heads * kv_heads) * (keys + kChunk);
          items.push_back({b, g, kv_heads, h0, heads, row0, n, cost});
        }
      }
    }
  }
  return items;
}

// Items over partitions, one each, when there are too few items to keep the threads busy: the partitions' states go
// to a workspace, and each item's are folded in order once all are done. Empty if no item spans two partitions.
std::vector<Item> split_items(const Problem& pb, const std::vector<Item>& items, int64_t threads,
                              std::vector<float>& workspace, std::vector<int64_t>& first_part) {
  std::vector<Item> parts;
  if (threads <= 1 || static_cast<int64_t>(items.size()) >= kSplitBelow * threads) return parts;
  int64_t floats = 0;
  for (const Item& it : items) {
    const KeyRange range = key_range(pb, it);
    floats += ((range.last + kPartition - 1) / kPartition - range.first / kPartition) * partial_floats(pb, it);
  }
  workspace.resize(floats);
  float* partials = workspace.data();
  for (const Item& it : items) {
    const KeyRange range = key_range(pb, it);
    first_part.push_back(static_cast<int64_t>(parts.size()));
    const double per_key = it.cost / static_cast<double>(range.last - range.first + kChunk);
    for (int64_t p = range.first / kPartition; p * kPartition < range.last; ++p) {
      Item part = it;
      part.part = p;
      part.partials = std::exchange(partials, partials + partial_floats(pb, it));
      const int64_t keys = std::min(range.last, (p + 1) * kPartition) - std::max(range.first, p * kPartition);
      part.cost = per_key * static_cast<double>(keys + kChunk);
      parts.push_back(part);
    }
  }
  first_part.push_back(static_cast<int64_t>(parts.size()));
  if (static_cast<int64_t>(parts.size()) == static_cast<int64_t>(items.size())) parts.clear();  // nothing to split
  return parts;
}

// Longest first, handed out one at a time: which thread runs an item never changes its result.
template <typename Fn>
void run_in_parallel(std::vector<int64_t>& order, const std::vector<double>& costs, Fn&& fn) {
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  statelm::parallel_for(static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch& scratch = thread_scratch();
    for (int64_t i = begin; i < end; ++i) fn(order[i], scratch);
  });
}

template <typename T>
void run_items(const Problem& pb, std::vector<Item>& items, int64_t threads) {
  double total = 0.0;
  for (const Item& it : items) total += it.cost;
  if (threads <= 1 || total < kSerialCost) {
    for (const Item& it : items) run_item<T>(pb, it, thread_scratch());
    return;
  }
  std::vector<float> workspace;
  std::vector<int64_t> first_part;
  std::vector<Item> parts = split_items(pb, items, threads, workspace, first_part);
  std::vector<Item>& work = parts.empty() ? items : parts;
  std::vector<int64_t> order(work.size());
  std::vector<double> costs(work.size());
  for (size_t i = 0; i < work.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    costs[i] = work[i].cost;
  }
  run_in_parallel(order, costs, [&](int64_t i, Scratch& scratch) { run_item<T>(pb, work[i], scratch); });
  if (parts.empty()) return;
  order.resize(items.size());
  costs.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    costs[i] = static_cast<double>(first_part[i + 1] - first_part[i]);
  }
  run_in_parallel(order, costs, [&](int64_t i, Scratch& scratch) {
    combine_item(pb, items[i], parts[first_part[i]].partials, first_part[i + 1] - first_part[i], scratch);
  });
}

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

bool is_cache_type(at::ScalarType t) { return is_float_type(t) || t == at::kChar; }

// The pool's layout of one layer's caches, checked: keys [blocks, KVH, D, S], values [blocks, KVH, S, D], scales
// (defined for int8 caches only) [blocks, KVH, D/32, S] and [blocks, KVH, S, D/32] float16, all contiguous.
Layout check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                    const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && is_cache_type(k_cache.scalar_type()),
              "k_cache must be [blocks, KVH, D, block_size] float32/bfloat16/float16/int8");
  const int64_t blocks = k_cache.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2), size = k_cache.size(3);
  TORCH_CHECK(v_cache.sizes() == at::IntArrayRef({blocks, kv_heads, size, dim}) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "v_cache must be [blocks, KVH, block_size, D] of k_cache's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "the caches must be CPU tensors");
  TORCH_CHECK(dim >= 1 && dim <= kMaxHeadDim, "head dim must be 1..", kMaxHeadDim);
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_scale.has_value() == quantized && v_scale.has_value() == quantized,
              "int8 (q8_0) caches need k_scale and v_scale; float caches take none");
  const int64_t groups = quantized ? dim / kGroup : 0;
  if (quantized) {
    TORCH_CHECK(dim % kGroup == 0, "a q8_0 cache needs a head dim that is a multiple of ", kGroup);
    TORCH_CHECK(k_scale->sizes() == at::IntArrayRef({blocks, kv_heads, groups, size}) &&
                    v_scale->sizes() == at::IntArrayRef({blocks, kv_heads, size, groups}) &&
                    k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                    k_scale->is_contiguous() && v_scale->is_contiguous(),
                "k_scale must be [blocks, KVH, D/32, block_size] and v_scale [blocks, KVH, block_size, D/32], "
                "contiguous float16");
  }
  return {kv_heads, dim, groups, size};
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                           const at::Tensor& query_start_in, double scale, int64_t sliding_window,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && is_float_type(q_in.scalar_type()), "q must be [T, H, D] float32/bfloat16/float16");
  TORCH_CHECK(q_in.device().is_cpu(), "paged_attention runs on CPU tensors");
  const Layout layout = check_caches(k_cache, v_cache, k_scale, v_scale);
  const int64_t heads = q_in.size(1), dim = q_in.size(2), kv_heads = layout.kv_heads;
  TORCH_CHECK(layout.dim == dim, "q and the caches disagree on the head dim");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(block_tables_in.dim() == 2 &&
                  (block_tables_in.scalar_type() == at::kInt || block_tables_in.scalar_type() == at::kLong),
              "block_tables must be [B, W] int32/int64");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const at::Tensor query_start = query_start_in.to(at::kLong).contiguous();
  const int64_t num_seqs = block_tables.size(0), tokens = q.size(0);
  TORCH_CHECK(seq_lens.numel() == num_seqs && query_start.numel() == num_seqs + 1,
              "seq_lens must have B entries and query_start B + 1");

  Problem pb{};
  pb.q = static_cast<const char*>(q.data_ptr());
  pb.q_row = q.stride(0);
  pb.q_head = q.stride(1);
  pb.q_type = q.scalar_type();
  at::Tensor out = at::empty({tokens, heads, dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  pb.out = static_cast<char*>(out.data_ptr());
  pb.k_cache = k_cache.data_ptr();
  pb.v_cache = v_cache.data_ptr();
  pb.k_scale = k_scale.has_value() ? static_cast<const at::Half*>(k_scale->data_ptr()) : nullptr;
  pb.v_scale = v_scale.has_value() ? static_cast<const at::Half*>(v_scale->data_ptr()) : nullptr;
  pb.layout = layout;
  pb.tables.width = block_tables.size(1);
  if (block_tables.scalar_type() == at::kInt) {
    pb.tables.narrow = block_tables.data_ptr<int32_t>();
  } else {
    pb.tables.wide = block_tables.data_ptr<int64_t>();
  }
  pb.seq_lens = seq_lens.data_ptr<int64_t>();
  pb.query_start = query_start.data_ptr<int64_t>();
  pb.heads = heads;
  pb.kv_heads = kv_heads;
  pb.group = heads / kv_heads;
  pb.dim = dim;
  pb.padded = round_up(dim, kLanes);
  pb.window = sliding_window;
  pb.scale = static_cast<float>(scale);
  pb.softcap = static_cast<float>(softcap);

  TORCH_CHECK(pb.query_start[0] == 0 && pb.query_start[num_seqs] == tokens,
              "query_start must run from 0 to the number of query rows");
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t qlen = pb.query_start[b + 1] - pb.query_start[b], len = pb.seq_lens[b];
    TORCH_CHECK(qlen >= 0 && qlen <= len, "sequence ", b, ": query rows must be 0..seq_len");
    const int64_t used = (len + layout.block_size - 1) / layout.block_size;
    TORCH_CHECK(used <= pb.tables.width, "sequence ", b, ": block table too narrow for ", len, " tokens");
    for (int64_t i = 0; i < (qlen > 0 ? used : 0); ++i) {
      const int64_t block = pb.tables.at(b, i);
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", b, ": block id ", block, " out of range");
    }
  }
  if (tokens == 0) return out;

  const int64_t threads = statelm::num_threads();
  std::vector<Item> items = plan_items(pb, num_seqs, threads);
  switch (k_cache.scalar_type()) {
    case at::kBFloat16: run_items<at::BFloat16>(pb, items, threads); break;
    case at::kHalf: run_items<at::Half>(pb, items, threads); break;
    case at::kChar: run_items<int8_t>(pb, items, threads); break;
    default: run_items<float>(pb, items, threads); break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// The store of a step's K/V: each token's row rounded to the cache's dtype (to nearest even) or quantized
// (q8_0: per 32 values d = fp16(max|x| / 127), q = x / d rounded to nearest even, clamped to +-127; 0 where d is
// 0), exactly as statelm.engine.kv_format computes them, and written into its slot's block.

// float32 x[0..n) of a row of K or V.
template <typename X>
void row_to_float(const X* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// One 32-value q8_0 group: int8 values and the float16 scale.
at::Half quantize_group(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  const at::Half scale(amax / 127.0f);
  const float d = static_cast<float>(scale);
  for (int i = 0; i < kGroup; ++i) {
    q[i] = d == 0.0f ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / d), -127.0f, 127.0f));
  }
  return scale;
}

template <typename T>
void store_rows(const at::Tensor& rows, void* cache_ptr, at::Half* scales, const Layout& layout,
                const int64_t* slots, bool keys) {
  T* cache = static_cast<T*>(cache_ptr);
  const int64_t tokens = rows.size(0), heads = layout.kv_heads, dim = layout.dim, size = layout.block_size;
  statelm::parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
    float x[kMaxHeadDim];
    int8_t q[kMaxHeadDim];
    at::Half scale[kMaxHeadDim / kGroup];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding row
      const int64_t block = slot / size, offset = slot % size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t src = t * rows.stride(0) + h * rows.stride(1);
        switch (rows.scalar_type()) {
          case at::kBFloat16: row_to_float(rows.const_data_ptr<at::BFloat16>() + src, dim, x); break;
          case at::kHalf: row_to_float(rows.const_data_ptr<at::Half>() + src, dim, x); break;
          default: row_to_float(rows.const_data_ptr<float>() + src, dim, x); break;
        }
        if constexpr (kQuantized<T>) {
          for (int64_t g = 0; g < layout.groups; ++g) scale[g] = quantize_group(x + g * kGroup, q + g * kGroup);
        }
        const auto element = [&](int64_t d) {
          if constexpr (kQuantized<T>) return q[d];
          else return static_cast<T>(x[d]);
        };
        if (keys) {
          T* dst = cache + layout.key(block, h, offset);
          for (int64_t d = 0; d < dim; ++d) dst[d * size] = element(d);
          if constexpr (kQuantized<T>) {
            at::Half* s = scales + layout.key_scale(block, h, offset);
            for (int64_t g = 0; g < layout.groups; ++g) s[g * size] = scale[g];
          }
        } else {
          T* dst = cache + layout.value(block, h, offset);
          for (int64_t d = 0; d < dim; ++d) dst[d] = element(d);
          if constexpr (kQuantized<T>) {
            std::copy(scale, scale + layout.groups, scales + layout.value_scale(block, h, offset));
          }
        }
      }
    }
  });
}

void kv_store(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
              const at::Tensor& slot_mapping_in) {
  const Layout layout = check_caches(k_cache, v_cache, k_scale, v_scale);
  for (const at::Tensor* rows : {&k, &v}) {
    TORCH_CHECK(rows->dim() == 3 && is_float_type(rows->scalar_type()) && rows->device().is_cpu(),
                "k and v must be [T, KVH, D] float32/bfloat16/float16 CPU tensors");
    TORCH_CHECK(rows->size(1) == layout.kv_heads && rows->size(2) == layout.dim && rows->stride(2) == 1,
                "k and v must match the caches' KV heads and head dim, with contiguous rows");
  }
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slot_mapping.numel() == k.size(0) && v.size(0) == k.size(0), "one slot per row of k and v");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * layout.block_size;
  for (int64_t t = 0; t < slot_mapping.numel(); ++t) {
    TORCH_CHECK(slots[t] < capacity, "slot ", slots[t], " is outside the cache");
  }
  at::Half* k_scales = k_scale.has_value() ? static_cast<at::Half*>(k_scale->data_ptr()) : nullptr;
  at::Half* v_scales = v_scale.has_value() ? static_cast<at::Half*>(v_scale->data_ptr()) : nullptr;
  const auto store = [&](auto element) {
    using T = decltype(element);
    store_rows<T>(k, k_cache.data_ptr(), k_scales, layout, slots, true);
    store_rows<T>(v, v_cache.data_ptr(), v_scales, layout, slots, false);
  };
  switch (k_cache.scalar_type()) {
    case at::kBFloat16: store(at::BFloat16()); break;
    case at::kHalf: store(at::Half()); break;
    case at::kChar: store(int8_t()); break;
    default: store(0.0f); break;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start, float scale, int sliding_window=0, Tensor? k_scale=None, Tensor? v_scale=None, "
      "float softcap=0.0) -> Tensor");
  m.def(
      "kv_store(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? v_scale, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("kv_store", &kv_store);
}
