// Builds a tile's int8 layout straight from the blocks of its columns (see gguf_tiles.h).
//
// Every column's bytes are loaded as they lie in its row, one vector per column, and the vectors are transposed
// in registers (16 x 16 or 8 x 8 32-bit words), so that vector j holds word j of every column: a quad of four
// levels per column, or a scale field per column. From there the format's unpacking (nibbles, high bits, the
// IQ4 table) works on whole vectors, lanes being columns, and each result is one quad of the tile. Formats
// without a builder here (Q2_K, Q3_K, Q5_0, Q5_1), and the scalar build, decode block by block
// (gguf_formats.cpp) and interleave.

#include "gguf_tiles.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

namespace statelm::gguf {
namespace {

constexpr int64_t W = kTileColumns;

struct TileBuffers {
  uint8_t* levels;
  float* scales;
  float* mins;
};

// The chunk's first block in each column's row: base + c * stride. Columns past the part's last read the last
// one's bytes (their results are never stored), so that every load is unconditional.
struct Rows {
  const uint8_t* base;
  int64_t stride;
  int64_t columns;  // real ones
  const uint8_t* row(int64_t c) const { return base + std::min(c, columns - 1) * stride; }
  Rows at(int64_t offset) const { return {base + offset, stride, columns}; }
};

Rows rows_of(const Part& part, int64_t column, int64_t first) {
  const uint8_t* base = part.data + column * part.row_stride + first / part.format->values * part.format->bytes;
  return {base, part.row_stride, std::min(kTileColumns, part.rows - column)};
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// The generic path: decode block by block, then interleave (and shift by the offset in SIMD builds).
Int8Tile decoded_tile(const Part& part, int64_t column, int64_t first, int64_t values, TileBuffers out) {
  const Format& f = *part.format;
  const int64_t groups = values / f.group;
  int8_t* levels = scratch<int8_t, 0>(W * values);
  float* decoded = scratch<float, 1>(2 * W * groups);
  decode_columns(part, column, first, values, levels, decoded, decoded + W * groups);
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t g = 0; g < groups; ++g) {
      out.scales[g * W + c] = decoded[c * groups + g];
      out.mins[g * W + c] = decoded[(W + c) * groups + g];
    }
  }
#if defined(STATELM_GGUF_AVX2)
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t u = 0; u < values / 4; ++u) {
      for (int64_t i = 0; i < 4; ++i) {
        out.levels[(u * W + c) * 4 + i] = static_cast<uint8_t>(levels[c * values + 4 * u + i] + f.offset);
      }
    }
  }
  return {out.levels, out.scales, out.mins, &f, f.offset, values / kBlock};
#else
  return {reinterpret_cast<const uint8_t*>(levels), out.scales, out.mins, &f, 0, values / kBlock};
#endif
}

#if defined(STATELM_GGUF_AVX2)

#if defined(STATELM_GGUF_VNNI)
using V = __m512i;
using VF = __m512;
constexpr int64_t kVecBytes = 64;
inline V zero() { return _mm512_setzero_si512(); }
inline V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline V load_halves(const uint8_t* a, const uint8_t* b) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline V load_quarters(const uint8_t* a, const uint8_t* b, const uint8_t* c, const uint8_t* d) {
  const auto q = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(q(a)), q(b), 1);
  const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(q(c)), q(d), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}
inline void store(uint8_t* p, V v) { _mm512_storeu_si512(p, v); }
inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline V set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline V set32(int v) { return _mm512_set1_epi32(v); }
inline V vand(V a, V b) { return _mm512_and_si512(a, b); }
inline V vor(V a, V b) { return _mm512_or_si512(a, b); }
inline V vxor(V a, V b) { return _mm512_xor_si512(a, b); }
inline V sub32(V a, V b) { return _mm512_sub_epi32(a, b); }
inline V srl(V a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline V sll(V a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline V sra(V a, int n) { return _mm512_sra_epi32(a, _mm_cvtsi32_si128(n)); }
inline V lookup(V table, V index) { return _mm512_shuffle_epi8(table, index); }  // table repeated per 128 bits
inline V table16(const int8_t* t) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
inline VF to_float(V v) { return _mm512_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF negate(VF a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
inline VF half_low(V v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline VF half_high(V v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }

// r[i] = word i of each of 16 vectors: out[j] = word j of r[0..15].
__attribute__((always_inline)) inline void transpose(V r[16]) {
  V a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // b[4i + c], 128-bit lane L: word 4L + c of rows 4i..4i+3
    const V s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const V s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}
#else
using V = __m256i;
using VF = __m256;
constexpr int64_t kVecBytes = 32;
inline V zero() { return _mm256_setzero_si256(); }
inline V load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V load_halves(const uint8_t* a, const uint8_t* b) {
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
inline void store(uint8_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline V set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline V set32(int v) { return _mm256_set1_epi32(v); }
inline V vand(V a, V b) { return _mm256_and_si256(a, b); }
inline V vor(V a, V b) { return _mm256_or_si256(a, b); }
inline V vxor(V a, V b) { return _mm256_xor_si256(a, b); }
inline V sub32(V a, V b) { return _mm256_sub_epi32(a, b); }
inline V srl(V a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline V sll(V a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline V sra(V a, int n) { return _mm256_sra_epi32(a, _mm_cvtsi32_si128(n)); }
inline V lookup(V table, V index) { return _mm256_shuffle_epi8(table, index); }
inline V table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
inline VF to_float(V v) { return _mm256_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF negate(VF a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
inline __m128i low_halves(V v) {  // the low 16 bits of each word, packed
  const V masked = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  return _mm_packus_epi32(_mm256_castsi256_si128(masked), _mm256_extracti128_si256(masked, 1));
}
inline VF half_low(V v) { return _mm256_cvtph_ps(low_halves(v)); }
inline VF half_high(V v) { return _mm256_cvtph_ps(low_halves(_mm256_srli_epi32(v, 16))); }

__attribute__((always_inline)) inline void transpose(V r[8]) {
  V a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
  }
}
#endif

constexpr int kWords = kVecBytes / 4;  // words per vector: W of them per transposed set
static_assert(kWords == W, "one vector per column, one column per word");

// out[j] = word j of kVecBytes bytes of each column at `offset` from its row.
__attribute__((always_inline)) inline void words(const Rows& rows, int64_t offset, V out[W]) {
  for (int64_t c = 0; c < W; ++c) out[c] = load(rows.row(c) + offset);
  transpose(out);
}

// The same from `pieces` runs of kVecBytes / pieces bytes, the p-th at offset + p * step (p < present; zeros after).
__attribute__((always_inline)) inline void words_of_pieces(const Rows& rows, int64_t offset, int64_t step, int pieces,
                                                           int present, V out[W]) {
  const int64_t size = kVecBytes / pieces;
  for (int64_t c = 0; c < W; ++c) {
    const uint8_t* row = rows.row(c) + offset;
    if (present < pieces) {
      alignas(64) uint8_t buffer[kVecBytes] = {};
      for (int p = 0; p < present; ++p) std::memcpy(buffer + p * size, row + p * step, size);
      out[c] = load(buffer);
    } else if (pieces == 4) {
#if defined(STATELM_GGUF_VNNI)
      out[c] = load_quarters(row, row + step, row + 2 * step, row + 3 * step);
#endif
    } else {
      out[c] = load_halves(row, row + step);
    }
  }
  transpose(out);
}

inline uint8_t* quad_at(const TileBuffers& out, int64_t block, int64_t quad) { return out.levels + (block * 8 + quad) * W * 4; }

// Q8_0 (d, 32 int8): levels + 128.
void build_q8_0(const Rows& rows, int64_t blocks, TileBuffers out) {
  constexpr int kPieces = kVecBytes / 32;  // blocks per vector
  const V flip = set8(0x80);
  for (int64_t b = 0; b < blocks; b += kPieces) {
    V v[W];
    const int present = static_cast<int>(std::min<int64_t>(kPieces, blocks - b));
    if (kPieces == 1) {
      words(rows, b * 34 + 2, v);
    } else {
      words_of_pieces(rows, b * 34 + 2, 34, kPieces, present, v);
    }
    for (int j = 0; j < W; ++j) {
      if (b + j / 8 < blocks) store(quad_at(out, b + j / 8, j % 8), vxor(v[j], flip));
    }
  }
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t b = 0; b < blocks; ++b) out.scales[b * W + c] = half_at(rows.row(c) + b * 34);
  }
}

constexpr int8_t kIQ4Shifted[16] = {1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15};  // +128

// Q4_0, Q4_1, IQ4_NL: 16 bytes of nibbles per block at `qs` (low nibbles: values 0..15, high: 16..31).
void build_nibble_blocks(const Part& part, const Rows& rows, int64_t blocks, int64_t qs, bool iq4, TileBuffers out) {
  const Format& f = *part.format;
  constexpr int kPieces = kVecBytes / 16;
  const V mask = set8(0x0F), table = table16(kIQ4Shifted);
  for (int64_t b = 0; b < blocks; b += kPieces) {
    V v[W];
    words_of_pieces(rows, b * f.bytes + qs, f.bytes, kPieces, static_cast<int>(std::min<int64_t>(kPieces, blocks - b)), v);
    for (int j = 0; j < W; ++j) {
      const int64_t block = b + j / 4;
      if (block >= blocks) break;
      V low = vand(v[j], mask), high = vand(srl(v[j], 4), mask);
      if (iq4) {
        low = lookup(table, low);
        high = lookup(table, high);
      }
      store(quad_at(out, block, j % 4), low);
      store(quad_at(out, block, j % 4 + 4), high);
    }
  }
  for (int64_t c = 0; c < W; ++c) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = rows.row(c) + b * f.bytes;
      out.scales[b * W + c] = half_at(block);
      if (f.min) out.mins[b * W + c] = half_at(block + 2);
    }
  }
}

// 128 bytes of Q4_K / Q5_K nibbles at qs: bytes 32c..32c+31 hold sub-block 2c (low) and 2c+1 (high). high_bits:
// Q5_K's transposed qh words (bit j of byte i: fifth bit of sub-block j's value i), or null.
void k_nibbles(const Rows& rows, int64_t qs, int64_t block0, const V* high_bits, TileBuffers out) {
  const V mask = set8(0x0F), one = set8(0x01);
  for (int64_t load_at = 0; load_at < 128; load_at += kVecBytes) {
    V v[W];
    words(rows, qs + load_at, v);
    for (int j = 0; j < W; ++j) {
      const int64_t c = load_at / 32 + j / 8, t = j % 8;
      V low = vand(v[j], mask), high = vand(srl(v[j], 4), mask);
      if (high_bits) {
        low = vor(low, sll(vand(srl(high_bits[t], 2 * c), one), 4));
        high = vor(high, sll(vand(srl(high_bits[t], 2 * c + 1), one), 4));
      }
      store(quad_at(out, block0 + 2 * c, t), low);
      store(quad_at(out, block0 + 2 * c + 1, t), high);
    }
  }
}

// Q4_K / Q5_K scales and mins from the transposed header words (d | dmin, then the 12 bytes of 6-bit fields).
void k4_scales(const V h[4], int64_t group0, TileBuffers out) {
  const VF d = half_low(h[0]), dmin = half_high(h[0]);
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
    store(out.scales + (group0 + j) * W, mul(d, to_float(scale)));
    store(out.mins + (group0 + j) * W, negate(mul(dmin, to_float(min))));
  }
}

void build_q4_k(const Rows& rows, int64_t superblocks, TileBuffers out) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const Rows at = rows.at(s * 144);
    V header[W];
    words(at, 0, header);
    k4_scales(header, 8 * s, out);
    k_nibbles(at, 16, 8 * s, nullptr, out);
  }
}

void build_q5_k(const Rows& rows, int64_t superblocks, TileBuffers out) {
  for (int64_t s = 0; s < superblocks; ++s) {
    const Rows at = rows.at(s * 176);
    V header[W], qh[W];
    words(at, 0, header);
    k4_scales(header, 8 * s, out);
    words(at, 16, qh);  // words 0..7: qh
    k_nibbles(at, 48, 8 * s, qh, out);
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8 per 16 values), d. Value 128h + 32s + i: low bits from ql byte
// 64h + 32(s % 2) + i (low nibble for s < 2), high bits (qh byte 32h + i >> 2s) & 3; levels + 32.
void build_q6_k(const Rows& rows, int64_t superblocks, TileBuffers out) {
  const V mask = set8(0x0F), two_bits = set8(0x03);
  for (int64_t s = 0; s < superblocks; ++s) {
    const Rows at = rows.at(s * 210);
    V qh[2 * W];  // word 8h + t: qh bytes 32h + 4t.. (as 2 x 8 words)
    for (int64_t load_at = 0; load_at < 64; load_at += kVecBytes) words(at, 128 + load_at, qh + load_at / 4);
    for (int64_t load_at = 0; load_at < 128; load_at += kVecBytes) {
      V ql[W];
      words(at, load_at, ql);
      for (int j = 0; j < W; ++j) {
        const int64_t byte = load_at + 4 * j, h = byte / 64, parity = byte % 64 / 32, t = byte % 32 / 4;
        const V high = qh[8 * h + t];
        for (int nibble = 0; nibble < 2; ++nibble) {
          const int sub = 2 * nibble + static_cast<int>(parity);
          const V low = nibble ? vand(srl(ql[j], 4), mask) : vand(ql[j], mask);
          const V top = sll(vand(srl(high, 2 * sub), two_bits), 4);
          store(quad_at(out, 8 * s + 4 * h + sub, t), vor(low, top));
        }
      }
    }
    V scales[W], d_word[W];
    words(at, 208 - kVecBytes, scales);  // words W-4..W-1 (bytes 192..207): the 16 int8 scales
    words(at, 210 - kVecBytes, d_word);  // word W-1 (bytes 206..209): d in the high half
    const VF d = half_high(d_word[W - 1]);
    for (int g = 0; g < 16; ++g) {
      const V word = scales[W - 4 + g / 4];
      const V scale = sra(sll(word, 24 - 8 * (g % 4)), 24);
      store(out.scales + (16 * s + g) * W, mul(d, to_float(scale)));
    }
  }
}

// IQ4_XS: d, scales_h, scales_l[4], qs[128] (16 bytes per sub-block: low nibbles values 0..15, high 16..31).
void build_iq4_xs(const Rows& rows, int64_t superblocks, TileBuffers out) {
  const V mask = set8(0x0F), table = table16(kIQ4Shifted);
  for (int64_t s = 0; s < superblocks; ++s) {
    const Rows at = rows.at(s * 136);
    V header[W];
    words(at, 0, header);
    const VF d = half_low(header[0]);
    const V high = srl(header[0], 16), low = header[1];
    for (int j = 0; j < 8; ++j) {
      const V ls = vor(vand(srl(low, 4 * j), set32(15)), sll(vand(srl(high, 2 * j), set32(3)), 4));
      store(out.scales + (8 * s + j) * W, mul(d, to_float(sub32(ls, set32(32)))));
    }
    for (int64_t load_at = 0; load_at < 128; load_at += kVecBytes) {
      V v[W];
      words(at, 8 + load_at, v);
      for (int j = 0; j < W; ++j) {
        const int64_t byte = load_at + 4 * j, sub = byte / 16, e = byte % 16 / 4;
        store(quad_at(out, 8 * s + sub, e), lookup(table, vand(v[j], mask)));
        store(quad_at(out, 8 * s + sub, e + 4), lookup(table, vand(srl(v[j], 4), mask)));
      }
    }
  }
}

#endif  // STATELM_GGUF_AVX2

}  // namespace

Int8Tile build_int8_tile(const Part& part, int64_t column, int64_t first, int64_t values) {
  const Format& f = *part.format;
  const int64_t groups = values / f.group;
  TileBuffers out{scratch<uint8_t, 3>(W * values), scratch<float, 2>(2 * W * groups), nullptr};
  out.mins = out.scales + W * groups;
#if defined(STATELM_GGUF_AVX2)
  const Rows rows = rows_of(part, column, first);
  const int64_t blocks = values / f.values;
  switch (f.type) {
    case kQ8_0: build_q8_0(rows, blocks, out); break;
    case kQ4_0:
    case kQ4_1: build_nibble_blocks(part, rows, blocks, f.type == kQ4_0 ? 2 : 4, false, out); break;
    case kIQ4_NL: build_nibble_blocks(part, rows, blocks, 2, true, out); break;
    case kQ4_K: build_q4_k(rows, blocks, out); break;
    case kQ5_K: build_q5_k(rows, blocks, out); break;
    case kQ6_K: build_q6_k(rows, blocks, out); break;
    case kIQ4_XS: build_iq4_xs(rows, blocks, out); break;
    default: return decoded_tile(part, column, first, values, out);
  }
  return {out.levels, out.scales, out.mins, &f, f.offset, values / kBlock};
#else
  return decoded_tile(part, column, first, values, out);
#endif
}

Int8Tile widen_int16(const Int8Tile& t) {
#if defined(STATELM_GGUF_VNNI)
  int16_t* out = scratch<int16_t, 4>(t.blocks * kBlock * W);
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
  int16_t* out = scratch<int16_t, 4>(t.blocks * kBlock * W);
  const __m256i offset = _mm256_set1_epi16(static_cast<int16_t>(t.offset));
  for (int64_t quad = 0; quad < t.blocks * 8; ++quad) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.levels + quad * W * 4));
    const __m256 low = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), offset));
    const __m256 high = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), offset));
    const __m256i even = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(low, high, 0x88)), 0xD8);
    const __m256i odd = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(low, high, 0xDD)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * quad * W * 2), even);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * quad + 1) * W * 2), odd);
  }
  return {reinterpret_cast<const uint8_t*>(out), t.scales, t.mins, t.format, 0, t.blocks};
#else
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

}  // namespace statelm::gguf
