// Weight-only quantized matmul over 32-value blocks: y[m, n] = sum_b d[n, b] * (q[n, b] . x[m, b]) + m[n, b] * sum(x[m, b]).
//
// Formats (32-value blocks along K, float32 scale per block):
//   q8: int8 values, w = d * q                     (GGUF Q8_0, and Q5/Q6/K-quants re-packed)
//   q4: 4-bit values 0..15 in nibbles, w = d*q + m  (GGUF Q4_0 with m = -8d, Q4_1)
// q4 bytes hold value j in the low nibble of byte j and value j+16 in the high nibble (GGML's order).
//
// Activations stay float32: each weight block is widened to float once per tile of rows and multiplied into
// the rows' float32 values, so the only error against the dequantized matrix is float rounding. Every output
// value accumulates its blocks in K order with the same float operations whatever the number of rows, their
// batch or the thread count (threads split N only), so a row's result never depends on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define STATELM_QMATMUL_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kColumnGrain = 16;

// Per row and block, the sum of the block's activations (the factor of a q4 block's min).
std::vector<float> block_sums(const float* x, int64_t rows, int64_t k, int64_t stride) {
  const int64_t blocks = k / kBlock;
  std::vector<float> sums(rows * blocks);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + m * stride + b * kBlock;
      float sum = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) sum += in[i];
      sums[m * blocks + b] = sum;
    }
  }
  return sums;
}

struct Operands {
  const float* x;
  int64_t x_stride;
  const float* x_sums;
  int64_t k;
  float* y;
  int64_t n;
};

#if defined(STATELM_QMATMUL_AVX2)
inline float hsum_ps(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// The block's 32 weights (before scale and min) as four vectors of 8 floats, in K order.
template <bool kQ4>
inline void widen_block(const uint8_t* block, __m256 out[4]) {
  if constexpr (kQ4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);                     // values 0..15
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // values 16..31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
  } else {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)));
  }
}

// Rows m0..m0+R-1 of one output column. Per block, each row's 8 lanes += d * (w . x) lanes; the lanes are summed
// once at the end. A row's operations are the same whatever R is, so its result does not depend on its tile.
template <bool kQ4, int R>
inline void output_tile(const uint8_t* w_row, const float* scales, const float* mins, const Operands& op, int64_t m0,
                        int64_t col) {
  const int64_t blocks = op.k / kBlock;
  constexpr int64_t kBlockBytes = kQ4 ? kBlock / 2 : kBlock;
  __m256 acc[R];
  float min_acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    min_acc[r] = 0.0f;
  }
  __m256 w[4];
  for (int64_t b = 0; b < blocks; ++b) {
    widen_block<kQ4>(w_row + b * kBlockBytes, w);
    const __m256 scale = _mm256_set1_ps(scales[b]);
    for (int r = 0; r < R; ++r) {
      const float* x = op.x + (m0 + r) * op.x_stride + b * kBlock;
      __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
      dot = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), dot);
      dot = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), dot);
      dot = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), dot);
      acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
      if constexpr (kQ4) min_acc[r] += mins[b] * op.x_sums[(m0 + r) * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) op.y[(m0 + r) * op.n + col] = hsum_ps(acc[r]) + min_acc[r];
}
#else
template <bool kQ4, int R>
inline void output_tile(const uint8_t* w_row, const float* scales, const float* mins, const Operands& op, int64_t m0,
                        int64_t col) {
  const int64_t blocks = op.k / kBlock;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float acc = 0.0f, min_acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = op.x + m * op.x_stride + b * kBlock;
      float dot = 0.0f;
      if constexpr (kQ4) {
        const uint8_t* q = w_row + b * kBlock / 2;
        for (int64_t i = 0; i < kBlock / 2; ++i) dot += static_cast<float>(q[i] & 0x0F) * x[i];
        for (int64_t i = 0; i < kBlock / 2; ++i) dot += static_cast<float>(q[i] >> 4) * x[i + kBlock / 2];
        min_acc += mins[b] * op.x_sums[m * blocks + b];
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(w_row) + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) dot += static_cast<float>(q[i]) * x[i];
      }
      acc += dot * scales[b];
    }
    op.y[m * op.n + col] = acc + min_acc;
  }
}
#endif

template <bool kQ4>
void output_columns(const uint8_t* w, int64_t row_bytes, const float* d, const float* mn, const Operands& op,
                    int64_t rows, int64_t begin, int64_t end) {
  const int64_t blocks = op.k / kBlock;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerTile) {
    const int64_t tile = std::min<int64_t>(kRowsPerTile, rows - m0);
    for (int64_t col = begin; col < end; ++col) {
      const uint8_t* w_row = w + col * row_bytes;
      const float* scales = d + col * blocks;
      const float* mins = kQ4 ? mn + col * blocks : nullptr;
      switch (tile) {
        case 4: output_tile<kQ4, 4>(w_row, scales, mins, op, m0, col); break;
        case 3: output_tile<kQ4, 3>(w_row, scales, mins, op, m0, col); break;
        case 2: output_tile<kQ4, 2>(w_row, scales, mins, op, m0, col); break;
        default: output_tile<kQ4, 1>(w_row, scales, mins, op, m0, col); break;
      }
    }
  }
}

// x [M, K] float32; values [N, K] int8 (q8) or [N, K/2] uint8 (q4); scales (and mins, q4) [N, K/32] float32.
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32 rows");
  const bool q4 = mins.has_value();
  const int64_t rows = x.size(0), k = x.size(1), n = values.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.is_contiguous() && values.size(1) == (q4 ? k / 2 : k), "values do not match K");
  TORCH_CHECK(values.scalar_type() == (q4 ? at::kByte : at::kChar), "values must be uint8 (q4) or int8 (q8)");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.size(0) == n &&
                  scales.size(1) == k / kBlock,
              "scales must be [N, K/32] float32");
  if (q4) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes(),
                "mins must be [N, K/32] float32");
  }
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const std::vector<float> sums = q4 ? block_sums(x.data_ptr<float>(), rows, k, x.stride(0)) : std::vector<float>();
  const Operands op{x.data_ptr<float>(), x.stride(0), sums.data(), k, out.data_ptr<float>(), n};
  const uint8_t* w = static_cast<const uint8_t*>(values.data_ptr());
  const float* d = scales.data_ptr<float>();
  const float* mn = q4 ? mins->data_ptr<float>() : nullptr;
  const int64_t row_bytes = values.size(1);
  at::parallel_for(0, n, kColumnGrain, [&](int64_t begin, int64_t end) {
    if (q4) {
      output_columns<true>(w, row_bytes, d, mn, op, rows, begin, end);
    } else {
      output_columns<false>(w, row_bytes, d, mn, op, rows, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("quantized_matmul(Tensor x, Tensor values, Tensor scales, Tensor? mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("quantized_matmul", &quantized_matmul); }
