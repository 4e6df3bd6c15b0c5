// The float32 arithmetic of the GGUF matmul (see gguf_matmul.h): the dequantized weights times x, in four chains.
//
// A tile's weights are dequantized as gguf-py does (w = S*q, then + O) into [quad][column][4 values], so that on
// AVX-512 a vector holds the four chains of four columns (16 columns in four vectors) and on AVX2 those of two
// (8 columns in four); a row's four activations of the quad are broadcast to every column. Lane (column c, chain
// i) accumulates w_k * x_k for k = i mod 4 in K order in every build; the chains are added once, at the end.

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "gguf_matmul.h"
#include "gguf_tiles.h"

namespace statelm::gguf {
namespace {

constexpr int64_t W = kTileColumns;

#if defined(STATELM_GGUF_VNNI)
constexpr int kRowsPerTile = 6;  // 24 chain vectors of the 32 registers

template <int R>
void rows_tile(const float* tile, int64_t quads, const FloatRows& x, int64_t m0, int64_t first, float* acc) {
  __m512 chains[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) chains[r][j] = _mm512_loadu_ps(acc + ((m0 + r) * W + 4 * j) * 4);
  }
  for (int64_t t = 0; t < quads; ++t) {
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(tile + (t * W + 4 * j) * 4);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_broadcast_f32x4(_mm_loadu_ps(x.x + (m0 + r) * x.stride + first + 4 * t));
      for (int j = 0; j < 4; ++j) chains[r][j] = _mm512_fmadd_ps(xs, w[j], chains[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + ((m0 + r) * W + 4 * j) * 4, chains[r][j]);
  }
}
#elif defined(STATELM_GGUF_AVX2)
constexpr int kRowsPerTile = 3;  // 12 chain vectors of the 16 registers

template <int R>
void rows_tile(const float* tile, int64_t quads, const FloatRows& x, int64_t m0, int64_t first, float* acc) {
  __m256 chains[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_loadu_ps(acc + ((m0 + r) * W + 2 * j) * 4);
  }
  for (int64_t t = 0; t < quads; ++t) {
    __m256 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(tile + (t * W + 2 * j) * 4);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.x + (m0 + r) * x.stride + first + 4 * t));
      for (int j = 0; j < 4; ++j) chains[r][j] = _mm256_fmadd_ps(xs, w[j], chains[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + ((m0 + r) * W + 2 * j) * 4, chains[r][j]);
  }
}
#endif

void run_rows(const float* tile, int64_t values, const FloatRows& x, int64_t first, float* acc) {
#if defined(STATELM_GGUF_AVX2)
  for (int64_t m0 = 0; m0 < x.rows; m0 += kRowsPerTile) {
    const auto tile_rows = [&](auto rows) {
      rows_tile<decltype(rows)::value>(tile, values / 4, x, m0, first, acc);
    };
    const int64_t rows = std::min<int64_t>(kRowsPerTile, x.rows - m0);
    if constexpr (kRowsPerTile == 6) {
      switch (rows) {
        case 6: tile_rows(std::integral_constant<int, 6>()); continue;
        case 5: tile_rows(std::integral_constant<int, 5>()); continue;
        case 4: tile_rows(std::integral_constant<int, 4>()); continue;
        default: break;
      }
    }
    switch (rows) {
      case 3: tile_rows(std::integral_constant<int, 3>()); break;
      case 2: tile_rows(std::integral_constant<int, 2>()); break;
      default: tile_rows(std::integral_constant<int, 1>()); break;
    }
  }
#else
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t c = 0; c < W; ++c) {
      float* chains = acc + (r * W + c) * 4;
      for (int64_t k = 0; k < values; ++k) {
        chains[k % 4] = std::fma(tile[(k / 4 * W + c) * 4 + k % 4], x.x[r * x.stride + first + k], chains[k % 4]);
      }
    }
  }
#endif
}

}  // namespace

void float_tile_chunk(const Part& part, int64_t column, int64_t first, int64_t values, const FloatRows& x,
                      float* acc) {
  run_rows(dequantize_tile(build_int8_tile(part, column, first, values, 0)), values, x, first, acc);
}

}  // namespace statelm::gguf
