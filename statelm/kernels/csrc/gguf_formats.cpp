// Decoders of GGUF's block formats into levels, scales and mins (see gguf_formats.h).
//
// Each follows the block layout of ggml-common.h and the arithmetic of gguf-py's dequantize_blocks: which byte
// and bit holds each value, which sub-block scale applies, and how scales and mins are formed from their fields.
// The loops are plain so that the compiler vectorises them for the build's instruction set; they run once per
// block per matmul call, against tens of multiply-adds per level.

#include "gguf_formats.h"

#include <c10/util/Half.h>

#include <cstring>

namespace statelm::gguf {
namespace {

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// 32 values from 16 bytes: low nibbles are values 0..15, high nibbles 16..31.
inline void nibbles(const uint8_t* qs, int8_t* q, int bias) {
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>((qs[i] & 0x0F) - bias);
    q[i + 16] = static_cast<int8_t>((qs[i] >> 4) - bias);
  }
}

// Q4_K and Q5_K: eight 6-bit scales and mins packed into 12 bytes.
inline void scale_min_k4(const uint8_t* s, int j, int32_t* scale, int32_t* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_q4_0(const uint8_t* b, int8_t* q, float* scales, float*) {  // d, qs[16]
  scales[0] = half(b);
  nibbles(b + 2, q, 8);
}

void decode_q4_1(const uint8_t* b, int8_t* q, float* scales, float* mins) {  // d, m, qs[16]
  scales[0] = half(b);
  mins[0] = half(b + 2);
  nibbles(b + 4, q, 0);
}

// Q5_0 and Q5_1: the fifth bit of value i is bit i of the little-endian 32-bit qh.
inline void fifth_bits(const uint8_t* qh_bytes, const uint8_t* qs, int8_t* q, int bias) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof(qh));
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>(((qs[i] & 0x0F) | (((qh >> i) & 1) << 4)) - bias);
    q[i + 16] = static_cast<int8_t>(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - bias);
  }
}

void decode_q5_0(const uint8_t* b, int8_t* q, float* scales, float*) {  // d, qh[4], qs[16]
  scales[0] = half(b);
  fifth_bits(b + 2, b + 6, q, 16);
}

void decode_q5_1(const uint8_t* b, int8_t* q, float* scales, float* mins) {  // d, m, qh[4], qs[16]
  scales[0] = half(b);
  mins[0] = half(b + 2);
  fifth_bits(b + 4, b + 8, q, 0);
}

void decode_q8_0(const uint8_t* b, int8_t* q, float* scales, float*) {  // d, qs[32]
  scales[0] = half(b);
  std::memcpy(q, b + 2, 32);
}

// Q2_K: scales[16] (4-bit scale, 4-bit min per 16 values), qs[64] (2 bits a value), d, dmin.
void decode_q2_k(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  const uint8_t* qs = b + 16;
  out->d = half(b + 80);
  out->dmin = half(b + 82);
  for (int s = 0; s < 16; ++s) {
    out->scales[s] = b[s] & 0x0F;
    out->mins[s] = b[s] >> 4;
  }
  for (int h = 0; h < 2; ++h) {
    for (int shift = 0; shift < 4; ++shift) {
      for (int i = 0; i < 32; ++i) q[h * 128 + shift * 32 + i] = static_cast<int8_t>((qs[h * 32 + i] >> (2 * shift)) & 3);
    }
  }
}

// Q3_K: hmask[32] (high bit, set meaning no -4), qs[64] (low 2 bits), scales[12] (16 6-bit, minus 32), d.
void decode_q3_k(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  out->d = half(b + 108);
  for (int s = 0; s < 16; ++s) {
    const int low = (s < 8 ? packed[s] : packed[s - 8] >> 4) & 0x0F;
    const int high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
    out->scales[s] = (low | (high << 4)) - 32;
  }
  for (int h = 0; h < 2; ++h) {
    for (int shift = 0; shift < 4; ++shift) {
      for (int i = 0; i < 32; ++i) {
        const int value = h * 128 + shift * 32 + i;
        const int low = (qs[h * 32 + i] >> (2 * shift)) & 3;
        const int high = (hmask[i] >> (value / 32)) & 1;
        q[value] = static_cast<int8_t>(low - (high ? 0 : 4));
      }
    }
  }
}

// Q4_K and Q5_K: d, dmin, then eight 6-bit scales and mins in 12 bytes.
inline void k4_header(const uint8_t* b, SuperblockScales* out) {
  out->d = half(b);
  out->dmin = half(b + 2);
  for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, &out->scales[j], &out->mins[j]);
}

// Q4_K: d, dmin, scales[12], qs[128]: bytes 32c..32c+31 hold sub-block 2c (low nibbles) and 2c+1 (high).
void decode_q4_k(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  k4_header(b, out);
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 32; ++i) {
      q[64 * c + i] = static_cast<int8_t>(qs[32 * c + i] & 0x0F);
      q[64 * c + 32 + i] = static_cast<int8_t>(qs[32 * c + i] >> 4);
    }
  }
}

// Q5_K: Q4_K's fields, then qh[32] (bit j of byte i: fifth bit of sub-block j's value i), then qs[128].
void decode_q5_k(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  k4_header(b, out);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 32; ++i) {
      q[64 * c + i] = static_cast<int8_t>((qs[32 * c + i] & 0x0F) | (((qh[i] >> (2 * c)) & 1) << 4));
      q[64 * c + 32 + i] = static_cast<int8_t>((qs[32 * c + i] >> 4) | (((qh[i] >> (2 * c + 1)) & 1) << 4));
    }
  }
}

// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, per 16 values), d. Value 128h + 32s + i
// takes its low bits from ql[64h + 32(s % 2) + i] (low nibble for s < 2) and its high bits from qh[32h + i].
void decode_q6_k(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  out->d = half(b + 208);
  for (int s = 0; s < 16; ++s) out->scales[s] = sc[s];
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int i = 0; i < 32; ++i) {
        const uint8_t low = ql[64 * h + 32 * (s % 2) + i];
        const int nibble = s < 2 ? low & 0x0F : low >> 4;
        const int high = (qh[32 * h + i] >> (2 * s)) & 3;
        q[128 * h + 32 * s + i] = static_cast<int8_t>((nibble | (high << 4)) - 32);
      }
    }
  }
}

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline void iq4_levels(const uint8_t* qs, int8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = kIQ4Values[qs[i] & 0x0F];
    q[i + 16] = kIQ4Values[qs[i] >> 4];
  }
}

void decode_iq4_nl(const uint8_t* b, int8_t* q, float* scales, float*) {  // d, qs[16]
  scales[0] = half(b);
  iq4_levels(b + 2, q);
}

// IQ4_XS: d, scales_h (16 bits: 2 high bits per sub-block), scales_l[4] (4 low bits), qs[128] (16 per sub-block).
void decode_iq4_xs(const uint8_t* b, int8_t* q, SuperblockScales* out) {
  out->d = half(b);
  uint16_t high;
  std::memcpy(&high, b + 2, sizeof(high));
  for (int j = 0; j < 8; ++j) {
    const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
    out->scales[j] = (low | (((high >> (2 * j)) & 3) << 4)) - 32;
    iq4_levels(b + 8 + 16 * j, q + 32 * j);
  }
}

// A superblock format's float scales and mins from its integer ones: S = d*s, O = -(dmin*m).
template <DecodeSuperblock kDecode, int kGroups, bool kMin>
void decode_scaled(const uint8_t* b, int8_t* q, float* scales, float* mins) {
  SuperblockScales sb;
  kDecode(b, q, &sb);
  for (int g = 0; g < kGroups; ++g) {
    scales[g] = sb.d * static_cast<float>(sb.scales[g]);
    if constexpr (kMin) mins[g] = -(sb.dmin * static_cast<float>(sb.mins[g]));
  }
}

constexpr Format kFormats[] = {
    {kQ4_0, "Q4_0", 32, 18, 32, false, 8, true, decode_q4_0},
    {kQ4_1, "Q4_1", 32, 20, 32, true, 0, true, decode_q4_1},
    {kQ5_0, "Q5_0", 32, 22, 32, false, 16, true, decode_q5_0},
    {kQ5_1, "Q5_1", 32, 24, 32, true, 0, true, decode_q5_1},
    {kQ8_0, "Q8_0", 32, 34, 32, false, 128, false, decode_q8_0},
    {kQ2_K, "Q2_K", 256, 84, 16, true, 0, true, decode_scaled<decode_q2_k, 16, true>, decode_q2_k},
    {kQ3_K, "Q3_K", 256, 110, 16, false, 4, true, decode_scaled<decode_q3_k, 16, false>, decode_q3_k},
    {kQ4_K, "Q4_K", 256, 144, 32, true, 0, true, decode_scaled<decode_q4_k, 8, true>, decode_q4_k},
    {kQ5_K, "Q5_K", 256, 176, 32, true, 0, true, decode_scaled<decode_q5_k, 8, true>, decode_q5_k},
    {kQ6_K, "Q6_K", 256, 210, 16, false, 32, true, decode_scaled<decode_q6_k, 16, false>, decode_q6_k},
    {kIQ4_NL, "IQ4_NL", 32, 18, 32, false, 128, false, decode_iq4_nl},
    {kIQ4_XS, "IQ4_XS", 256, 136, 32, false, 128, false, decode_scaled<decode_iq4_xs, 8, false>, decode_iq4_xs},
};

}  // namespace

const Format* find_format(int64_t type) {
  for (const Format& format : kFormats) {
    if (format.type == type) return &format;
  }
  return nullptr;
}

}  // namespace statelm::gguf
