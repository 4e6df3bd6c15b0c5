// Shared by the quantized matmul's op (qmatmul.cpp) and its two paths (qmatmul_float.cpp, qmatmul_int8.cpp).
//
// Weights (see statelm/kernels/quant.py), with a float32 scale d (and, q4, a min m) per block of 32 along K:
//   q8: int8 values,        w = d*q       (GGUF Q8_0; other GGUF types re-packed)
//   q4: nibbles 0..15,      w = d*q + m   (GGUF Q4_0 with m = -8d, and Q4_1)
// laid out in groups of 8 output columns so that one 32-byte load holds 4 consecutive values of each of 8
// columns: q8 values [N/8, K/32, 8 quads, 8 columns, 4], q4 values [N/8, K/32, 4 quads, 8 columns, 4] whose
// low nibbles are a block's values 0..15 and high nibbles its values 16..31; scales and mins [N/8, K/32, 8].
// Vector lanes then line up with output columns: no horizontal sums, and a column's scale is a lane.
//
// Batch invariance, both paths: a row's result is computed by the same float operations whatever the number of
// rows, their tile or the thread count (threads split N only), and the scalar build does the same operations as
// the AVX2 build (fused multiply-adds included), so a row's result never depends on its batch.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#define STATELM_QMATMUL_AVX2 1
#include <immintrin.h>
#endif

namespace statelm::qmatmul {

constexpr int64_t kBlock = 32;          // values per quantization block, along K
constexpr int64_t kGroup = 8;           // output columns interleaved together
constexpr int kRowsPerTile = 4;         // activation rows sharing each loaded weight block
constexpr int64_t kGroupsPerChunk = 4;  // column groups kept hot in L1 while every row tile passes over them
constexpr int64_t kGroupGrain = 2;      // column groups per thread task

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

// The 8 columns of a row's result, or those of them that exist.
inline void store_columns(const float* lanes, float* y, int64_t col, int64_t n) {
  std::memcpy(y + col, lanes, sizeof(float) * std::min<int64_t>(kGroup, n - col));
}

// Runs tile(m0, rows, group) over row tiles of at most kTileRows rows and the groups [begin, end) in steps of
// kGroupStep (a tile may take that many groups from `group`), a few groups at a time so that their weights stay
// in L1 while every row tile passes over them.
template <int kTileRows = kRowsPerTile, int64_t kGroupStep = 1, typename Tile>
void for_each_tile(int64_t rows, int64_t begin, int64_t end, const Tile& tile) {
  for (int64_t g0 = begin; g0 < end; g0 += kGroupsPerChunk) {
    const int64_t g1 = std::min(end, g0 + kGroupsPerChunk);
    for (int64_t m0 = 0; m0 < rows; m0 += kTileRows) {
      for (int64_t group = g0; group < g1; group += kGroupStep) {
        tile(m0, std::min<int64_t>(kTileRows, rows - m0), group);
      }
    }
  }
}

// y [M, N] = x [M, K] @ W.T with x in float32 (qmatmul_float.cpp).
void matmul_float_activations(const at::Tensor& x, const Weights& w, float* y);

// y [M, N] = x [M, K] @ W.T with x quantized to int8 per row and block of 32 (qmatmul_int8.cpp).
void matmul_int8_activations(const at::Tensor& x, const Weights& w, float* y);

}  // namespace statelm::qmatmul
