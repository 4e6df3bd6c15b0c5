// Quantized matmul y [M, N] = x [M, K] @ W.T, computed as llama.cpp's CPU kernels compute a Q4_1 or Q8_0 matmul:
// the weights stay in 32-value blocks and the activations are quantized to int8 per row and block of 32, so a
// block's dot product is exact in integers and costs a few instructions for 32 multiply-adds.
//
// Weights (see statelm/kernels/quant.py), with a float32 scale d (and, q4, a min m) per block of 32 along K:
//   q8: int8 values,        w = d*q       (GGUF Q8_0; other GGUF types re-packed)
//   q4: nibbles 0..15,      w = d*q + m   (GGUF Q4_0 with m = -8d, and Q4_1)
// laid out in groups of 8 output columns so that one 32-byte load holds 4 consecutive values of each of 8
// columns: q8 values [N/8, K/32, 8 quads, 8 columns, 4], q4 values [N/8, K/32, 4 quads, 8 columns, 4] whose
// low nibbles are a block's values 0..15 and high nibbles its values 16..31; scales and mins [N/8, K/32, 8].
// Integer lanes then line up with output columns: no horizontal sums, and a column's scale is a vector lane.
//
// Activations: q = round(x * 127 / amax), dx = amax / 127, sx = dx * sum(q) per row and block, so
//   q4: sum_j (d*qw_j + m) * dx*qx_j = d*dx * sum_j qw_j*qx_j + m * sx
//   q8: sum_j  d*qw_j      * dx*qx_j = d*dx * sum_j qw_j*qx_j
//
// Batch invariance: a row's quantization reads only that row, its block sums are exact integers, and its
// float accumulation runs over the blocks in K order with the same operations whatever the number of rows,
// their tile or the thread count (threads split N only). The scalar path computes the same float operations
// as the AVX2 path (fused multiply-adds included), so both give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define STATELM_QMATMUL_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;    // values per quantization block, along K
constexpr int64_t kGroup = 8;     // output columns interleaved together
constexpr int kRowsPerTile = 4;   // activation rows sharing each loaded weight block
constexpr int64_t kGroupsPerChunk = 4;  // column groups kept hot in L1 while every row tile passes over them

// A packed weight's arrays.
struct Weights {
  const uint8_t* values;
  const float* scales;
  const float* mins;  // q4 only
  int64_t n;          // output columns (the last group may be partly padding)
  int64_t blocks;     // K / 32
  bool q4;

  int64_t block_bytes() const { return q4 ? kGroup * kBlock / 2 : kGroup * kBlock; }
  int64_t at(int64_t group, int64_t block) const { return group * blocks + block; }
};

// Activation rows quantized per block: values [M, K], and per block dx and sx [M, K/32].
struct QuantizedRows {
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<float> sums;
  int64_t blocks;

  const int8_t* block(int64_t m, int64_t b) const { return values.data() + (m * blocks + b) * kBlock; }
  float scale(int64_t m, int64_t b) const { return scales[m * blocks + b]; }
  float sum(int64_t m, int64_t b) const { return sums[m * blocks + b]; }
};

void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t total = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inverse));  // round half to even
    q[i] = static_cast<int8_t>(v);
    total += v;
  }
  *scale = amax / 127.0f;
  *sum = *scale * static_cast<float>(total);
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0), blocks = k / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks),
                    blocks};
  const float* in = x.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 8192 / k);  // tasks of a few thousand values
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = m * blocks + b;
        quantize_block(in + m * stride + b * kBlock, out.values.data() + at * kBlock, &out.scales[at], &out.sums[at]);
      }
    }
  });
  return out;
}

// The 8 columns of a row's result, or those of them that exist.
inline void store_columns(const float* lanes, float* y, int64_t col, int64_t n) {
  std::memcpy(y + col, lanes, sizeof(float) * std::min<int64_t>(kGroup, n - col));
}

#if defined(STATELM_QMATMUL_AVX2)
inline __m256i broadcast_quad(const int8_t* q) {
  int32_t quad;
  std::memcpy(&quad, q, sizeof(quad));
  return _mm256_set1_epi32(quad);
}

// Rows m0..m0+R-1 of one group of 8 columns. Each row's operations are the same whatever R is.
template <bool kQ4, int R>
inline void output_tile(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t group, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t at = w.at(group, b);
    const uint8_t* values = w.values + at * w.block_bytes();
    __m256i sums[R];  // per row, 8 lanes of int32: one column's block dot product each
    if constexpr (kQ4) {
      // Pairs of int16 products: 8 maddubs of at most 2*15*127 each stay below 32767, so they add in int16.
      __m256i pairs[R];
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int quad = 0; quad < 4; ++quad) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + quad * 32));
        const __m256i low = _mm256_and_si256(bytes, mask);                         // values 4*quad + i
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);  // values 16 + 4*quad + i
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.block(m0 + r, b);
          const __m256i products = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast_quad(q + 4 * quad)),
                                                    _mm256_maddubs_epi16(high, broadcast_quad(q + 16 + 4 * quad)));
          pairs[r] = _mm256_add_epi16(pairs[r], products);
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(pairs[r], ones);
    } else {
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      for (int quad = 0; quad < 8; ++quad) {
        const __m256i signed_values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + quad * 32));
        const __m256i magnitudes = _mm256_sign_epi8(signed_values, signed_values);  // -128 reads as 128 unsigned
        for (int r = 0; r < R; ++r) {
          const __m256i moved = _mm256_sign_epi8(broadcast_quad(x.block(m0 + r, b) + 4 * quad), signed_values);
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, moved), ones));
        }
      }
    }
    const __m256 scales = _mm256_loadu_ps(w.scales + at * kGroup);
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(x.scale(m0 + r, b)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
    }
    if constexpr (kQ4) {
      const __m256 mins = _mm256_loadu_ps(w.mins + at * kGroup);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(x.sum(m0 + r, b)), acc[r]);
    }
  }
  alignas(32) float lanes[kGroup];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(lanes, acc[r]);
    store_columns(lanes, y + (m0 + r) * w.n, group * kGroup, w.n);
  }
}
#else
template <bool kQ4, int R>
inline void output_tile(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t group, float* y) {
  for (int r = 0; r < R; ++r) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t at = w.at(group, b);
      const uint8_t* values = w.values + at * w.block_bytes();
      const int8_t* q = x.block(m0 + r, b);
      for (int64_t c = 0; c < kGroup; ++c) {
        int32_t dot = 0;
        for (int64_t quad = 0; quad < (kQ4 ? 4 : 8); ++quad) {
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t byte = quad * 32 + c * 4 + i;
            if constexpr (kQ4) {
              dot += (values[byte] & 0x0F) * q[4 * quad + i] + (values[byte] >> 4) * q[16 + 4 * quad + i];
            } else {
              dot += static_cast<int8_t>(values[byte]) * q[4 * quad + i];
            }
          }
        }
        const float scale = w.scales[at * kGroup + c] * x.scale(m0 + r, b);
        acc[c] = std::fma(static_cast<float>(dot), scale, acc[c]);
        if constexpr (kQ4) acc[c] = std::fma(w.mins[at * kGroup + c], x.sum(m0 + r, b), acc[c]);
      }
    }
    store_columns(acc, y + (m0 + r) * w.n, group * kGroup, w.n);
  }
}
#endif

template <bool kQ4>
void output_groups(const Weights& w, const QuantizedRows& x, int64_t rows, int64_t begin, int64_t end, float* y) {
  for (int64_t g0 = begin; g0 < end; g0 += kGroupsPerChunk) {
    const int64_t g1 = std::min(end, g0 + kGroupsPerChunk);
    for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerTile) {
      const int64_t tile = std::min<int64_t>(kRowsPerTile, rows - m0);
      for (int64_t group = g0; group < g1; ++group) {
        switch (tile) {
          case 4: output_tile<kQ4, 4>(w, x, m0, group, y); break;
          case 3: output_tile<kQ4, 3>(w, x, m0, group, y); break;
          case 2: output_tile<kQ4, 2>(w, x, m0, group, y); break;
          default: output_tile<kQ4, 1>(w, x, m0, group, y); break;
        }
      }
    }
  }
}

// x [M, K] float32; values, scales and mins laid out as above for `out_features` columns.
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32 rows");
  const bool q4 = mins.has_value();
  const int64_t k = x.size(1), blocks = k / kBlock, groups = (out_features + kGroup - 1) / kGroup;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.is_contiguous() && values.scalar_type() == (q4 ? at::kByte : at::kChar) &&
                  values.numel() == groups * blocks * kGroup * (q4 ? kBlock / 2 : kBlock),
              "values must be the packed layout of an [N, K] weight (uint8 for q4, int8 for q8)");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == groups * blocks * kGroup,
              "scales must be float32 [N/8, K/32, 8]");
  if (q4) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->numel() == scales.numel(),
                "mins must be float32 [N/8, K/32, 8]");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return out;
  const Weights w{static_cast<const uint8_t*>(values.data_ptr()), scales.data_ptr<float>(),
                  q4 ? mins->data_ptr<float>() : nullptr, out_features, blocks, q4};
  const QuantizedRows quantized = quantize_rows(x);
  const int64_t rows = x.size(0);
  float* y = out.data_ptr<float>();
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    if (q4) {
      output_groups<true>(w, quantized, rows, begin, end, y);
    } else {
      output_groups<false>(w, quantized, rows, begin, end, y);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("quantized_matmul(Tensor x, Tensor values, Tensor scales, Tensor? mins, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("quantized_matmul", &quantized_matmul); }
