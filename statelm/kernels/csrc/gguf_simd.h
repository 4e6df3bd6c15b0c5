// Vector helpers of the GGUF matmul's SIMD builds, one name for the AVX-512 (16 columns a vector) and the AVX2 (8)
// form, so that tile builders and kernels are written once for both (gguf_tiles.cpp, gguf_matmul_int.cpp).

#pragma once

#include "gguf_matmul.h"

#if defined(STATELM_GGUF_AVX2)

namespace statelm::gguf::simd {

#if defined(STATELM_GGUF_VNNI)
using V = __m512i;
using VF = __m512;
constexpr int64_t kVecBytes = 64;
inline V zero() { return _mm512_setzero_si512(); }
inline V load(const void* p) { return _mm512_loadu_si512(p); }
inline void store(void* p, V v) { _mm512_storeu_si512(p, v); }
inline VF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline V set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline V set32(int v) { return _mm512_set1_epi32(v); }
inline VF set_f(float v) { return _mm512_set1_ps(v); }
inline V vand(V a, V b) { return _mm512_and_si512(a, b); }
inline V vor(V a, V b) { return _mm512_or_si512(a, b); }
inline V vxor(V a, V b) { return _mm512_xor_si512(a, b); }
inline V sub32(V a, V b) { return _mm512_sub_epi32(a, b); }
inline V srl(V a, unsigned n) { return _mm512_srli_epi32(a, n); }
inline V sll(V a, unsigned n) { return _mm512_slli_epi32(a, n); }
inline V sra(V a, unsigned n) { return _mm512_srai_epi32(a, n); }
inline V lookup(V table, V index) { return _mm512_shuffle_epi8(table, index); }  // within each 128 bits
inline V add8(V a, V b) { return _mm512_add_epi8(a, b); }
inline V min8(V a, V b) { return _mm512_min_epu8(a, b); }
// Byte b of a 128-bit lane: the index of its 32-bit word's first byte (for lookup: a word's bytes replicated).
inline V lane_bytes() { return _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C)); }
inline V table16(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
inline VF to_float(V v) { return _mm512_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF negate(VF a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
inline VF half_low(V v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline VF half_high(V v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }
// Four 16-byte runs as one vector, the first in the low 128 bits.
inline V quarters(const uint8_t* a, const uint8_t* b, const uint8_t* c, const uint8_t* d) {
  const auto q = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(q(a)), q(b), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_inserti128_si256(_mm256_castsi128_si256(q(c)), q(d), 1), 1);
}
inline V halves(const uint8_t* a, const uint8_t* b) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// r[i] = the 16 words of vector i: afterwards r[j] = word j of r[0..15].
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

// The 32-bit word at p in every lane, loaded as such (a word read into a general register first costs a one-row
// loop two instructions a quad).
inline V broadcast32(const void* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// sum + the exact dot products of 4 uint8 levels by 4 int8 activations (x: their word in every lane), per lane.
inline V dot_quad(V sum, V levels, V x, bool) { return _mm512_dpbusd_epi32(sum, levels, x); }

inline V add32(V a, V b) { return _mm512_add_epi32(a, b); }
inline V mul32(V a, V b) { return _mm512_mullo_epi32(a, b); }
// A 256-value format's integer scale or min per lane as the int8 kernels keep it (a slot): here the integer itself,
// which multiplies a group's int32 sums (mul32).
inline V scale_slot(V s) { return s; }
// Two groups' slots as one lane of two int16 (the even group's low).
inline V pair_of(V even, V odd) { return vor(vand(even, set32(0xFFFF)), sll(odd, 16)); }
// sum + a . b per lane, a and b two int16 each (vpdpwssd).
inline V dot16(V sum, V a, V b) { return _mm512_dpwssd_epi32(sum, a, b); }
#else
using V = __m256i;
using VF = __m256;
constexpr int64_t kVecBytes = 32;
inline V zero() { return _mm256_setzero_si256(); }
inline V load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store(void* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline V set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline V set32(int v) { return _mm256_set1_epi32(v); }
inline VF set_f(float v) { return _mm256_set1_ps(v); }
inline V vand(V a, V b) { return _mm256_and_si256(a, b); }
inline V vor(V a, V b) { return _mm256_or_si256(a, b); }
inline V vxor(V a, V b) { return _mm256_xor_si256(a, b); }
inline V sub32(V a, V b) { return _mm256_sub_epi32(a, b); }
inline V srl(V a, unsigned n) { return _mm256_srli_epi32(a, n); }
inline V sll(V a, unsigned n) { return _mm256_slli_epi32(a, n); }
inline V sra(V a, unsigned n) { return _mm256_srai_epi32(a, n); }
inline V lookup(V table, V index) { return _mm256_shuffle_epi8(table, index); }  // within each 128 bits
inline V add8(V a, V b) { return _mm256_add_epi8(a, b); }
inline V min8(V a, V b) { return _mm256_min_epu8(a, b); }
inline V lane_bytes() { return _mm256_broadcastsi128_si256(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C)); }
inline V table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
inline VF to_float(V v) { return _mm256_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF negate(VF a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
inline __m128i low_halves(V v) {  // the low 16 bits of each word, packed
  const V masked = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  return _mm_packus_epi32(_mm256_castsi256_si128(masked), _mm256_extracti128_si256(masked, 1));
}
inline VF half_low(V v) { return _mm256_cvtph_ps(low_halves(v)); }
inline VF half_high(V v) { return _mm256_cvtph_ps(low_halves(_mm256_srli_epi32(v, 16))); }
inline V halves(const uint8_t* a, const uint8_t* b) {
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}

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

// Narrow levels (uint8 below 64) times 4 int8 activations per 32-bit lane: vpmaddubsw's sums of pairs in int16,
// which a few quads may add in int16 while no sum reaches 32768, then widened into int32 sums by vpmaddwd.
inline V pair_sums(V levels, V x) { return _mm256_maddubs_epi16(levels, x); }
inline V add16(V a, V b) { return _mm256_add_epi16(a, b); }
// sum + a . b per lane, a and b two int16 each (vpmaddwd, then an add).
inline V dot16(V sum, V a, V b) { return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b)); }
inline V widen_pairs(V sum, V pairs) { return dot16(sum, pairs, _mm256_set1_epi16(1)); }

// Wide levels (Q8_0, IQ4: signed, stored + 128) as vpmaddubsw takes them: magnitudes (|-128| reads as 128), and the
// signed levels whose signs move to the activations.
struct WideQuad {
  V magnitudes;
  V levels;
};
// Wide levels stored as q xor flip (flip: 0x80 in every byte for q + 128, 0 for signed q).
inline WideQuad wide_quad(V stored, V flip) {
  const V w = _mm256_xor_si256(stored, flip);
  return {_mm256_sign_epi8(w, w), w};
}
inline WideQuad wide_quad(V stored) { return wide_quad(stored, _mm256_set1_epi8(static_cast<char>(0x80))); }
// The int16 pair sums of wide levels times 4 int8 activations (x: their word in every lane).
inline V wide_pair_sums(const WideQuad& w, V x) {
  return _mm256_maddubs_epi16(w.magnitudes, _mm256_sign_epi8(x, w.levels));
}
inline V dot_wide(V sum, const WideQuad& w, V x) { return widen_pairs(sum, wide_pair_sums(w, x)); }

// The 32-bit word at p in every lane, loaded as such (a word read into a general register first costs a one-row
// loop two instructions a quad).
inline V broadcast32(const void* p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }

// sum + the exact dot products of 4 levels by 4 int8 activations (x: their word in every lane), per 32-bit lane:
// uint8 levels below 64 (narrow formats), or wide ones.
inline V dot_quad(V sum, V levels, V x, bool wide) {
  if (wide) return dot_wide(sum, wide_quad(levels), x);
  return widen_pairs(sum, pair_sums(levels, x));
}

inline V add32(V a, V b) { return _mm256_add_epi32(a, b); }
inline V mul32(V a, V b) { return _mm256_mullo_epi32(a, b); }
// A 256-value format's integer scale or min per lane as the int8 kernels keep it (a slot): the integer in both
// 16-bit halves of its lane, so that dot16 multiplies int16 pair sums by it as it widens them.
inline V scale_slot(V s) { return vor(vand(s, set32(0xFFFF)), sll(s, 16)); }
// Two groups' slots as one lane of two int16 (the even group's low).
inline V pair_of(V even, V odd) { return _mm256_blend_epi16(even, odd, 0xAA); }
#endif

// A running sum as it stands (a compiler barrier on the value): its additions stay one chain. Integer sums are
// otherwise reassociated into many partial sums computed ahead, which the AVX2 build's 16 registers cannot hold:
// the tile kernel spilled every row's partial sums (kept in one chain, 256 rows of Q8_0 and Q6_K 1.03-1.1x).
inline V running(V sum) {
  asm("" : "+x"(sum));
  return sum;
}

constexpr int kWords = kVecBytes / 4;  // 32-bit lanes: one per tile column
static_assert(kWords == kTileColumns, "one column per 32-bit lane");

// A group's float steps for one row (see gguf_matmul.h): acc = fma(float(I), S * dx, acc), then with a minimum
// acc = fma(O, sx, acc); I is `total` less offset * (sum of the group's activation levels).
template <bool kMin>
inline VF group_step(VF acc, V total, int32_t offset_sum, VF scales, float dx, const float* mins, float sx) {
  if (offset_sum) total = sub32(total, set32(offset_sum));
  acc = fma(to_float(total), mul(scales, set_f(dx)), acc);
  if constexpr (kMin) acc = fma(load_f(mins), set_f(sx), acc);
  return acc;
}

// The float steps closing a superblock of a 256-value format for R rows (gguf_matmul.h): total[r] (the sum over its
// groups of s_g times the group sums of levels + offset) less offset * sum(s_g X_g), times d * dx, and with a
// minimum M = sum(m_g X_g) times -dmin * dx. The superblock's slots (scale_slot) at scale_slots / min_slots +
// g * kVecBytes; row r's X_g two by two (IntRows::level_pairs) at level_pairs[r * pairs_stride + g / 2], its dx at
// dx[r * dx_stride]. total[r] is zeroed for the next superblock.
template <int R, int kGroups, bool kMin>
__attribute__((always_inline)) inline void close_superblock(const uint8_t* scale_slots, const uint8_t* min_slots,
                                                            VF d, VF neg_dmin, int offset, const int32_t* level_pairs,
                                                            int64_t pairs_stride, const float* dx, int64_t dx_stride,
                                                            V total[R], VF acc[R]) {
  constexpr int kPairs = kGroups / 2;
  const auto pair = [](const uint8_t* slots, int j) __attribute__((always_inline)) {
    return pair_of(load(slots + 2 * j * kVecBytes), load(slots + (2 * j + 1) * kVecBytes));
  };
  V scale_pairs[kPairs], min_pairs[kPairs];  // formed once for the R rows
  for (int j = 0; j < kPairs; ++j) {
    if (offset) scale_pairs[j] = pair(scale_slots, j);
    if constexpr (kMin) min_pairs[j] = pair(min_slots, j);
  }
  for (int r = 0; r < R; ++r) {
    const int32_t* xs = level_pairs + r * pairs_stride;
    V t = total[r];
    if (offset) {
      V o = zero();
      for (int j = 0; j < kPairs; ++j) o = dot16(o, scale_pairs[j], broadcast32(xs + j));
      t = sub32(t, mul32(o, set32(offset)));
    }
    const VF dxr = set_f(dx[r * dx_stride]);
    acc[r] = fma(to_float(t), mul(d, dxr), acc[r]);
    if constexpr (kMin) {
      V m = zero();
      for (int j = 0; j < kPairs; ++j) m = dot16(m, min_pairs[j], broadcast32(xs + j));
      acc[r] = fma(to_float(m), mul(neg_dmin, dxr), acc[r]);
    }
    total[r] = zero();
  }
}

}  // namespace statelm::gguf::simd

#endif  // STATELM_GGUF_AVX2
