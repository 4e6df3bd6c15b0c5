// The quantized matmul with float32 activations: the float model's arithmetic on the packed weights.
//
// Per row, column and block: the 32 products q_k * x_k are summed in four chains (k mod 4, each in K order),
// the chains are added as (c0 + c1) + (c2 + c3), and the block joins the column's result as
//   acc = fma(sum, d, acc)              then, q4 only,   acc = fma(m, sum_k x_k, acc)
// with sum_k x_k summed in K order. On AVX2 a vector holds the four chains of two columns, so a quad of the
// interleaved layout widens with plain byte-to-float conversions, and two rows (four where AVX-512's 32 vector
// registers hold their chains) share each widened quad: the same operations per lane either way.

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "qmatmul.h"
#include "parallel.h"

namespace statelm::qmatmul {
namespace {

// Per row and block, the block's activations summed in K order (the factor of a q4 block's min).
std::vector<float> block_sums(const at::Tensor& x) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock, stride = x.stride(0);
  const float* in = x.data_ptr<float>();
  std::vector<float> sums(rows * blocks);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      float sum = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) sum += in[m * stride + b * kBlock + i];
      sums[m * blocks + b] = sum;
    }
  }
  return sums;
}

struct Activations {
  const float* x;
  int64_t stride;
  const float* sums;  // q4 only
  int64_t blocks;
};

#if defined(STATELM_QMATMUL_AVX2)
// Quad t of a block (values 4t..4t+3 of 8 columns, bytes [column][value]) as 4 vectors of 2 columns x 4 values.
template <bool kSigned>
inline void widen_quad(__m256i bytes, __m256 out[4]) {
  const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
  const __m128i parts[4] = {low, _mm_unpackhi_epi64(low, low), high, _mm_unpackhi_epi64(high, high)};
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(parts[j]) : _mm256_cvtepu8_epi32(parts[j]));
  }
}

// Quad t's bytes: q8 as stored; q4 the low nibbles (t < 4) or high nibbles (t >= 4) of stored quad t % 4.
template <bool kQ4>
inline __m256i quad_bytes(const uint8_t* values, int t) {
  if constexpr (kQ4) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + (t % 4) * 32));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    return t < 4 ? _mm256_and_si256(bytes, mask) : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + t * 32));
  }
}

// The block sums of R rows (m, m+1): lane (column c, chain i) sums q[4t+i][c] * x[4t+i] over t in order; the
// chains are then added (c0 + c1) + (c2 + c3) per column by two horizontal adds, and put in column order.
template <bool kQ4, int R>
inline void block_sums_of_rows(const uint8_t* values, const Activations& a, int64_t m, int64_t b, __m256* sums) {
  __m256 chains[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_setzero_ps();
  }
  for (int t = 0; t < 8; ++t) {
    __m256 w[4];  // w[j]: columns 2j and 2j+1, values 4t..4t+3 each
    widen_quad<!kQ4>(quad_bytes<kQ4>(values, t), w);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a.x + (m + r) * a.stride + b * kBlock + 4 * t));
      for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_fmadd_ps(x, w[j], chains[r][j]);
    }
  }
  const __m256i column_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < R; ++r) {
    const __m256 pairs01 = _mm256_hadd_ps(chains[r][0], chains[r][1]);  // columns 0,2 (low) and 1,3 (high)
    const __m256 pairs23 = _mm256_hadd_ps(chains[r][2], chains[r][3]);  // columns 4,6 and 5,7
    sums[r] = _mm256_permutevar8x32_ps(_mm256_hadd_ps(pairs01, pairs23), column_order);
  }
}
#endif

// Rows m0..m0+rows-1 of one group of 8 columns.
template <bool kQ4>
void output_tile(const Weights& w, const Activations& a, int64_t m0, int64_t rows, int64_t group, float* y) {
#if defined(STATELM_QMATMUL_AVX2)
  __m256 acc[kRowsPerTile];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t at = w.at(group, b);
    const uint8_t* values = w.values + at * w.block_bytes();
    __m256 sums[kRowsPerTile];
    int64_t r = 0;
#if defined(__AVX512F__)
    // 32 vector registers: four rows share each widened quad (sixteen chains in flight)
    for (; r + 4 <= rows; r += 4) block_sums_of_rows<kQ4, 4>(values, a, m0 + r, b, sums + r);
#endif
    for (; r < rows; r += 2) {  // two rows share each widened quad: eight chains in flight
      if (r + 1 < rows) {
        block_sums_of_rows<kQ4, 2>(values, a, m0 + r, b, sums + r);
      } else {
        block_sums_of_rows<kQ4, 1>(values, a, m0 + r, b, sums + r);
      }
    }
    const __m256 scales = _mm256_loadu_ps(w.scales + at * kGroup);
    for (int64_t r = 0; r < rows; ++r) {
      acc[r] = _mm256_fmadd_ps(sums[r], scales, acc[r]);
      if constexpr (kQ4) {
        const __m256 mins = _mm256_loadu_ps(w.mins + at * kGroup);
        acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.sums[(m0 + r) * a.blocks + b]), acc[r]);
      }
    }
  }
  alignas(32) float lanes[kGroup];
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_store_ps(lanes, acc[r]);
    store_columns(lanes, y + (m0 + r) * w.n, group * kGroup, w.n);
  }
#else
  float acc[kRowsPerTile][kGroup] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t at = w.at(group, b);
    const uint8_t* values = w.values + at * w.block_bytes();
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = a.x + (m0 + r) * a.stride + b * kBlock;
      for (int64_t c = 0; c < kGroup; ++c) {
        float chains[4] = {};
        for (int64_t k = 0; k < kBlock; ++k) {
          const int64_t t = k / 4, i = k % 4;
          const uint8_t byte = values[(kQ4 ? t % 4 : t) * 32 + c * 4 + i];
          const float q = kQ4 ? static_cast<float>(t < 4 ? byte & 0x0F : byte >> 4)
                              : static_cast<float>(static_cast<int8_t>(byte));
          chains[i] = std::fma(q, x[k], chains[i]);
        }
        const float sum = (chains[0] + chains[1]) + (chains[2] + chains[3]);
        acc[r][c] = std::fma(sum, w.scales[at * kGroup + c], acc[r][c]);
        if constexpr (kQ4) acc[r][c] = std::fma(w.mins[at * kGroup + c], a.sums[(m0 + r) * a.blocks + b], acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_columns(acc[r], y + (m0 + r) * w.n, group * kGroup, w.n);
#endif
}

}  // namespace

void matmul_float_activations(const at::Tensor& x, const Weights& w, float* y) {
  const std::vector<float> sums = w.q4 ? block_sums(x) : std::vector<float>();
  const Activations a{x.data_ptr<float>(), x.stride(0), sums.data(), w.blocks};
  const int64_t rows = x.size(0), groups = (w.n + kGroup - 1) / kGroup;
  statelm::parallel_for(groups, kGroupGrain, [&](int64_t begin, int64_t end) {
    for_each_tile(rows, begin, end, [&](int64_t m0, int64_t tile, int64_t group) {
      if (w.q4) {
        output_tile<true>(w, a, m0, tile, group, y);
      } else {
        output_tile<false>(w, a, m0, tile, group, y);
      }
    });
  });
}

}  // namespace statelm::qmatmul
