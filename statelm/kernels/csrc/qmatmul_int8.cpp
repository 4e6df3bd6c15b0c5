// The quantized matmul with int8 activations, as llama.cpp's CPU kernels compute a Q4_1 or Q8_0 matmul.
//
// Activations: q = round(x * 127 / amax), dx = amax / 127, sx = dx * sum(q) per row and block of 32, so a
// block's dot product is exact in integers:
//   q4: sum_j (d*qw_j + m) * dx*qx_j = d*dx * sum_j qw_j*qx_j + m * sx
//   q8: sum_j  d*qw_j      * dx*qx_j = d*dx * sum_j qw_j*qx_j
// On AVX2 a block's 32 multiply-adds per column are two instructions (vpmaddubsw, then vpmaddwd), against four
// float FMAs, and the weights are never widened to float. With AVX512-VNNI a vector holds two column groups
// and one vpdpbusd does a quad's multiply-adds for 16 columns. A row's quantization reads only that row and its
// block sums are exact integers, so the float accumulation over blocks in K order is all that orders a result,
// and every build gives the same bits.

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "qmatmul.h"
#include "parallel.h"

namespace statelm::qmatmul {
namespace {

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
  statelm::parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = m * blocks + b;
        quantize_block(in + m * stride + b * kBlock, out.values.data() + at * kBlock, &out.scales[at], &out.sums[at]);
      }
    }
  });
  return out;
}

#if defined(STATELM_QMATMUL_AVX2)
// The four int8 values at q as one int32, to broadcast to every 32-bit lane.
inline int32_t quad_at(const int8_t* q) {
  int32_t quad;
  std::memcpy(&quad, q, sizeof(quad));
  return quad;
}

inline __m256i broadcast_quad(const int8_t* q) { return _mm256_set1_epi32(quad_at(q)); }

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

#if defined(STATELM_QMATMUL_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define STATELM_QMATMUL_VNNI 1
constexpr int kTileRows = 8;  // rows sharing each loaded pair of weight blocks

// The same 32 bytes of two column groups' blocks in one vector: group g's in the low half, g+1's in the high.
inline __m512i two_groups(const uint8_t* first, const uint8_t* second) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)), 1);
}

// 8 floats for group g and 8 for g+1.
inline __m512 two_groups(const float* first, const float* second) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(first)), _mm256_loadu_ps(second), 1);
}

inline __m512i broadcast_quad_wide(const int8_t* q) { return _mm512_set1_epi32(quad_at(q)); }

// Rows m0..m0+R-1 of column groups g and g+1: lane j of a row's vector is group g's column j (j < 8) or group
// g+1's column j-8. The block dot products are exact int32 sums, as in the AVX2 build; the float steps after
// them are the AVX2 build's, lane for lane.
template <bool kQ4, int R>
inline void output_tile_pair(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t group, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t first = w.at(group, b), second = w.at(group + 1, b);
    const uint8_t* values_first = w.values + first * w.block_bytes();
    const uint8_t* values_second = w.values + second * w.block_bytes();
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    if constexpr (kQ4) {
      const __m512i mask = _mm512_set1_epi8(0x0F);
      for (int quad = 0; quad < 4; ++quad) {
        const __m512i bytes = two_groups(values_first + quad * 32, values_second + quad * 32);
        const __m512i low = _mm512_and_si512(bytes, mask);                         // values 4*quad + i
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);  // values 16 + 4*quad + i
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.block(m0 + r, b);
          sums[r] = _mm512_dpbusd_epi32(sums[r], low, broadcast_quad_wide(q + 4 * quad));
          sums[r] = _mm512_dpbusd_epi32(sums[r], high, broadcast_quad_wide(q + 16 + 4 * quad));
        }
      }
    } else {
      for (int quad = 0; quad < 8; ++quad) {
        const __m512i signed_values = two_groups(values_first + quad * 32, values_second + quad * 32);
        const __m512i magnitudes = _mm512_abs_epi8(signed_values);  // -128 reads as 128 unsigned
        const __mmask64 negative = _mm512_movepi8_mask(signed_values);
        for (int r = 0; r < R; ++r) {
          const __m512i quad_of_x = broadcast_quad_wide(x.block(m0 + r, b) + 4 * quad);
          const __m512i moved = _mm512_mask_sub_epi8(quad_of_x, negative, _mm512_setzero_si512(), quad_of_x);
          sums[r] = _mm512_dpbusd_epi32(sums[r], magnitudes, moved);
        }
      }
    }
    const __m512 scales = two_groups(w.scales + first * kGroup, w.scales + second * kGroup);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(scales, _mm512_set1_ps(x.scale(m0 + r, b)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
    }
    if constexpr (kQ4) {
      const __m512 mins = two_groups(w.mins + first * kGroup, w.mins + second * kGroup);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.sum(m0 + r, b)), acc[r]);
    }
  }
  alignas(64) float lanes[2 * kGroup];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(lanes, acc[r]);
    store_columns(lanes, y + (m0 + r) * w.n, group * kGroup, w.n);
    store_columns(lanes + kGroup, y + (m0 + r) * w.n, (group + 1) * kGroup, w.n);
  }
}

// Two column groups when both are in the task's range, else the one.
template <bool kQ4, int R>
inline void groups_tile(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t group, int64_t end, float* y) {
  if (group + 1 < end) {
    output_tile_pair<kQ4, R>(w, x, m0, group, y);
  } else {
    output_tile<kQ4, R>(w, x, m0, group, y);
  }
}
#else
constexpr int kTileRows = kRowsPerTile;

template <bool kQ4, int R>
inline void groups_tile(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t group, int64_t, float* y) {
  output_tile<kQ4, R>(w, x, m0, group, y);
}
#endif

template <bool kQ4>
void dispatch_tile(const Weights& w, const QuantizedRows& x, int64_t m0, int64_t rows, int64_t group, int64_t end,
                   float* y) {
  switch (rows) {
#if defined(STATELM_QMATMUL_VNNI)
    case 8: groups_tile<kQ4, 8>(w, x, m0, group, end, y); break;
    case 7: groups_tile<kQ4, 7>(w, x, m0, group, end, y); break;
    case 6: groups_tile<kQ4, 6>(w, x, m0, group, end, y); break;
    case 5: groups_tile<kQ4, 5>(w, x, m0, group, end, y); break;
#endif
    case 4: groups_tile<kQ4, 4>(w, x, m0, group, end, y); break;
    case 3: groups_tile<kQ4, 3>(w, x, m0, group, end, y); break;
    case 2: groups_tile<kQ4, 2>(w, x, m0, group, end, y); break;
    default: groups_tile<kQ4, 1>(w, x, m0, group, end, y); break;
  }
}

}  // namespace

void matmul_int8_activations(const at::Tensor& x, const Weights& w, float* y) {
  const QuantizedRows quantized = quantize_rows(x);
  const int64_t rows = x.size(0), groups = (w.n + kGroup - 1) / kGroup;
#if defined(STATELM_QMATMUL_VNNI)
  constexpr int64_t kGroupStep = 2;
#else
  constexpr int64_t kGroupStep = 1;
#endif
  statelm::parallel_for(groups, kGroupGrain, [&](int64_t begin, int64_t end) {
    for_each_tile<kTileRows, kGroupStep>(rows, begin, end, [&](int64_t m0, int64_t tile, int64_t group) {
      if (w.q4) {
        dispatch_tile<true>(w, quantized, m0, tile, group, end, y);
      } else {
        dispatch_tile<false>(w, quantized, m0, tile, group, end, y);
      }
    });
  });
}

}  // namespace statelm::qmatmul
