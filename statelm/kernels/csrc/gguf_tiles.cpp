// Builds a tile's int8 layout straight from the blocks of its columns (see gguf_tiles.h).
//
// Every column's bytes are loaded as they lie in its row, one vector per column, and the vectors are transposed
// in registers (16 x 16 or 8 x 8 32-bit words), so that vector j holds word j of every column: a quad of four
// levels per column, or a scale field per column. From there the format's unpacking (nibbles, high bits, the
// IQ4 table) works on whole vectors, lanes being columns, and each result is one quad of the tile. Formats
// without a builder here (Q2_K, Q3_K, Q5_0, Q5_1), and the scalar build, decode block by block
// (gguf_formats.cpp) and interleave.

#include "gguf_tiles.h"

#include "gguf_simd.h"
#include "parallel.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace statelm::gguf {
namespace {

constexpr int64_t W = kTileColumns;

struct TileBuffers {
  uint8_t* levels;
  float* scales;
  float* mins;
  int32_t* sub_scales;  // 256-value formats (Int8Tile)
  int32_t* sub_mins;
  float* d;
  float* neg_dmin;
};

// The chunk's first block in each column's row: base + c * stride. Columns past the part's last read the last
// one's bytes (their results are never stored), so that every load is unconditional.
struct Rows {
  const uint8_t* base;
  int64_t stride;
  int64_t columns;  // real ones
  const uint8_t* row(int64_t c) const { return base + std::min(c, columns - 1) * stride; }
  Rows at(int64_t offset) const { return {base + offset, stride, columns}; }
  template <int64_t kType>
  Rows as() const { return *this; }
};

Rows rows_of(const Part& part, int64_t column, int64_t first) {
  const uint8_t* base = part.data + column * part.row_stride + first / part.format->values * part.format->bytes;
  return {base, part.row_stride, std::min(kTileColumns, part.rows - column)};
}

// How a format's blocks lie in an interleaved row, so that every field the builders load as vectors starts on a
// word. Single blocks: `stored` bytes each (whole words), the block's last `tail` bytes first, then padding, then
// the rest (Q6_K: its high bits, scales and d, read before its low bits, lie in the order the VNNI build reads
// them). Paired (blocks of a 2-byte d and then whole words: Q4_0, IQ4_NL, Q8_0): two blocks a unit, both d's first
// (one word), then each block's rest, so no padding; a row of an odd number of such blocks is not interleaved.
struct StoredBlock {
  int64_t bytes, stored, tail;
  bool paired = false;
  constexpr int64_t unit() const { return paired ? 2 * bytes : bytes; }
  constexpr int64_t unit_stored() const { return paired ? 2 * bytes : stored; }
  // Where byte `within` of a unit lies in the stored unit.
  constexpr int64_t position(int64_t within) const {
    if (paired) {
      const int64_t block = within / bytes, at = within % bytes;
      return at < 2 ? 2 * block + at : 4 + block * (bytes - 2) + at - 2;
    }
    return within >= bytes - tail ? within - (bytes - tail) : within + stored - bytes + tail;
  }
  // Where byte `at` of a row lies in its interleaved row.
  constexpr int64_t offset(int64_t at) const { return at / unit() * unit_stored() + position(at % unit()); }
};

constexpr StoredBlock stored_block(int64_t type) {
  switch (type) {
    case kQ4_0: case kIQ4_NL: return {18, 18, 0, true};  // d0, d1 | qs0[16] | qs1[16]
    case kQ8_0: return {34, 34, 0, true};                 // d0, d1 | qs0[32] | qs1[32]
    case kQ5_0: return {22, 24, 0};                       // padding, d, qh | qs[16]
    case kQ6_K: return {210, 212, 82};                    // qh[64] | scales[16] | d, padding | ql[128]
    case kQ4_1: return {20, 20, 0};
    case kQ5_1: return {24, 24, 0};
    case kQ4_K: return {144, 144, 0};
    case kQ5_K: return {176, 176, 0};
    case kIQ4_XS: return {136, 136, 0};
    default: return {0, 0, 0};  // no tile builder: not interleaved
  }
}

// The same columns of an interleaved part, as a format's builder reads them: the tile's words [word][kTileColumns]
// from the stored unit where the builder's offsets start (offsets in the file's layout; stored() maps one to the
// tile's). A builder's offsets are then constants of its unrolled loops, and so are their places in the tile (found
// at run time from the chunk's start, a one-row loop's address arithmetic and branches cost Q6_K a fifth of its rate).
template <int64_t kType>
struct TileWords {
  static constexpr StoredBlock kBlockLayout = stored_block(kType);
  const uint8_t* tile;
  // The words from `offset` on, a whole number of units (a K-quant's superblock).
  TileWords at(int64_t offset) const { return {tile + offset / kBlockLayout.unit() * kBlockLayout.unit_stored() * W}; }
  static constexpr int64_t stored(int64_t at) {
    if constexpr (!kBlockLayout.paired && kBlockLayout.stored == kBlockLayout.bytes) return at;
    return kBlockLayout.offset(at);
  }
};

// An interleaved tile before its format is known: as<type>() gives the format's TileWords from the chunk's first
// block (a chunk starts on a unit: kChunkValues is a whole number of paired blocks).
struct TileStart {
  const uint8_t* tile;
  int64_t first_block;
  template <int64_t kType>
  TileWords<kType> as() const {
    constexpr StoredBlock layout = stored_block(kType);
    return {tile + first_block * layout.bytes / layout.unit() * layout.unit_stored() * W};
  }
};

static_assert(kChunkValues / kBlock % 2 == 0, "a chunk starts on a pair of blocks");

TileStart tile_start_of(const Part& part, int64_t column, int64_t first) {
  return {part.data + column * part.row_stride, first / part.format->values};
}

// One column's blocks decoded into the tile's scales, mins and (256-value formats) integer scales and d's: column
// c of [groups][W] and [superblocks][W]; q [values].
void decode_column(const Format& f, const uint8_t* row, int64_t values, int64_t c, int8_t* q, const TileBuffers& out) {
  const int64_t per_block = f.values / f.group;
  for (int64_t b = 0; b < values / f.values; ++b) {
    if (f.superblock) {
      SuperblockScales sb;
      f.superblock(row + b * f.bytes, q + b * f.values, &sb);
      out.d[b * W + c] = sb.d;
      out.neg_dmin[b * W + c] = f.min ? 0.0f - sb.dmin : 0.0f;  // as the SIMD builders' negate()
      for (int64_t j = 0; j < per_block; ++j) {
        const int64_t g = b * per_block + j;
        out.sub_scales[g * W + c] = sb.scales[j];
        out.scales[g * W + c] = sb.d * static_cast<float>(sb.scales[j]);
        out.sub_mins[g * W + c] = f.min ? sb.mins[j] : 0;
        out.mins[g * W + c] = f.min ? -(sb.dmin * static_cast<float>(sb.mins[j])) : 0.0f;
      }
    } else {
      float scales[kMaxBlockValues / 16], mins[kMaxBlockValues / 16];
      f.decode(row + b * f.bytes, q + b * f.values, scales, mins);
      for (int64_t j = 0; j < per_block; ++j) {
        out.scales[(b * per_block + j) * W + c] = scales[j];
        out.mins[(b * per_block + j) * W + c] = f.min ? mins[j] : 0.0f;
      }
    }
  }
}

// The generic path: decode block by block, then interleave (and shift by the offset in SIMD builds). Columns past
// the part's last are zero.
Int8Tile decoded_tile(const Part& part, int64_t column, int64_t first, int64_t values, const TileBuffers& out) {
  const Format& f = *part.format;
  const int64_t groups = values / f.group, superblocks = f.superblock ? values / f.values : 0;
  int8_t* levels = scratch<int8_t, 0>(W * values);
  for (int64_t c = 0; c < W; ++c) {
    if (column + c < part.rows) {
      decode_column(f, part.data + (column + c) * part.row_stride + first / f.values * f.bytes, values, c,
                    levels + c * values, out);
      continue;
    }
    std::fill(levels + c * values, levels + (c + 1) * values, int8_t{0});
    for (int64_t g = 0; g < groups; ++g) {
      out.scales[g * W + c] = out.mins[g * W + c] = 0.0f;
      if (superblocks) out.sub_scales[g * W + c] = out.sub_mins[g * W + c] = 0;
    }
    for (int64_t b = 0; b < superblocks; ++b) out.d[b * W + c] = out.neg_dmin[b * W + c] = 0.0f;
  }
  const int64_t blocks = values / kBlock;
#if defined(STATELM_GGUF_AVX2)
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t u = 0; u < values / 4; ++u) {
      for (int64_t i = 0; i < 4; ++i) {
        out.levels[(u * W + c) * 4 + i] = static_cast<uint8_t>(levels[c * values + 4 * u + i] + f.offset);
      }
    }
  }
  return {out.levels, out.scales, out.mins, &f, f.offset, blocks, out.sub_scales, out.sub_mins, out.d, out.neg_dmin};
#else
  return {reinterpret_cast<const uint8_t*>(levels), out.scales, out.mins, &f, 0, blocks, out.sub_scales, out.sub_mins,
          out.d, out.neg_dmin};
#endif
}

#if defined(STATELM_GGUF_AVX2)
using namespace simd;

// out[j] = word j of kVecBytes bytes of each column at `offset` from its row.
__attribute__((always_inline)) inline void words(const Rows& rows, int64_t offset, V out[W]) {
  for (int64_t c = 0; c < W; ++c) out[c] = load(rows.row(c) + offset);
  transpose(out);
}

// Words 0..3 of 16 bytes of each column at `offset`: vector k holds columns k, 4 + k, ... one per 128 bits, so
// that a transpose within 128-bit lanes leaves the columns in order.
__attribute__((always_inline)) inline void four_words(const Rows& rows, int64_t offset, V out[4]) {
  V in[4];
  for (int k = 0; k < 4; ++k) {
#if defined(STATELM_GGUF_VNNI)
    in[k] = quarters(rows.row(k) + offset, rows.row(4 + k) + offset, rows.row(8 + k) + offset, rows.row(12 + k) + offset);
#else
    in[k] = halves(rows.row(k) + offset, rows.row(4 + k) + offset);
#endif
  }
#if defined(STATELM_GGUF_VNNI)
  const V t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
  const V t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
#else
  const V t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpackhi_epi32(in[0], in[1]);
  const V t2 = _mm256_unpacklo_epi32(in[2], in[3]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
#endif
}

// The 4 bytes at `offset` of every column of an interleaved tile as one vector (lane c: column c). Block sizes are
// even, so a field is 0 or 2 bytes past a word: then the high half of one word and the low half of the next.
template <int64_t kType>
__attribute__((always_inline)) inline V word_at(const TileWords<kType>& rows, int64_t offset) {
  const int64_t at = TileWords<kType>::stored(offset), word = at / 4;
  const V low = load(rows.tile + word * W * 4);
  if (at % 4 == 0) return low;
  const unsigned shift = static_cast<unsigned>(8 * (at % 4));
  return vor(srl(low, shift), sll(load(rows.tile + (word + 1) * W * 4), 32 - shift));
}

// `count` words from `offset` that lie together in the stored layout (a field): the first word's place found
// once, the rest follow it.
template <int64_t kType>
__attribute__((always_inline)) inline void field_words(const TileWords<kType>& rows, int64_t offset, int64_t count,
                                                       V* out) {
  const int64_t at = TileWords<kType>::stored(offset);
  if (at % 4 == 0) {
    for (int64_t j = 0; j < count; ++j) out[j] = load(rows.tile + (at / 4 + j) * W * 4);
  } else {
    for (int64_t j = 0; j < count; ++j) out[j] = word_at(rows, offset + 4 * j);
  }
}

// words(), four_words() and words_of_runs() of an interleaved tile: the same vectors, loaded rather than transposed.
// The builders ask words() for bytes of one field (nibbles, high bits), which the stored layout keeps together, so
// their place is found once for all W words (word by word, the place's arithmetic and checks cost Q4_K's one-row
// matmul a sixth of its rate).
template <int64_t kType>
__attribute__((always_inline)) inline void words(const TileWords<kType>& rows, int64_t offset, V out[W]) {
  field_words(rows, offset, W, out);
}

template <int64_t kType>
__attribute__((always_inline)) inline void four_words(const TileWords<kType>& rows, int64_t offset, V out[4]) {
  for (int64_t j = 0; j < 4; ++j) out[j] = word_at(rows, offset + 4 * j);
}

template <int64_t kType>
__attribute__((always_inline)) inline void words_of_runs(const TileWords<kType>& rows, int64_t offset, int64_t step,
                                                         int64_t size, int present, V out[W]) {
  const int64_t per_run = size / 4;
  for (int64_t run = 0; run < W / per_run; ++run) {
    if (run < present) {
      field_words(rows, offset + run * step, per_run, out + run * per_run);
    } else {
      for (int64_t j = 0; j < per_run; ++j) out[run * per_run + j] = zero();
    }
  }
}

// `count` (at most W) words of one field from `offset` (a K-quant's header or high bits, Q6_K's scales): an
// interleaved tile's place found once (field_words); file rows transposed as four_words() or words() give them.
template <int64_t kType>
__attribute__((always_inline)) inline void field_run(const TileWords<kType>& rows, int64_t offset, int64_t count,
                                                     V* out) {
  field_words(rows, offset, count, out);
}

__attribute__((always_inline)) inline void field_run(const Rows& rows, int64_t offset, int64_t count, V* out) {
  if (count == 4) {
    four_words(rows, offset, out);
  } else {
    words(rows, offset, out);
  }
}

// Asks for the lines of an interleaved tile's unit at once, ahead of their words' loads (file rows: nothing). The
// AVX2 build's one-row Q6_K loop loads its words as it works on them, so that a superblock's lines arrived one
// after another: asked at the superblock's start, the 1B Q4_K_M file's Q6_K parts (193 MB) took 5.5-6.3 ms of a
// step at two threads instead of 7.0-8.1. The VNNI build asks the next chunk ahead instead (kAskAhead); asking here
// too only lost, and Q4_K (whose words come eight at a time) gained nothing.
template <int64_t kType>
__attribute__((always_inline)) inline void ask_unit(const TileWords<kType>& rows) {
  if constexpr (!kAskAhead) {
    constexpr int64_t kBytes = TileWords<kType>::kBlockLayout.unit_stored() * W;
    for (int64_t at = 0; at < kBytes; at += 64) __builtin_prefetch(rows.tile + at, 0, 3);
  }
}
inline void ask_unit(const Rows&) {}

// Words of `present` (of kVecBytes / size) runs of `size` bytes per column, the p-th at offset + p * step.
__attribute__((always_inline)) inline void words_of_runs(const Rows& rows, int64_t offset, int64_t step, int64_t size,
                                                         int present, V out[W]) {
  const int64_t runs = kVecBytes / size;
  for (int64_t c = 0; c < W; ++c) {
    const uint8_t* row = rows.row(c) + offset;
    if (present < runs) {
      alignas(64) uint8_t buffer[kVecBytes] = {};
      for (int p = 0; p < present; ++p) std::memcpy(buffer + p * size, row + p * step, size);
      out[c] = load(buffer);
    } else if (runs == 1) {
      out[c] = load(row);
#if defined(STATELM_GGUF_VNNI)
    } else if (runs == 4) {
      out[c] = quarters(row, row + step, row + 2 * step, row + 3 * step);
#endif
    } else {
      out[c] = halves(row, row + step);
    }
  }
  transpose(out);
}

// A sink receives a chunk's decoded blocks (block numbers from the chunk's start), in order: a block's scale(group,
// S) and min(group, O) calls (possibly those of a few blocks ahead), then its eight quad(block, q, levels) calls
// (levels + offset of values 4q..4q+3 of every column, quads in any order) and block_done(block). StoreSink lays
// them out as the tile; DotSink multiplies them at once.
// The 256-value formats' builders give instead a superblock(s, d, dmin) call, then its groups' integer scales
// sub_scale(group, s) and mins sub_min(group, m) (S = d*s, O = -(dmin*m)).
struct StoreSink {
  TileBuffers out;
  VF d = set_f(0.0f), dmin = set_f(0.0f);  // the current superblock's

  void quad(int64_t block, int q, V v) { store(out.levels + (block * 8 + q) * W * 4, v); }
  void scale(int64_t group, VF v) { store_f(out.scales + group * W, v); }
  void min(int64_t group, VF v) { store_f(out.mins + group * W, v); }
  void superblock(int64_t s, VF d_of, VF dmin_of) {
    d = d_of;
    dmin = dmin_of;
    store_f(out.d + s * W, d);
    store_f(out.neg_dmin + s * W, negate(dmin));
  }
  void sub_scale(int64_t group, V s) {
    store(out.sub_scales + group * W, s);
    scale(group, mul(d, to_float(s)));
  }
  void sub_min(int64_t group, V m) {
    store(out.sub_mins + group * W, m);
    min(group, negate(mul(dmin, to_float(m))));
  }
  void block_done(int64_t) {}
};

// Quads of a format's narrow levels whose pair sums the AVX2 build adds in int16 before widening them (every sum
// below quads * 2 * largest level * 127 < 32768): 4-bit levels a whole block's 8, 5-bit 4, Q6_K's 6-bit 2; 1: each
// quad widened at once (wide levels, and the VNNI build, whose vpdpbusd sums in int32).
constexpr int quads_in_int16(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ4_K: return 8;
    case kQ5_0: case kQ5_1: case kQ5_K: return 4;
    case kQ6_K: return 2;
    default: return 1;
  }
}

// Whether a format with a builder is a 256-value one (its int8 arithmetic sums superblocks: Format::superblock).
constexpr bool superblock_type(int64_t type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kIQ4_XS;
}

// The scale slots a format's DotSink keeps: a superblock's groups for the 256-value formats (whose builders give a
// superblock's scales, then its blocks), else 16 (the block formats give at most four blocks' scales ahead).
constexpr int superblock_groups(int64_t type) { return superblock_type(type) && type != kQ6_K ? 8 : 16; }

// The int8 arithmetic of R rows straight from decoded quads: a block's exact group sums, then its float steps.
// kPack > 1 (AVX2, quads_in_int16): the builders deliver a block's quads of one group in order (K-quants, Q5) or
// all in one group (4-bit formats, widened once at block_done), so kPack consecutive quads share a group.
// kSuper (the 256-value formats): the group sums go into the superblock's integer total as they are scaled (AVX2:
// while vpmaddwd widens them), and the superblock's float steps come after its last block (close_superblock).
template <int R, bool kG16, bool kMin, int kPack = 1, int kSlots = 16, bool kSuper = false>
struct DotSink {
  // kSlots: scales and mins kept (a power of two, at least a superblock's groups); a K-quant's own group count
  // makes a group's slot a constant of the unrolled builder, not a ring position computed and kept per group
  static constexpr int64_t kSize = kG16 ? 16 : 32;
  static constexpr int kSuperGroups = static_cast<int>(kSuperblock / kSize);
  static_assert(!kSuper || kSlots == kSuperGroups, "a superblock's groups, one slot each");
  // The rows' activations from the chunk's first block on, read through pointers taken once (the kernel's loop
  // then keeps its sums and results in registers).
  const int8_t* q8;
  const float* dx;
  const int32_t* level_sums;   // per group of kSize
  const float* sx;             // per group of kSize
  const int32_t* level_pairs;  // kSuper: level sums two by two
  int64_t k;
  int offset;
  bool wide;
  // [kSlots][W] scales, then mins [kSlots][W]: the caller's (a buffer apart keeps this sink in registers); kSuper:
  // their slots (scale_slot)
  float* scales;
  VF acc[R];
  V sums[2][R];
  V pairs[R];  // kPack > 1: the int16 pair sums of the quads not yet widened
  V total[R];  // kSuper: the superblock's
  VF d, neg_dmin;

  DotSink(const IntRows& x, int64_t first_block, int level_offset, bool wide_levels, const float* running,
          float* slots)
      : q8(x.q8.data() + first_block * kBlock),
        dx(x.dx.data() + first_block),
        level_sums((kG16 ? x.sums16.data() : x.sums32.data()) + first_block * kBlock / kSize),
        sx((kG16 ? x.sx16.data() : x.sx32.data()) + first_block * kBlock / kSize),
        level_pairs(kSuper ? x.level_pairs(0, first_block * kBlock / kSize, kSize) : nullptr),
        k(x.k),
        offset(level_offset),
        wide(wide_levels),
        scales(slots),
        d(set_f(0.0f)),
        neg_dmin(set_f(0.0f)) {
    for (int r = 0; r < R; ++r) {
      acc[r] = load_f(running + r * W);
      sums[0][r] = sums[1][r] = pairs[r] = total[r] = zero();
    }
  }
  static int64_t group_of(int64_t block, int q) { return kG16 ? 2 * block + (q >= 4 ? 1 : 0) : block; }
  V slot_of(int64_t group) const { return load(scales + slot(group) * W); }
  __attribute__((always_inline)) void quad(int64_t block, int q, V v) {
    V* sum = sums[kG16 && q >= 4 ? 1 : 0];
    const int8_t* at = q8 + block * kBlock + 4 * q;
#if !defined(STATELM_GGUF_VNNI)
    if constexpr (kPack > 1) {
      for (int r = 0; r < R; ++r) pairs[r] = add16(pairs[r], pair_sums(v, broadcast32(at + r * k)));
      if (kPack < 8 && q % kPack == kPack - 1) widen(sum, group_of(block, q));
      return;
    }
    if constexpr (kSuper) {  // wide levels (IQ4_XS), each quad widened at once
      const WideQuad w = wide_quad(v);
      const V s = slot_of(group_of(block, q));
      for (int r = 0; r < R; ++r) total[r] = dot16(total[r], wide_pair_sums(w, broadcast32(at + r * k)), s);
      return;
    }
#endif
    for (int r = 0; r < R; ++r) sum[r] = dot_quad(sum[r], v, broadcast32(at + r * k), wide);
  }
#if !defined(STATELM_GGUF_VNNI)
  __attribute__((always_inline)) void widen(V* sum, int64_t group) {
    if constexpr (kSuper) {
      const V s = slot_of(group);
      for (int r = 0; r < R; ++r) total[r] = running(dot16(total[r], pairs[r], s));
    } else {
      for (int r = 0; r < R; ++r) sum[r] = widen_pairs(sum[r], pairs[r]);
    }
    for (int r = 0; r < R; ++r) pairs[r] = zero();
  }
#endif
  static int64_t slot(int64_t group) { return static_cast<int64_t>(static_cast<uint64_t>(group) % kSlots); }
  void scale(int64_t group, VF v) { store_f(scales + slot(group) * W, v); }
  void min(int64_t group, VF v) { store_f(scales + (kSlots + slot(group)) * W, v); }
  void superblock(int64_t, VF d_of, VF dmin_of) {
    d = d_of;
    neg_dmin = negate(dmin_of);
  }
  void sub_scale(int64_t group, V s) { keep_slot(slot(group), s); }
  void sub_min(int64_t group, V m) { keep_slot(kSlots + slot(group), m); }
  // A slot is stored, then read where it is used (the compiler barrier): kept in registers from here, a
  // superblock's slots crowded out the words and sums the AVX2 build works on, and were spilled.
  void keep_slot(int64_t at, V v) {
    store(scales + at * W, scale_slot(v));
    asm volatile("" ::: "memory");
  }
  __attribute__((always_inline)) void block_done(int64_t block) {
#if !defined(STATELM_GGUF_VNNI)
    if constexpr (kPack == 8) widen(sums[0], block);
#endif
    constexpr int64_t kGroups = kBlock / kSize;  // a block's groups
    if constexpr (kSuper) {
#if defined(STATELM_GGUF_VNNI)
      for (int h = 0; h < kGroups; ++h) {
        const V s = slot_of(kGroups * block + h);
        for (int r = 0; r < R; ++r) {
          total[r] = add32(total[r], mul32(sums[h][r], s));
          sums[h][r] = zero();
        }
      }
#endif
      constexpr uint64_t kBlocks = kSuperblock / kBlock;  // a superblock's; chunks start on one
      if (static_cast<uint64_t>(block) % kBlocks == kBlocks - 1) {
        const auto superblock = static_cast<int64_t>(static_cast<uint64_t>(block) / kBlocks);
        // the slots read afresh through a pointer the compiler cannot follow: merged with widen()'s loads of the
        // same slots, the loaded values were kept from there to here (and spilled)
        const float* slots = scales;
        asm("" : "+r"(slots));
        close_superblock<R, kSuperGroups, kMin>(reinterpret_cast<const uint8_t*>(slots),
                                                reinterpret_cast<const uint8_t*>(slots + kSlots * W), d, neg_dmin,
                                                offset, level_pairs + superblock * kSuperGroups / 2, k / kSize / 2,
                                                dx + superblock * kBlocks, k / kBlock, total, acc);
      }
      return;
    }
    for (int h = 0; h < kGroups; ++h) {
      const int64_t group = kGroups * block + h, at_slot = slot(group);
      const VF s = load_f(scales + at_slot * W);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * (k / kSize) + group;
        const int32_t offset_sum = offset ? offset * level_sums[at] : 0;
        acc[r] = group_step<kMin>(acc[r], sums[h][r], offset_sum, s, dx[r * (k / kBlock) + block],
                                  scales + (kSlots + at_slot) * W, kMin ? sx[at] : 0.0f);
        sums[h][r] = zero();
      }
    }
  }
  void finish(float* running) const {
    for (int r = 0; r < R; ++r) store_f(running + r * W, acc[r]);
  }
};

// A sink that asks for its share of `ahead` as each block is done, then passes the block on.
template <class Sink>
struct AskingSink : Sink {
  Ahead::Shares shares;  // over the chunk's blocks

  template <class... Args>
  AskingSink(const Ahead& later, int64_t chunk_blocks, Args&&... args)
      : Sink(std::forward<Args>(args)...), shares(later.shares(chunk_blocks)) {}
  __attribute__((always_inline)) void block_done(int64_t block) {
    shares.ask(block);
    Sink::block_done(block);
  }
};

// Q8_0 (d, 32 int8): levels + 128.
template <class Sink, class Source>
void build_q8_0(const Source& rows, int64_t blocks, Sink& sink) {
  constexpr int64_t kRuns = kVecBytes / 32;  // blocks per transposed set
  const V flip = set8(0x80);
  for (int64_t b = 0; b < blocks; b += kRuns) {
    const int present = static_cast<int>(std::min(kRuns, blocks - b));
    V v[W];
    words_of_runs(rows, b * 34 + 2, 34, 32, present, v);
    for (int p = 0; p < present; ++p) {
      V header[4];
      four_words(rows, (b + p) * 34, header);
      sink.scale(b + p, half_low(header[0]));
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) sink.quad(b + p, q, vxor(v[8 * p + q], flip));
      sink.block_done(b + p);
    }
  }
}

// The blocks of a paired format's interleaved copy (Q4_0, IQ4_NL, Q8_0: stored_block), a unit of two at a time: the
// word of both d's, then each block's kWords vectors, loaded as they lie, a block's at once. fn(block, d, words) for
// each block. (The general builders find each word's place by arithmetic: for Q8_0 108 instructions a block of 8
// columns, against 44 here; loading a unit's 17 vectors at once spilled them, and from memory ran at half speed.)
template <int64_t kType, int kWords, class Fn>
__attribute__((always_inline)) inline void paired_blocks(const TileWords<kType>& tile, int64_t blocks, Fn&& fn) {
  constexpr int64_t kUnitVectors = stored_block(kType).unit_stored() / 4;  // a column's words: a vector each
  static_assert(kUnitVectors == 1 + 2 * kWords, "both d's in a word, then the two blocks' words");
  for (int64_t b = 0; b < blocks; b += 2) {  // an interleaved row holds whole units (stored_block)
    const uint8_t* unit = tile.tile + b / 2 * kUnitVectors * kVecBytes;
    const V header = load(unit);
    for (int p = 0; p < 2; ++p) {
      V words[kWords];
      for (int e = 0; e < kWords; ++e) words[e] = load(unit + (1 + kWords * p + e) * kVecBytes);
      fn(b + p, p == 0 ? half_low(header) : half_high(header), words);
    }
  }
}

// Q8_0 from its interleaved copy (paired_blocks).
template <class Sink>
void build_q8_0(const TileWords<kQ8_0>& tile, int64_t blocks, Sink& sink) {
  const V flip = set8(0x80);
  paired_blocks<kQ8_0, 8>(tile, blocks, [&](int64_t block, VF d, const V* quads) __attribute__((always_inline)) {
    sink.scale(block, d);
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) sink.quad(block, q, vxor(quads[q], flip));
    sink.block_done(block);
  });
}

constexpr int8_t kIQ4Shifted[16] = {1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15};  // +128

// A block whose 16 bytes of nibbles are words[0..3] (low nibbles: values 0..15, high: 16..31); IQ4 levels looked up.
template <class Sink>
__attribute__((always_inline)) inline void nibble_block(const V* words, int64_t block, bool iq4, Sink& sink) {
  const V mask = set8(0x0F), table = table16(kIQ4Shifted);
#pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {
    V low = vand(words[e], mask), high = vand(srl(words[e], 4), mask);
    if (iq4) {
      low = lookup(table, low);
      high = lookup(table, high);
    }
    sink.quad(block, e, low);
    sink.quad(block, e + 4, high);
  }
  sink.block_done(block);
}

// Q4_1 (d, m, qs[16]: 20 bytes): four blocks are 20 words of each column, block p's d | m word 5p and its nibbles
// words 5p + 1..5p + 4, so that one transpose of 80 bytes serves four blocks' fields and levels alike. Returns
// the blocks done (a multiple of four).
template <class Sink, class Source>
int64_t build_q4_1_fours(const Source& rows, int64_t blocks, Sink& sink) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    V v[20];
    for (int64_t at = 0; at < 64; at += kVecBytes) words(rows, b * 20 + at, v + at / 4);
    four_words(rows, b * 20 + 64, v + 16);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      sink.scale(b + p, half_low(v[5 * p]));
      sink.min(b + p, half_high(v[5 * p]));
      nibble_block(v + 5 * p + 1, b + p, false, sink);
    }
  }
  return b;
}

// Q4_0, Q4_1, IQ4_NL: 16 bytes of nibbles per block at `qs`.
template <class Sink, class Source>
void build_nibble_blocks(const Format& f, const Source& rows, int64_t blocks, int64_t qs, bool iq4, Sink& sink) {
  constexpr int64_t kRuns = kVecBytes / 16;
  for (int64_t b = f.type == kQ4_1 ? build_q4_1_fours(rows, blocks, sink) : 0; b < blocks; b += kRuns) {
    const int present = static_cast<int>(std::min(kRuns, blocks - b));
    V v[W];
    words_of_runs(rows, b * f.bytes + qs, f.bytes, 16, present, v);
    for (int p = 0; p < present; ++p) {
      V header[4];  // word 0: d, then Q4_1's m
      four_words(rows, (b + p) * f.bytes, header);
      sink.scale(b + p, half_low(header[0]));
      if (f.min) sink.min(b + p, half_high(header[0]));
      nibble_block(v + 4 * p, b + p, iq4, sink);
    }
  }
}

// Q4_0 and IQ4_NL from their interleaved copy (paired_blocks).
template <int64_t kType, class Sink>
  requires(stored_block(kType).paired)
void build_nibble_blocks(const Format&, const TileWords<kType>& tile, int64_t blocks, int64_t, bool iq4, Sink& sink) {
  paired_blocks<kType, 4>(tile, blocks, [&](int64_t block, VF d, const V* words) __attribute__((always_inline)) {
    sink.scale(block, d);
    nibble_block(words, block, iq4, sink);
  });
}

// Q5_0 (d, qh, qs[16]) and Q5_1 (d, m, qh, qs[16]): value i's fifth bit is bit i of the 32-bit qh. For quad e,
// byte e / 2 of each column's qh is spread over the lane's four bytes and byte i keeps bit 4 (e % 2) + i.
template <class Sink, class Source>
void build_q5_blocks(const Format& f, const Source& rows, int64_t blocks, int64_t qh_at, Sink& sink) {
  constexpr int64_t kRuns = kVecBytes / 16;
  const V mask = set8(0x0F), one = set8(0x01);
  const V lane_base = lane_bytes();
  for (int64_t b = 0; b < blocks; b += kRuns) {
    const int present = static_cast<int>(std::min(kRuns, blocks - b));
    V v[W];
    words_of_runs(rows, b * f.bytes + qh_at + 4, f.bytes, 16, present, v);
    for (int p = 0; p < present; ++p) {
      const int64_t block = b + p;
      V header[4];  // Q5_0: d | qh low half, qh high half | ...; Q5_1: d | m, qh
      four_words(rows, block * f.bytes, header);
      sink.scale(block, half_low(header[0]));
      if (f.min) sink.min(block, half_high(header[0]));
      const V qh = f.min ? header[1] : vor(srl(header[0], 16), sll(header[1], 16));
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
        const V word = v[4 * p + e % 4];
        const V nibble = e < 4 ? vand(word, mask) : vand(srl(word, 4), mask);
        const V spread = lookup(qh, add8(lane_base, set8(e / 2)));
        const V bits = vand(spread, set32(e % 2 ? static_cast<int>(0x80402010) : 0x08040201));
        sink.quad(block, e, vor(nibble, sll(min8(bits, one), 4)));
      }
      sink.block_done(block);
    }
  }
}

// 128 bytes of Q4_K / Q5_K nibbles at qs: bytes 32c..32c+31 hold sub-block 2c (low) and 2c+1 (high). high_bits:
// Q5_K's qh words (bit j of byte i: fifth bit of sub-block j's value i), or null.
template <class Sink, class Source>
__attribute__((always_inline)) inline void k_nibbles(const Source& rows, int64_t qs, int64_t block0, const V* high_bits,
                                                     Sink& sink) {
  const V mask = set8(0x0F), one = set8(0x01);
#pragma GCC unroll 4
  for (int64_t load_at = 0; load_at < 128; load_at += kVecBytes) {
    V v[W];
    words(rows, qs + load_at, v);
#pragma GCC unroll 4
    for (int sub = 0; sub < 2 * kVecBytes / 32; ++sub) {  // the sub-blocks this load holds, in order
      const int c = static_cast<int>(load_at / 32) + sub / 2, block = 2 * c + sub % 2;
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const V word = v[8 * (sub / 2) + t];
        V level = sub % 2 ? vand(srl(word, 4), mask) : vand(word, mask);
        if (high_bits) level = vor(level, sll(vand(srl(high_bits[t], block), one), 4));
        sink.quad(block0 + block, t, level);
      }
      sink.block_done(block0 + block);
    }
  }
}
// Q4_K / Q5_K superblock s's d, dmin and integer scales and mins from the header words (d | dmin, then the 12
// bytes of 6-bit fields).
template <class Sink>
inline void k4_scales(const V h[4], int64_t s, Sink& sink) {
  sink.superblock(s, half_low(h[0]), half_high(h[0]));
  const V six = set32(63), four = set32(15), two = set32(3);
  for (int j = 0; j < 8; ++j) {
    V scale, min;
    if (j < 4) {
      scale = vand(srl(h[1], 8 * j), six);
      min = vand(srl(h[2], 8 * j), six);
    } else {
      const int i = j - 4;
      scale = vor(vand(srl(h[3], 8 * i), four), sll(vand(srl(h[1], 8 * i + 6), two), 4));
      min = vor(vand(srl(h[3], 8 * i + 4), four), sll(vand(srl(h[2], 8 * i + 6), two), 4));
    }
    sink.sub_scale(8 * s + j, scale);
    sink.sub_min(8 * s + j, min);
  }
}

template <class Sink, class Source>
void build_q4_k(const Source& rows, int64_t superblocks, Sink& sink) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const auto at = rows.at(s * 144);
    V header[4];
    field_run(at, 0, 4, header);
    k4_scales(header, s, sink);
    k_nibbles(at, 16, 8 * s, nullptr, sink);
  }
}

template <class Sink, class Source>
void build_q5_k(const Source& rows, int64_t superblocks, Sink& sink) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const auto at = rows.at(s * 176);
    V header[4], qh[W];
    field_run(at, 0, 4, header);
    // words 0..7: qh. The VNNI build loads them before it works out the scales, so that the unit's lines are first
    // touched in the order they lie (as Q6_K's): after the scales, one row of Q5_K read 13 GB/s from memory at one
    // thread (22 at two) against 22-23 (28-32). The AVX2 build's 16 registers hold them only after (two rows 8%
    // slower).
    if constexpr (kAskAhead) field_run(at, 16, 8, qh);
    k4_scales(header, s, sink);
    if constexpr (!kAskAhead) field_run(at, 16, 8, qh);
    k_nibbles(at, 48, 8 * s, qh, sink);
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8 per 16 values), d. Value 128h + 32s + i: low bits from ql byte
// 64h + 32(s % 2) + i (low nibble for s < 2), high bits (qh byte 32h + i >> 2s) & 3; levels + 32.
template <class Sink, class Source>
void build_q6_k(const Source& rows, int64_t superblocks, Sink& sink) {
  const V mask = set8(0x0F), high_bits = set8(0x30);
  for (int64_t s = 0; s < superblocks; ++s) {
    const auto at = rows.at(s * 210);
    ask_unit(at);
    V scales[4], d_word[4];
    V qh[2 * W];  // word 8h + t: qh bytes 32h + 4t..
    const auto load_high_bits = [&] {
      for (int64_t load_at = 0; load_at < 64; load_at += kVecBytes) words(at, 128 + load_at, qh + load_at / 4);
    };
    // The VNNI build loads the high bits first (the barrier keeps them first), so that a unit's lines are first
    // touched in the order they lie (stored_block: qh, scales, d, ql) and memory streams them: scales first made a
    // jump back from the unit's middle, and one row's Q6_K read 24-28 GB/s from memory at two threads against 29-34
    // (one thread 15 against 21-24). The AVX2 build asks for the unit's lines at its start (ask_unit) instead: there
    // the high bits loaded first fill its 16 registers, and Q6_K read 26 GB/s against 29.
    if constexpr (kAskAhead) {
      load_high_bits();
      asm volatile("" ::: "memory");
    }
    field_run(at, 192, 4, scales);  // the 16 int8 scales
    four_words(at, 194, d_word);  // word 3 (bytes 206..209): d in the high half
    sink.superblock(s, half_high(d_word[3]), set_f(0.0f));
    for (int g = 0; g < 16; ++g) sink.sub_scale(16 * s + g, sra(sll(scales[g / 4], 24 - 8 * (g % 4)), 24));
    if constexpr (!kAskAhead) load_high_bits();
    for (int h = 0; h < 2; ++h) {
      V ql[2 * W];  // word 8 * (s % 2) + t: ql bytes 64h + 32(s % 2) + 4t..
      for (int64_t load_at = 0; load_at < 64; load_at += kVecBytes) words(at, 64 * h + load_at, ql + load_at / 4);
#pragma GCC unroll 4
      for (int sub = 0; sub < 4; ++sub) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const V word = ql[8 * (sub % 2) + t];
          const V low = sub < 2 ? vand(word, mask) : vand(srl(word, 4), mask);
          // bits 2sub, 2sub + 1 of each qh byte moved to bits 4, 5 (a word's shift: the mask drops its neighbours')
          const V bits = qh[8 * h + t];
          const V top = vand(sub < 2 ? sll(bits, 4 - 2 * sub) : sub == 2 ? bits : srl(bits, 2), high_bits);
          sink.quad(8 * s + 4 * h + sub, t, vor(low, top));
        }
        sink.block_done(8 * s + 4 * h + sub);
      }
    }
  }
}

// IQ4_XS: d, scales_h, scales_l[4], qs[128] (16 bytes per sub-block: low nibbles values 0..15, high 16..31).
template <class Sink, class Source>
void build_iq4_xs(const Source& rows, int64_t superblocks, Sink& sink) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const auto at = rows.at(s * 136);
    V header[4];
    field_run(at, 0, 4, header);
    sink.superblock(s, half_low(header[0]), set_f(0.0f));
    const V high = srl(header[0], 16), low = header[1];
    for (int j = 0; j < 8; ++j) {
      const V ls = vor(vand(srl(low, 4 * j), set32(15)), sll(vand(srl(high, 2 * j), set32(3)), 4));
      sink.sub_scale(8 * s + j, sub32(ls, set32(32)));
    }
    for (int64_t load_at = 0; load_at < 128; load_at += kVecBytes) {
      V v[W];
      words(at, 8 + load_at, v);
#pragma GCC unroll 4
      for (int sub = 0; sub < kVecBytes / 16; ++sub) nibble_block(v + 4 * sub, 8 * s + load_at / 16 + sub, true, sink);
    }
  }
}

// Calls visit.template operator()<type>() with the format's type as a constant; false when the format has no
// builder (decoded_tile serves it).
template <class Visit>
bool with_builder(int64_t type, Visit&& visit) {
  switch (type) {
    case kQ8_0: visit.template operator()<kQ8_0>(); return true;
    case kQ4_0: visit.template operator()<kQ4_0>(); return true;
    case kQ4_1: visit.template operator()<kQ4_1>(); return true;
    case kIQ4_NL: visit.template operator()<kIQ4_NL>(); return true;
    case kQ5_0: visit.template operator()<kQ5_0>(); return true;
    case kQ5_1: visit.template operator()<kQ5_1>(); return true;
    case kQ4_K: visit.template operator()<kQ4_K>(); return true;
    case kQ5_K: visit.template operator()<kQ5_K>(); return true;
    case kQ6_K: visit.template operator()<kQ6_K>(); return true;
    case kIQ4_XS: visit.template operator()<kIQ4_XS>(); return true;
    default: return false;
  }
}

// Runs the builder of format kType (f) into sink.
template <int64_t kType, class Sink, class Source>
__attribute__((always_inline)) inline void build_blocks(const Format& f, const Source& rows, int64_t values,
                                                        Sink& sink) {
  const auto typed = rows.template as<kType>();
  const int64_t blocks = values / f.values;
  if constexpr (kType == kQ8_0) {
    build_q8_0(typed, blocks, sink);
  } else if constexpr (kType == kQ4_0 || kType == kQ4_1 || kType == kIQ4_NL) {
    build_nibble_blocks(f, typed, blocks, kType == kQ4_1 ? 4 : 2, kType == kIQ4_NL, sink);
  } else if constexpr (kType == kQ5_0 || kType == kQ5_1) {
    build_q5_blocks(f, typed, blocks, kType == kQ5_1 ? 4 : 2, sink);
  } else if constexpr (kType == kQ4_K) {
    build_q4_k(typed, blocks, sink);
  } else if constexpr (kType == kQ5_K) {
    build_q5_k(typed, blocks, sink);
  } else if constexpr (kType == kQ6_K) {
    build_q6_k(typed, blocks, sink);
  } else {
    static_assert(kType == kIQ4_XS, "a format with a builder");
    build_iq4_xs(typed, blocks, sink);
  }
}

// Runs the format's builder into sink; false when the format has none.
template <class Sink, class Source>
bool build(const Format& f, const Source& rows, int64_t values, Sink& sink) {
  return with_builder(f.type, [&]<int64_t kType>() { build_blocks<kType>(f, rows, values, sink); });
}

// R rows times one format's blocks, in a function of its own (a format's loop compiled and laid out alone: sharing
// one function with the other formats' loops cost the Q4_K loop 10-15% at one row).
template <int R, int64_t kType, class Source>
__attribute__((noinline)) void stream_blocks(const Part& part, const Source& rows, int64_t first, int64_t values,
                                             const IntRows& x, const Ahead& ahead, float* acc) {
  constexpr bool kG16 = kType == kQ6_K;  // the formats with builders whose groups are 16 values, and with mins
  constexpr bool kMin = kType == kQ4_1 || kType == kQ5_1 || kType == kQ4_K || kType == kQ5_K;
  constexpr bool kSuper = superblock_type(kType);
  const Format& f = *part.format;
  constexpr int kSlots = superblock_groups(kType);
  alignas(64) float slots[2 * kSlots * W];  // the sink's scales and mins
  if constexpr (kAskAhead && (R > 1 || asks_ahead_at_one_row(kType))) {  // VNNI (one row: see asks_ahead_at_one_row)
    AskingSink<DotSink<R, kG16, kMin, 1, kSlots, kSuper>> sink(ahead, values / kBlock, x, first / kBlock, f.offset,
                                                               false, acc, slots);
    build_blocks<kType>(f, rows, values, sink);
    sink.finish(acc);
  } else {
#if defined(STATELM_GGUF_VNNI)
    DotSink<R, kG16, kMin, 1, kSlots, kSuper> sink(x, first / kBlock, f.offset, false, acc, slots);
#else
    DotSink<R, kG16, kMin, quads_in_int16(kType), kSlots, kSuper> sink(x, first / kBlock, f.narrow ? f.offset : 0,
                                                                       !f.narrow, acc, slots);
#endif
    build_blocks<kType>(f, rows, values, sink);
    sink.finish(acc);
  }
}

template <int R, class Source>
bool stream_rows(const Part& part, const Source& rows, int64_t first, int64_t values, const IntRows& x,
                 const Ahead& ahead, float* acc) {
  return with_builder(part.format->type,
                      [&]<int64_t kType>() { stream_blocks<R, kType>(part, rows, first, values, x, ahead, acc); });
}
#endif  // STATELM_GGUF_AVX2

}  // namespace

// Slot `slot` of a per-thread scratch of kPanelTiles slots of `count` elements (the whole asked for every time, so
// that no slot moves while another is in use).
template <typename T, int kSlot>
T* panel_scratch(int64_t count, int64_t slot) {
  return scratch<T, kSlot>(kPanelTiles * count) + slot * count;
}

namespace {

// sized for a whole chunk (groups of 16 values at the least), so that slots keep their places whatever a tile's values
constexpr int64_t kChunkGroups = kChunkValues / 16;

// A tile's scales and then its mins, [groups][kTileColumns] each, in this thread's scratch at `slot`.
float* tile_scales(int64_t slot) { return panel_scratch<float, 2>(2 * W * kChunkGroups, slot); }

}  // namespace

Int8Tile build_int8_tile(const Part& part, int64_t column, int64_t first, int64_t values, int64_t slot) {
  const Format& f = *part.format;
  const int64_t groups = values / f.group, superblocks = values / kSuperblock;
  const int64_t chunk_superblocks = kChunkValues / kSuperblock;
  float* scales = tile_scales(slot);
  int32_t* sub_scales = panel_scratch<int32_t, 9>(2 * W * kChunkGroups, slot);
  float* d = panel_scratch<float, 10>(2 * W * chunk_superblocks, slot);
  const TileBuffers out{panel_scratch<uint8_t, 3>(W * kChunkValues, slot), scales, scales + W * groups, sub_scales,
                        sub_scales + W * groups, d, d + W * superblocks};
#if defined(STATELM_GGUF_AVX2)
  StoreSink sink{out};
  const bool built = part.interleaved ? build(f, tile_start_of(part, column, first), values, sink)
                                      : build(f, rows_of(part, column, first), values, sink);
  if (built) {
    return {out.levels, out.scales, out.mins, &f, f.offset, values / kBlock, out.sub_scales, out.sub_mins, out.d,
            out.neg_dmin};
  }
#endif
  return decoded_tile(part, column, first, values, out);
}

Int8Tile int8_tile_in_place(const Part& part, int64_t column, int64_t first, int64_t values, int64_t slot) {
#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
  if (part.interleaved && part.format->type == kQ8_0) {
    constexpr int64_t kPairBytes = stored_block(kQ8_0).unit_stored() * W;  // both d's, then two blocks' levels
    const uint8_t* pairs = tile_start_of(part, column, first).as<kQ8_0>().tile;
    const int64_t blocks = values / kBlock;
    float* scales = tile_scales(slot);
    for (int64_t b = 0; b < blocks; b += 2) {
      const simd::V header = simd::load(pairs + b / 2 * kPairBytes);
      simd::store_f(scales + b * W, simd::half_low(header));
      simd::store_f(scales + (b + 1) * W, simd::half_high(header));
    }
    Int8Tile tile{pairs, scales, nullptr, part.format, part.format->offset, blocks};
    tile.pair_header = simd::kVecBytes;
    tile.flip = 0x80;
    return tile;
  }
#endif
  return build_int8_tile(part, column, first, values, slot);
}

bool stream_int8_rows(const Part& part, int64_t column, int64_t first, int64_t values, const IntRows& x,
                      const Ahead& ahead, float* acc) {
#if defined(STATELM_GGUF_AVX2)
  if (x.rows > stream_rows_of(part.format->type)) return false;
  const auto stream = [&](const auto& rows) {
    switch (x.rows) {
      case 1: return stream_rows<1>(part, rows, first, values, x, ahead, acc);
      case 2: return stream_rows<2>(part, rows, first, values, x, ahead, acc);
      case 3: return stream_rows<3>(part, rows, first, values, x, ahead, acc);
      case 4: return stream_rows<4>(part, rows, first, values, x, ahead, acc);
      default: return false;
    }
  };
  return part.interleaved ? stream(tile_start_of(part, column, first)) : stream(rows_of(part, column, first));
#else
  (void)part, (void)column, (void)first, (void)values, (void)x, (void)ahead, (void)acc;
  return false;
#endif
}

Int8Tile widen_int16(const Int8Tile& t, int64_t slot) {
#if defined(STATELM_GGUF_VNNI)
  int16_t* out = panel_scratch<int16_t, 4>(kChunkValues * W, slot);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i offset = _mm512_set1_epi16(static_cast<int16_t>(t.offset));
  for (int64_t quad = 0; quad < t.blocks * 8; ++quad) {
    const __m512i v = _mm512_loadu_si512(t.levels + quad * W * 4);
    const __m512i low = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)), offset);
    const __m512i high = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)), offset);
    _mm512_storeu_si512(out + 2 * quad * W * 2, _mm512_permutex2var_epi32(low, even, high));
    _mm512_storeu_si512(out + (2 * quad + 1) * W * 2, _mm512_permutex2var_epi32(low, odd, high));
  }
  return {reinterpret_cast<const uint8_t*>(out), t.scales, t.mins, t.format, 0, t.blocks};
#elif defined(STATELM_GGUF_AVX2)
  int16_t* out = panel_scratch<int16_t, 4>(kChunkValues * W, slot);
  const __m256i offset = _mm256_set1_epi16(static_cast<int16_t>(t.offset));
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(t.flip));
  for (int64_t quad = 0; quad < t.blocks * 8; ++quad) {
    const uint8_t* levels = t.levels + quad * W * 4 + (quad / 16 + 1) * t.pair_header;
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(levels)), flip);
    const __m256 low = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), offset));
    const __m256 high = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), offset));
    const __m256i even = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(low, high, 0x88)), 0xD8);
    const __m256i odd = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(low, high, 0xDD)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * quad * W * 2), even);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * quad + 1) * W * 2), odd);
  }
  return {reinterpret_cast<const uint8_t*>(out), t.scales, t.mins, t.format, 0, t.blocks};
#else
  (void)slot;
  return t;
#endif
}

const float* dequantize_tile(const Int8Tile& t) {
  const Format& f = *t.format;
  const int64_t values = t.blocks * kBlock;
  float* out = scratch<float, 5>(W * values);
#if defined(STATELM_GGUF_AVX2)
  for (int64_t quad = 0; quad < t.blocks * 8; ++quad) {
    const int64_t group = quad * 4 / f.group;
    const float* scales = t.scales + group * W;
    const float* mins = t.mins + group * W;
    const uint8_t* levels = t.levels + quad * W * 4;
#if defined(STATELM_GGUF_VNNI)
    const __m512i offset = _mm512_set1_epi32(t.offset);
    const __m512 s = _mm512_loadu_ps(scales), m = f.min ? _mm512_loadu_ps(mins) : _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {  // columns 4j..4j+3
      const __m512i spread =
          _mm512_add_epi32(_mm512_set1_epi32(4 * j), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(levels + 16 * j));
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), offset));
      __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(spread, s), q);
      if (f.min) w = _mm512_add_ps(w, _mm512_permutexvar_ps(spread, m));
      _mm512_storeu_ps(out + (quad * W + 4 * j) * 4, w);
    }
#else
    const __m256i offset = _mm256_set1_epi32(t.offset);
    const __m256 s = _mm256_loadu_ps(scales), m = f.min ? _mm256_loadu_ps(mins) : _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {  // columns 2j, 2j+1
      const __m256i spread = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels + 8 * j));
      const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), offset));
      __m256 w = _mm256_mul_ps(_mm256_permutevar8x32_ps(s, spread), q);
      if (f.min) w = _mm256_add_ps(w, _mm256_permutevar8x32_ps(m, spread));
      _mm256_storeu_ps(out + (quad * W + 2 * j) * 4, w);
    }
#endif
  }
#else
  const int8_t* levels = reinterpret_cast<const int8_t*>(t.levels);
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t k = 0; k < values; ++k) {
      const int64_t g = k / f.group;
      float w = t.scales[g * W + c] * static_cast<float>(levels[c * values + k]);
      if (f.min) w += t.mins[g * W + c];
      out[(k / 4 * W + c) * 4 + k % 4] = w;
    }
  }
#endif
  return out;
}

bool streams(const Format& f, int64_t rows) {
#if defined(STATELM_GGUF_AVX2)
  return rows <= stream_rows_of(f.type) && with_builder(f.type, []<int64_t>() {});
#else
  (void)f, (void)rows;
  return false;
#endif
}

bool interleavable(const Format& f, int64_t row_bytes) {
#if defined(STATELM_GGUF_AVX2)
  const StoredBlock layout = stored_block(f.type);
  return layout.bytes == f.bytes && row_bytes % layout.unit() == 0;
#else
  (void)f;
  (void)row_bytes;
  return false;
#endif
}

Ahead chunk_bytes(const Part& part, int64_t column, int64_t first, int64_t values) {
  if (!part.interleaved || column >= part.rows) return {};
  const StoredBlock layout = stored_block(part.format->type);
  const int64_t begin = first / part.format->values * layout.stored * W;
  const int64_t end = (first + values) / part.format->values * layout.stored * W;
  return {part.data + column * part.row_stride + begin, end - begin};
}

int64_t interleaved_row_bytes(const Format& f, int64_t row_bytes) {
  return row_bytes / f.bytes * stored_block(f.type).stored;
}

int64_t file_row_bytes(const Format& f, int64_t interleaved_bytes) {
  const int64_t stored = stored_block(f.type).stored;
  return stored == 0 ? 0 : interleaved_bytes / stored * f.bytes;
}

// Calls move(file offset, stored offset, bytes) for each run of a unit's bytes that lies together in the file's
// layout and in the stored one (StoredBlock): store_row moves a row's units one way, gather_row back.
template <class Move>
void unit_runs(const StoredBlock& layout, Move&& move) {
  const int64_t bytes = layout.bytes;
  if (layout.paired) {  // d0, d1 | qs0 | qs1
    move(0, 0, 2);
    move(bytes, 2, 2);
    move(2, 4, bytes - 2);
    move(bytes + 2, 2 + bytes, bytes - 2);
  } else {  // the block's last `tail` bytes, padding, the rest
    const int64_t head = bytes - layout.tail;
    move(head, 0, layout.tail);
    move(0, layout.stored - head, head);
  }
}

// One row in the stored layout: its units field by field, padding zeroed.
void store_row(const StoredBlock& layout, const uint8_t* row, int64_t row_bytes, uint8_t* stored) {
  std::memset(stored, 0, row_bytes / layout.unit() * layout.unit_stored());
  for (int64_t at = 0; at < row_bytes; at += layout.unit()) {
    uint8_t* out = stored + at / layout.unit() * layout.unit_stored();
    unit_runs(layout, [&](int64_t file, int64_t kept, int64_t count) {
      std::memcpy(out + kept, row + at + file, count);
    });
  }
}

void gather_row(const Format& f, const uint8_t* tiles, int64_t row, int64_t row_bytes, uint8_t* out) {
  const StoredBlock layout = stored_block(f.type);
  const int64_t words = row_bytes / f.bytes * layout.stored / 4, lane = row % W;
  const uint8_t* tile = tiles + row / W * W * words * 4;
  uint8_t* stored = scratch<uint8_t, 8>(words * 4);  // the row in the stored layout
  for (int64_t j = 0; j < words; ++j) std::memcpy(stored + 4 * j, tile + (j * W + lane) * 4, 4);
  for (int64_t at = 0; at < row_bytes; at += layout.unit()) {
    const uint8_t* in = stored + at / layout.unit() * layout.unit_stored();
    unit_runs(layout, [&](int64_t file, int64_t kept, int64_t count) {
      std::memcpy(out + at + file, in + kept, count);
    });
  }
}

void interleave_blocks(const Format& f, const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t stride,
                       uint8_t* out) {
  const StoredBlock layout = stored_block(f.type);
  const int64_t blocks = row_bytes / f.bytes, words = blocks * layout.stored / 4, tiles = (count + W - 1) / W;
  statelm::parallel_for(tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> stored(words * 4);
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = out + t * W * words * 4;
      for (int64_t c = 0; c < W; ++c) {
        if (t * W + c < count) {
          store_row(layout, rows + (t * W + c) * stride, row_bytes, stored.data());
        } else {
          std::fill(stored.begin(), stored.end(), 0);
        }
        for (int64_t j = 0; j < words; ++j) std::memcpy(tile + (j * W + c) * 4, stored.data() + 4 * j, 4);
      }
    }
  });
}

}  // namespace statelm::gguf
