// Weight-only quantized matmul over 32-element blocks: y[m, n] = sum_b d_w[n, b] * (w_q[n, b] . x[m, b]) (+ min terms).
//
// Formats (all 32-value blocks along K, float32 scale per block):
//   q8: int8 values, w = d * q                     (GGUF Q8_0, and Q5/Q6 re-packed)
//   q4: 4-bit values 0..15 in nibbles, w = d*q + m  (GGUF Q4_0 with m = -8d, Q4_1, Q4_K)
// q4 bytes hold value j in the low nibble of byte j and value j+16 in the high nibble (GGML's order).
//
// Activations are quantized per row to int8 blocks (scale = max|x| / 127), as llama.cpp does, and each block's
// integer dot product is exact. Every output value accumulates its blocks in K order with the same float
// operations whatever the number of rows, their batch or the thread count (threads split N only), so a row's
// result never depends on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define STATELM_QMATMUL_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kColumnGrain = 16;

struct QuantizedRows {
  std::vector<int8_t> values;  // [M, K]
  std::vector<float> scales;   // [M, K/32]
  std::vector<float> sums;     // [M, K/32]: scale * sum of the block's int8 values
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t stride) {
  const int64_t blocks = k / kBlock;
  QuantizedRows q{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + m * stride + b * kBlock;
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(in[i]));
      const float d = amax / 127.0f;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* out = q.values.data() + m * k + b * kBlock;
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        out[i] = static_cast<int8_t>(std::nearbyint(in[i] * inv));
        sum += out[i];
      }
      q.scales[m * blocks + b] = d;
      q.sums[m * blocks + b] = d * static_cast<float>(sum);
    }
  }
  return q;
}

#if defined(STATELM_QMATMUL_AVX2)
inline __m256i load_q4(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Sum of unsigned (0..127) by signed int8 products over 32 bytes, as 8 int32 lanes.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#endif

#if defined(STATELM_QMATMUL_AVX2)
inline float hsum_ps(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// Rows m0..m0+R-1 of one output column. Each row keeps 8 float lanes: per block, lanes += (d_w * d_x) * isum lanes;
// the lanes are summed once at the end. The weight block is unpacked once for the R rows; a row's operations
// are the same whatever R is, so its result does not depend on the tile it lands in.
template <bool kQ4, int R>
inline void output_tile(const uint8_t* w_row, const float* w_scales, const float* w_mins, const QuantizedRows& q,
                        int64_t m0, int64_t k, float* y, int64_t n, int64_t col) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R];
  float min_acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    min_acc[r] = 0.0f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i wv, w_abs;
    if constexpr (kQ4) {
      wv = load_q4(w_row + b * kBlock / 2);
    } else {
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + b * kBlock));
      w_abs = _mm256_sign_epi8(wv, wv);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.values.data() + m * k + b * kBlock));
      const __m256i isum = kQ4 ? dot_u8_s8(wv, xv) : dot_u8_s8(w_abs, _mm256_sign_epi8(xv, wv));
      const __m256 scale = _mm256_set1_ps(w_scales[b] * q.scales[m * blocks + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
      if constexpr (kQ4) min_acc[r] += w_mins[b] * q.sums[m * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) y[(m0 + r) * n + col] = hsum_ps(acc[r]) + min_acc[r];
}
#else
template <bool kQ4, int R>
inline void output_tile(const uint8_t* w_row, const float* w_scales, const float* w_mins, const QuantizedRows& q,
                        int64_t m0, int64_t k, float* y, int64_t n, int64_t col) {
  const int64_t blocks = k / kBlock;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const int8_t* xq = q.values.data() + m * k;
    float acc = 0.0f, min_acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t isum = 0;
      if constexpr (kQ4) {
        const uint8_t* w = w_row + b * kBlock / 2;
        const int8_t* x = xq + b * kBlock;
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          isum += static_cast<int32_t>(w[i] & 0x0F) * x[i] + static_cast<int32_t>(w[i] >> 4) * x[i + kBlock / 2];
        }
        min_acc += w_mins[b] * q.sums[m * blocks + b];
      } else {
        const int8_t* w = reinterpret_cast<const int8_t*>(w_row) + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) isum += static_cast<int32_t>(w[i]) * xq[b * kBlock + i];
      }
      acc += (w_scales[b] * q.scales[m * blocks + b]) * static_cast<float>(isum);
    }
    y[m * n + col] = acc + min_acc;
  }
}
#endif

template <bool kQ4>
void output_columns(const uint8_t* w, const float* d, const float* mn, const QuantizedRows& q, int64_t rows,
                    int64_t k, int64_t row_bytes, float* y, int64_t n, int64_t begin, int64_t end) {
  const int64_t blocks = k / kBlock;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerTile) {
    const int64_t tile = std::min<int64_t>(kRowsPerTile, rows - m0);
    for (int64_t col = begin; col < end; ++col) {
      const uint8_t* w_row = w + col * row_bytes;
      const float* w_scales = d + col * blocks;
      const float* w_mins = kQ4 ? mn + col * blocks : nullptr;
      switch (tile) {
        case 4: output_tile<kQ4, 4>(w_row, w_scales, w_mins, q, m0, k, y, n, col); break;
        case 3: output_tile<kQ4, 3>(w_row, w_scales, w_mins, q, m0, k, y, n, col); break;
        case 2: output_tile<kQ4, 2>(w_row, w_scales, w_mins, q, m0, k, y, n, col); break;
        default: output_tile<kQ4, 1>(w_row, w_scales, w_mins, q, m0, k, y, n, col); break;
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
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, k, x.stride(0));
  const int64_t blocks = k / kBlock;
  const int64_t row_bytes = values.size(1);
  const uint8_t* w = static_cast<const uint8_t*>(values.data_ptr());
  const float* d = scales.data_ptr<float>();
  const float* mn = q4 ? mins->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, kColumnGrain, [&](int64_t begin, int64_t end) {
    if (q4) {
      output_columns<true>(w, d, mn, q, rows, k, row_bytes, y, n, begin, end);
    } else {
      output_columns<false>(w, d, mn, q, rows, k, row_bytes, y, n, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("quantized_matmul(Tensor x, Tensor values, Tensor scales, Tensor? mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("quantized_matmul", &quantized_matmul); }
