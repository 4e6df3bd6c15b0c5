// The matmul on GGUF block matrices read in place (gguf_matmul.cpp), and its three arithmetics.
//
// y [M, N] = x [M, K] @ W.T, W one or more row-major block matrices as the GGUF file stores them (their rows are
// output columns; a fused projection such as q, k and v is several matrices, each in its own format). Threads
// split the output columns into tiles of kTileColumns; for each tile and chunk of K, the blocks of its columns are
// decoded (gguf_formats.h) and laid out in a small per-thread buffer so that one vector load holds a few values of
// every column of the tile, and every row of x passes over that buffer. The arithmetic of an output element never
// depends on M, on the tile or on the thread, and the scalar, AVX2 and AVX-512 builds make the same operations:
//
// - float (x in float32): w = S*q (+ O) as gguf-py dequantizes it, then four chains per output element, chain i
//   summing fma(w_k, x_k) over k = i mod 4 in K order, and (c0 + c1) + (c2 + c3) at the end.
// - int8 / int16 (x quantized per row and block of 32 values: q = round(x * L / amax), dx = amax / L with L = 127
//   or 32767): per group g of the format (16 or 32 values) the integer I_g = sum_k q_w * q_x is exact, and in K
//   order   acc = fma(float(I_g), S_g * dx, acc),   then with a minimum   acc = fma(O_g, sx_g, acc)
//   where sx_g = dx * float(X_g), X_g the sum of q_x over the group;
// - int8 on a 256-value format (the K-quants, IQ4_XS: S_g = d * s_g and O_g = -(dmin * m_g), s_g and m_g small
//   integers), x quantized per row and 256 values (one amax and dx a superblock): per superblock the integers
//   T = sum_g s_g * I_g and, with a minimum, M = sum_g m_g * X_g, exact in int32, then
//   acc = fma(float(T), d * dx, acc),   with a minimum   acc = fma(float(M), -dmin * dx, acc)
//   (one float step a superblock instead of one a group, as llama.cpp's K-quant dot products take);
// so a row's result is the same in any batch, and the same on every CPU class.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_formats.h"

#if defined(__AVX2__) && defined(__FMA__)
#define STATELM_GGUF_AVX2 1
#include <immintrin.h>
#endif
#if defined(STATELM_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STATELM_GGUF_VNNI 1
#endif

namespace statelm::gguf {

constexpr int64_t kBlock = 32;  // activation quantization block, and the unit of the tile layouts

enum class Arithmetic : int64_t { kFloat = 0, kInt8 = 1, kInt16 = 2 };

#if defined(STATELM_GGUF_VNNI)
constexpr int64_t kTileColumns = 16;
#else
constexpr int64_t kTileColumns = 8;
#endif

// One block matrix of the call: `rows` output columns from `first_column` on, each row `row_stride` bytes apart.
// Interleaved (gguf_tiles.h): data holds tiles of kTileColumns rows of row_stride bytes each (whole words).
struct Part {
  const uint8_t* data;
  int64_t row_stride;
  const Format* format;
  int64_t rows;
  int64_t first_column;
  bool interleaved = false;
};

// Whether the int8 arithmetic sums the format's superblocks in integers (gguf_matmul.h's second int8 form).
inline bool sums_superblocks(const Format& f) { return f.superblock != nullptr; }
constexpr int64_t kSuperblock = 256;

// Whether the AVX2 build (not VNNI) multiplies int8 rows of a panel (kPanelRows rows or more) in int16: the wide
// 32-value formats (Q8_0, IQ4_NL), each tile widened once and the rows' levels taken as int16 pairs
// (IntRows::grouped_pairs), one vpmaddwd a pair and row. Their int8 form takes vpsignb + vpmaddubsw + vpmaddwd a
// quad and row, all three on the two ports that multiply; the int16 form one there and its add on any. Same exact
// sums, same float steps: the same bits.
inline bool widens_int8(const Format& f) {
#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
  return !f.narrow && !sums_superblocks(f);
#else
  (void)f;
  return false;
#endif
}

// A type id with this bit names an interleaved block matrix of that format.
constexpr int64_t kInterleavedType = 1 << 8;

// x quantized per row and block of 32 (int8 or int16 values) with its per-block scales and per-group sums; for the
// 256-value formats' int8 arithmetic, per 256 values (each block of a superblock then holds the superblock's dx).
struct IntRows {
  int64_t k = 0;
  int64_t rows = 0;
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  std::vector<float> dx;        // [M, K/32]
  std::vector<int32_t> sums16;  // [M, K/16]: sum of the levels over each 16 values
  std::vector<int32_t> sums32;  // [M, K/32]
  std::vector<float> sx16;      // [M, K/16]: dx * float(sums16)
  std::vector<float> sx32;      // [M, K/32]
  // span 256: sums16 and sums32 two by two, each pair one word of two int16 (the first low): [M, K/32], [M, K/64]
  std::vector<int32_t> pairs16;
  std::vector<int32_t> pairs32;
  const int32_t* level_pairs(int64_t m, int64_t group, int64_t size) const {
    return size == 16 ? &pairs16[m * (k / 32) + group / 2] : &pairs32[m * (k / 64) + group / 2];
  }
  // SIMD builds: the levels again as 32-bit words (4 int8 or 2 int16 values) by groups of kGroupRows rows, word by
  // word ([M / kGroupRows][word][kGroupRows], rows past M zero), so that a tile's rows read one pointer at fixed
  // offsets (rows_tile).
  static constexpr int64_t kGroupRows = 8;
  std::vector<int32_t> grouped;
  // The AVX2 build's int8 levels again as int16 pairs (k / 2 words a row), grouped as `grouped`, for the formats
  // whose tiles it widens (widens_int8).
  std::vector<int32_t> grouped_pairs;

  int32_t sum(int64_t m, int64_t group, int64_t size) const {
    return size == 16 ? sums16[m * (k / 16) + group] : sums32[m * (k / 32) + group];
  }
  float sx(int64_t m, int64_t group, int64_t size) const {
    return size == 16 ? sx16[m * (k / 16) + group] : sx32[m * (k / 32) + group];
  }
  float scale(int64_t m, int64_t block) const { return dx[m * (k / kBlock) + block]; }
};

struct FloatRows {
  const float* x;
  int64_t stride;
  int64_t rows;
};

// Values per chunk of K that a tile is decoded for at a time (a multiple of every format's block).
constexpr int64_t kChunkValues = 512;

// Bytes the kernels ask into cache a share at a time while they work on a chunk (the next chunk's): spread over
// the chunk's blocks, the requests never stall the arithmetic at once. The VNNI build's int8 and int16 kernels ask
// (1.2-1.7x at 2-16 int8 rows, 2-5% at a prompt chunk's 64 int16 rows); AVX2's only where a tile is built for rows
// too few for panels (kSpreadRowsBelow).
#if defined(STATELM_GGUF_VNNI)
constexpr bool kAskAhead = true;
#else
constexpr bool kAskAhead = false;
#endif
struct Ahead {
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
  // The bytes spread over a chunk of `blocks` blocks: each block asks for its share of whole lines, found by a
  // multiplication (a division a block cost a one-row loop a good part of its time).
  struct Shares {
    const uint8_t* data;
    int64_t bytes, per_block;
    void ask(int64_t block) const {
      const int64_t end = std::min(bytes, (block + 1) * per_block);
      for (int64_t at = block * per_block; at < end; at += 64) __builtin_prefetch(data + at, 0, 2);
    }
  };
  Shares shares(int64_t blocks) const { return {data, bytes, (bytes + blocks * 64 - 1) / (blocks * 64) * 64}; }
  void all() const { shares(1).ask(0); }
};

// Tiles whose int kernels one pass of the rows runs (a panel), each group of kGroupRows rows through all of them
// while its activations are in L1, where kPanelRows rows or more: the AVX2 build, where a prompt's rows read from
// L2 or L3 once a tile cost its kernel a sixth (1.3x the cycles in int16; VNNI's 16 columns a tile read a word of
// activations half as often). Fewer rows keep a tile at a time: its next chunk is asked for while its rows run
// (multiply), which a panel's other tiles would miss (8 rows: 1.25x slower in panels).
#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
constexpr int64_t kPanelTiles = 8;
#else
constexpr int64_t kPanelTiles = 1;
#endif
constexpr int64_t kPanelRows = 32;
// The AVX2 build's tile kernels ask a share each block for fewer rows than this (and more than the few rows
// streamed without a tile): the 1B Q8_0 file's projections at 5, 8 and 16 int8 rows 1.08-1.12x over asking for the
// whole chunk at once, Q4_K_M's equal. Panels ask at once: their two-tile kernel does not ask, and a share each block
// of the first tile only lost (256 rows of Q8_0 1.1x slower).
#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
constexpr int64_t kSpreadRowsBelow = kPanelRows;
#else
constexpr int64_t kSpreadRowsBelow = 0;
#endif

// Adds the contribution of values [first, first + values) of `tiles` tiles of columns from `column` on (a panel,
// kPanelTiles at most) to acc, their running results one after another: int kinds [M, kTileColumns] a tile
// (gguf_matmul_int.cpp), float [M, kTileColumns, 4] chains (one tile). The VNNI build's kernels ask for `ahead` as
// they go.
void int_tile_chunk(const Part& part, int64_t column, int64_t tiles, int64_t first, int64_t values, const IntRows& x,
                    bool int16, const Ahead& ahead, float* acc);
void float_tile_chunk(const Part& part, int64_t column, int64_t first, int64_t values, const FloatRows& x,
                      float* acc);

// Per-thread scratch of at least `count` elements, kept across calls (written before read, never cleared).
template <typename T, int kSlot>
T* scratch(int64_t count) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

}  // namespace statelm::gguf
