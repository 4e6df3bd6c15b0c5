// A tile: the weights of kTileColumns output columns over a chunk of K, decoded from their blocks into the layout
// the matmul kernels read (gguf_tiles.cpp builds it; gguf_matmul_int.cpp and gguf_matmul_float.cpp read it).

#pragma once

#include <cstdint>

#include "gguf_matmul.h"

namespace statelm::gguf {

// SIMD builds: levels as uint8 q + offset in [block][8 quads][kTileColumns][4] (a block is 32 values along K, a
// quad 4 of them); the scalar build: signed q in [kTileColumns][values]. Scales and mins: [groups][kTileColumns].
// A 256-value format's tile also holds its integer scales s_g and mins m_g ([groups][kTileColumns]) and each
// superblock's d and -dmin ([superblocks][kTileColumns]), which its int8 arithmetic takes.
struct Int8Tile {
  const uint8_t* levels;
  const float* scales;
  const float* mins;  // formats with a minimum
  const Format* format;
  int offset;  // levels hold q + offset (0 in the scalar build), as bytes xor flip
  int64_t blocks;
  const int32_t* sub_scales = nullptr;
  const int32_t* sub_mins = nullptr;
  const float* d = nullptr;
  const float* neg_dmin = nullptr;
  // Bytes before each pair of blocks' levels: block b's lie at levels + b * kTileColumns * kBlock + (b / 2 + 1) *
  // pair_header. 0 for a built tile; an interleaved Q8_0 tile read in place (int8_tile_in_place) skips its d's.
  int64_t pair_header = 0;
  // Each level byte is (q + offset) xor flip: 0 for a built tile; 0x80 for Q8_0 read in place, whose bytes are the
  // file's signed q (q + 128 with its top bit flipped).
  uint8_t flip = 0;
};

// The tile of columns [column, column + kTileColumns) of part, values [first, first + values) along K, in this
// thread's scratch at `slot` (< kPanelTiles; valid until the next call on the thread for that slot).
Int8Tile build_int8_tile(const Part& part, int64_t column, int64_t first, int64_t values, int64_t slot);

// The tile the integer arithmetics read (AVX2 build): an interleaved Q8_0 part's levels in place (signed: flip),
// only its scales converted into this thread's scratch at `slot`, so that 5-31 int8 rows skip copying the levels into
// a tile and panels widen them (widen_int16) from where they lie; any other part or build: build_int8_tile's.
Int8Tile int8_tile_in_place(const Part& part, int64_t column, int64_t first, int64_t values, int64_t slot);

// Rows too few to amortise a tile (stream_rows_of the format at most): the int8 arithmetic of x's rows on the tile's
// columns, each decoded quad multiplied at once (acc [rows][kTileColumns] as int_tile_chunk's), asking for `ahead`
// as it goes. False where the format, the build or the row count has no such path (then build a tile).
constexpr int64_t kStreamRows = 4;
// The most rows a format streams: kStreamRows, but two for Q4_K, Q5_K and Q6_K in the VNNI build, whose streamed
// loops at three and four rows (a superblock's sums beside sixteen words a load) read from memory at 0.5-0.9x the
// rate of a built tile's (the AVX2 build's at 1.0-1.4x).
constexpr int64_t stream_rows_of(int64_t type) {
  return kAskAhead && (type == kQ4_K || type == kQ5_K || type == kQ6_K) ? 2 : kStreamRows;
}
// Whether one streamed row asks ahead (in the VNNI build, which asks from two rows on): Q6_K, whose one-row
// arithmetic (six-bit levels from two fields, a scale every 16 values) takes as long as its bytes take to arrive,
// so that memory idles unless asked (1.25-1.5x at one row), and the 32-value formats with a minimum or a fifth bit
// (one row from memory asking: Q4_1 and Q5_1 1.3-1.6x, Q5_0 1.0-1.1x); the others are bound by memory and only
// lose by it. The AVX2 build asks for each Q6_K superblock's lines at its start instead (ask_unit in gguf_tiles.cpp).
constexpr bool asks_ahead_at_one_row(int64_t type) {
  return kAskAhead && (type == kQ6_K || type == kQ4_1 || type == kQ5_0 || type == kQ5_1);
}
bool stream_int8_rows(const Part& part, int64_t column, int64_t first, int64_t values, const IntRows& x,
                      const Ahead& ahead, float* acc);
// Whether stream_int8_rows serves `rows` rows of the format (it has a tile builder, in SIMD builds, and they are
// stream_rows_of it at most).
bool streams(const Format& f, int64_t rows);

// The tile's levels as int16 q (offset removed), [block][16 pairs][kTileColumns][2], in SIMD builds (in scratch at
// `slot`, as build_int8_tile's; a tile read in place, the AVX2 build's only, too); the scalar build's tile as it is.
Int8Tile widen_int16(const Int8Tile& tile, int64_t slot);

// The tile's weights dequantized as gguf-py dequantizes them (w = S*q, then + O): [values / 4][kTileColumns][4].
const float* dequantize_tile(const Int8Tile& tile);

// Interleaved block matrices (gguf_interleave): the rows' bytes rearranged, once at load, into tiles of
// kTileColumns rows, each tile its rows' 32-bit words [word][kTileColumns], the last tile padded with zero rows.
// A few formats' blocks are stored a word or half a word larger, and Q4_0, IQ4_NL and Q8_0 blocks in pairs with
// their d's first (gguf_tiles.cpp: stored_block), so that the fields loaded as vectors start on a word. The tile
// builders then load the vectors they would otherwise transpose out of the rows: the same values in the same
// order, so every result is bit-identical to the rows read in place.
// interleavable: formats with a tile builder, in SIMD builds, where rows of row_bytes fit the stored layout.
bool interleavable(const Format& f, int64_t row_bytes);
// The bytes of an interleaved part's chunk (empty for a part in place).
Ahead chunk_bytes(const Part& part, int64_t column, int64_t first, int64_t values);
int64_t interleaved_row_bytes(const Format& f, int64_t row_bytes);
// The bytes a row of the file holds whose interleaved row holds interleaved_bytes (0 for a format never interleaved).
int64_t file_row_bytes(const Format& f, int64_t interleaved_bytes);
// Row `row` of an interleaved block matrix (tiles: its first byte) as the file stores it: row_bytes bytes into out.
void gather_row(const Format& f, const uint8_t* tiles, int64_t row, int64_t row_bytes, uint8_t* out);
void interleave_blocks(const Format& f, const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t stride,
                       uint8_t* out);

}  // namespace statelm::gguf
