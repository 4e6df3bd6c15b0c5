// The quantized matmul with float32 activations: the float model's arithmetic on the packed weights.
//
// Per row, column and block: the 32 products q_k * x_k are summed in four chains (k mod 4, each in K order),
// the chains are added as (c0 + c1) + (c2 + c3), and the block joins the column's result as
//   acc = fma(sum, d, acc)              then, q4 only,   acc = fma(m, sum_k x_k, acc)
// with sum_k x_k summed in K order. On AVX2 a vector holds the four chains of two columns, so a quad of the
// interleaved layout widens with plain byte-to-float conversions, and two rows share each widened quad. On
// AVX-512 a vector holds the chains of four columns and eight rows share each widened quad; the chains of a
// row pair are added by in-lane shuffles into one vector of both rows' 8 column sums. The operations per lane
// are the same in every build, so each build gives the scalar build's bits.

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

// Per row, the four chains of each column added (c0 + c1) + (c2 + c3) by two horizontal adds, in column order.
template <int R>
inline void column_sums(const __m256 chains[][4], __m256* sums) {
  const __m256i column_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < R; ++r) {
    const __m256 pairs01 = _mm256_hadd_ps(chains[r][0], chains[r][1]);  // columns 0,2 (low) and 1,3 (high)
    const __m256 pairs23 = _mm256_hadd_ps(chains[r][2], chains[r][3]);  // columns 4,6 and 5,7
    sums[r] = _mm256_permutevar8x32_ps(_mm256_hadd_ps(pairs01, pairs23), column_order);
  }
}

// The block sums of R rows (m, m+1): lane (column c, chain i) sums q[4t+i][c] * x[4t+i] over t in order; the
// chains are then added per column (column_sums).
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
  column_sums<R>(chains, sums);
}

// This thread's buffer of at least `count` vectors, kept across calls (a column group's widened blocks: written
// whole before they are read, so never cleared).
template <typename Vector>
Vector* widened_scratch(int64_t count) {
  thread_local std::vector<Vector> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}
#endif

#if defined(__AVX512F__)
constexpr int kWideRowsPerTile = 8;  // rows sharing each widened quad: 16 chain vectors of the 32 registers
constexpr int64_t kWidenOnceRows = 16;  // calls with this many rows widen each group's blocks once for all
constexpr int kWidenedTileRows = 12;     // rows of a tile on widened blocks: 24 chain vectors

// Quad t's 32 bytes as two vectors of 4 columns x 4 values: columns 0-3, then columns 4-7.
template <bool kSigned>
inline void widen_quad_wide(__m256i bytes, __m512 out[2]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  for (int h = 0; h < 2; ++h) {
    out[h] = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(halves[h]) : _mm512_cvtepu8_epi32(halves[h]));
  }
}

// Per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3], as AVX2's horizontal add.
inline __m512 add_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// An 8-lane vector in both halves of a 16-lane one.
inline __m512 both_halves(const float* lanes) {
  const __m512 low = _mm512_castps256_ps512(_mm256_loadu_ps(lanes));
  return _mm512_shuffle_f32x4(low, low, _MM_SHUFFLE(1, 0, 1, 0));
}

// A block's quads, widened in registers from its bytes, or read from the block's 16 vectors widened before.
struct BlockQuads {
  const uint8_t* values;
  const __m512* widened;  // quad t: widened[2t], widened[2t + 1]; null: widen from values
};

// The block sums of R rows from m: sums[p] holds rows m+2p (lanes 0-7) and m+2p+1 (lanes 8-15, a copy of
// row m+2p when R is odd and it is the last) in column order. Lane (column c, chain i) of a row's two chain
// vectors sums q[4t+i][c] * x[4t+i] over t in order; three pair additions make (c0 + c1) + (c2 + c3).
template <bool kQ4, int R, bool kWidened>
inline void block_sums_of_rows_wide(const BlockQuads& quads, const Activations& a, int64_t m, int64_t b, __m512* sums) {
  __m512 chains[R][2];
  for (int r = 0; r < R; ++r) chains[r][0] = chains[r][1] = _mm512_setzero_ps();
  for (int t = 0; t < 8; ++t) {
    __m512 w[2];
    if constexpr (kWidened) {
      w[0] = quads.widened[2 * t];
      w[1] = quads.widened[2 * t + 1];
    } else {
      widen_quad_wide<!kQ4>(quad_bytes<kQ4>(quads.values, t), w);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_broadcast_f32x4(_mm_loadu_ps(a.x + (m + r) * a.stride + b * kBlock + 4 * t));
      chains[r][0] = _mm512_fmadd_ps(x, w[0], chains[r][0]);
      chains[r][1] = _mm512_fmadd_ps(x, w[1], chains[r][1]);
    }
  }
  // lanes 4k..4k+3 of the last pair addition: first row's columns k and k+4, second row's columns k and k+4
  const __m512i column_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int p = 0; 2 * p < R; ++p) {
    const __m512 first = add_pairs(chains[2 * p][0], chains[2 * p][1]);
    const __m512 second = 2 * p + 1 < R ? add_pairs(chains[2 * p + 1][0], chains[2 * p + 1][1]) : first;
    sums[p] = _mm512_permutexvar_ps(column_order, add_pairs(first, second));
  }
}

// Rows m0..m0+R-1 of one group of 8 columns, two rows to a vector; with kWidened, from the group's blocks
// widened before (16 vectors a block).
template <bool kQ4, int R, bool kWidened = false>
void output_tile_wide(const Weights& w, const Activations& a, int64_t m0, int64_t group, float* y,
                      const __m512* widened = nullptr) {
  constexpr int kPairs = (R + 1) / 2;
  __m512 acc[kPairs];
  for (int p = 0; p < kPairs; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t at = w.at(group, b);
    __m512 sums[kPairs];
    const BlockQuads quads{w.values + at * w.block_bytes(), kWidened ? widened + b * 16 : nullptr};
    block_sums_of_rows_wide<kQ4, R, kWidened>(quads, a, m0, b, sums);
    const __m512 scales = both_halves(w.scales + at * kGroup);
    for (int p = 0; p < kPairs; ++p) acc[p] = _mm512_fmadd_ps(sums[p], scales, acc[p]);
    if constexpr (kQ4) {
      const __m512 mins = both_halves(w.mins + at * kGroup);
      for (int p = 0; p < kPairs; ++p) {
        const float* first = a.sums + (m0 + 2 * p) * a.blocks + b;
        const float second = 2 * p + 1 < R ? first[a.blocks] : first[0];
        const __m512 block_sums = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(first[0]), _mm512_set1_ps(second));
        acc[p] = _mm512_fmadd_ps(mins, block_sums, acc[p]);
      }
    }
  }
  alignas(64) float lanes[2 * kGroup];
  for (int p = 0; p < kPairs; ++p) {
    _mm512_store_ps(lanes, acc[p]);
    store_columns(lanes, y + (m0 + 2 * p) * w.n, group * kGroup, w.n);
    if (2 * p + 1 < R) store_columns(lanes + kGroup, y + (m0 + 2 * p + 1) * w.n, group * kGroup, w.n);
  }
}

template <bool kQ4>
void output_tile(const Weights& w, const Activations& a, int64_t m0, int64_t rows, int64_t group, float* y) {
  switch (rows) {
    case 8: output_tile_wide<kQ4, 8>(w, a, m0, group, y); break;
    case 7: output_tile_wide<kQ4, 7>(w, a, m0, group, y); break;
    case 6: output_tile_wide<kQ4, 6>(w, a, m0, group, y); break;
    case 5: output_tile_wide<kQ4, 5>(w, a, m0, group, y); break;
    case 4: output_tile_wide<kQ4, 4>(w, a, m0, group, y); break;
    case 3: output_tile_wide<kQ4, 3>(w, a, m0, group, y); break;
    case 2: output_tile_wide<kQ4, 2>(w, a, m0, group, y); break;
    default: output_tile_wide<kQ4, 1>(w, a, m0, group, y); break;
  }
}

// All rows of the groups [begin, end), each group's blocks widened once for all row tiles.
template <bool kQ4>
void widened_groups(const Weights& w, const Activations& a, int64_t rows, int64_t begin, int64_t end, float* y) {
  __m512* widened = widened_scratch<__m512>(w.blocks * 16);
  for (int64_t group = begin; group < end; ++group) {
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* values = w.values + w.at(group, b) * w.block_bytes();
      for (int t = 0; t < 8; ++t) widen_quad_wide<!kQ4>(quad_bytes<kQ4>(values, t), widened + b * 16 + 2 * t);
    }
    int64_t m0 = 0;
    for (; m0 + kWidenedTileRows <= rows; m0 += kWidenedTileRows) {
      output_tile_wide<kQ4, kWidenedTileRows, true>(w, a, m0, group, y, widened);
    }
    for (; m0 < rows; m0 += kWideRowsPerTile) output_tile<kQ4>(w, a, m0, std::min<int64_t>(kWideRowsPerTile, rows - m0), group, y);
  }
}
#else
constexpr int kWideRowsPerTile = kRowsPerTile;

#if defined(STATELM_QMATMUL_AVX2)
// Adds block b's sums of rows m0..m0+rows-1 to their accumulators: acc = fma(sum, d, acc), q4 then
// acc = fma(m, sum_k x_k, acc).
template <bool kQ4>
inline void add_block(const Weights& w, const Activations& a, int64_t at, int64_t m0, int64_t rows, int64_t b,
                      const __m256* sums, __m256* acc) {
  const __m256 scales = _mm256_loadu_ps(w.scales + at * kGroup);
  for (int64_t r = 0; r < rows; ++r) {
    acc[r] = _mm256_fmadd_ps(sums[r], scales, acc[r]);
    if constexpr (kQ4) {
      const __m256 mins = _mm256_loadu_ps(w.mins + at * kGroup);
      acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.sums[(m0 + r) * a.blocks + b]), acc[r]);
    }
  }
}

inline void store_rows(const __m256* acc, const Weights& w, int64_t m0, int64_t rows, int64_t group, float* y) {
  alignas(32) float lanes[kGroup];
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_store_ps(lanes, acc[r]);
    store_columns(lanes, y + (m0 + r) * w.n, group * kGroup, w.n);
  }
}

// Calls with at least this many rows widen each column group's blocks once for all of them (below, two rows
// share each quad widened in registers).
constexpr int64_t kWidenOnceRows = 8;
constexpr int kWidenedTileRows = 3;  // 12 chains of the 16 vector registers
constexpr int64_t kVectorsPerBlock = 32;  // 8 quads x 4 vectors of 2 columns x 4 values

// Every block of one column group widened: block b's quad t is widened[(b * 8 + t) * 4 + j], as widen_quad.
template <bool kQ4>
void widen_group(const Weights& w, int64_t group, __m256* widened) {
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* values = w.values + w.at(group, b) * w.block_bytes();
    for (int t = 0; t < 8; ++t) widen_quad<!kQ4>(quad_bytes<kQ4>(values, t), widened + (b * 8 + t) * 4);
  }
}

// Rows m0..m0+R-1 of one column group from its widened blocks: block_sums_of_rows's operations, lane for lane.
template <bool kQ4, int R>
void widened_tile(const Weights& w, const Activations& a, const __m256* widened, int64_t m0, int64_t group, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256 chains[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_setzero_ps();
    }
    const __m256* quads = widened + b * kVectorsPerBlock;
    for (int t = 0; t < 8; ++t) {
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a.x + (m0 + r) * a.stride + b * kBlock + 4 * t));
        for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_fmadd_ps(x, quads[t * 4 + j], chains[r][j]);
      }
    }
    __m256 sums[R];
    column_sums<R>(chains, sums);
    add_block<kQ4>(w, a, w.at(group, b), m0, R, b, sums, acc);
  }
  store_rows(acc, w, m0, R, group, y);
}

// All rows of the groups [begin, end), each group widened once.
template <bool kQ4>
void widened_groups(const Weights& w, const Activations& a, int64_t rows, int64_t begin, int64_t end, float* y) {
  __m256* widened = widened_scratch<__m256>(w.blocks * kVectorsPerBlock);
  for (int64_t group = begin; group < end; ++group) {
    widen_group<kQ4>(w, group, widened);
    int64_t m0 = 0;
    for (; m0 + kWidenedTileRows <= rows; m0 += kWidenedTileRows) {
      widened_tile<kQ4, kWidenedTileRows>(w, a, widened, m0, group, y);
    }
    if (rows - m0 == 2) widened_tile<kQ4, 2>(w, a, widened, m0, group, y);
    if (rows - m0 == 1) widened_tile<kQ4, 1>(w, a, widened, m0, group, y);
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
    for (int64_t r = 0; r < rows; r += 2) {  // two rows share each widened quad: eight chains in flight
      if (r + 1 < rows) {
        block_sums_of_rows<kQ4, 2>(values, a, m0 + r, b, sums + r);
      } else {
        block_sums_of_rows<kQ4, 1>(values, a, m0 + r, b, sums + r);
      }
    }
    add_block<kQ4>(w, a, at, m0, rows, b, sums, acc);
  }
  store_rows(acc, w, m0, rows, group, y);
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
#endif

}  // namespace

void matmul_float_activations(const at::Tensor& x, const Weights& w, float* y) {
  const std::vector<float> sums = w.q4 ? block_sums(x) : std::vector<float>();
  const Activations a{x.data_ptr<float>(), x.stride(0), sums.data(), w.blocks};
  const int64_t rows = x.size(0), groups = (w.n + kGroup - 1) / kGroup;
#if defined(STATELM_QMATMUL_AVX2)
  if (rows >= kWidenOnceRows) {
    statelm::parallel_for(groups, 1, [&](int64_t begin, int64_t end) {
      if (w.q4) {
        widened_groups<true>(w, a, rows, begin, end, y);
      } else {
        widened_groups<false>(w, a, rows, begin, end, y);
      }
    });
    return;
  }
#endif
  statelm::parallel_for(groups, kGroupGrain, [&](int64_t begin, int64_t end) {
    for_each_tile<kWideRowsPerTile>(rows, begin, end, [&](int64_t m0, int64_t tile, int64_t group) {
      if (w.q4) {
        output_tile<true>(w, a, m0, tile, group, y);
      } else {
        output_tile<false>(w, a, m0, tile, group, y);
      }
    });
  });
}

}  // namespace statelm::qmatmul
