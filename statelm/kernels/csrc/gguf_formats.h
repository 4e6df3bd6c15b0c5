// GGUF's quantized block formats as statelm's kernels read them: in place, row-major, as the file stores them.
//
// Every format here is decoded the same way: a block of `values` weights becomes integer levels q (int8) and,
// per group of `group` consecutive values (16 or 32), a float scale S and, for formats with a minimum, a float
// offset O, so that a weight is
//     w = S*q          or     w = S*q + O
// computed in float32 exactly as gguf-py's `gguf.quants.dequantize` computes it (S and O are products of a
// float16 and a small integer, so exact in float32; the one rounding is that of S*q, then of the addition).
// The integer levels are what the int8 and int16 matmuls multiply (gguf_matmul.h).

#pragma once

#include <cstdint>

namespace statelm::gguf {

// ggml_type ids of the block formats (ggml.h).
enum Type : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
};

constexpr int64_t kMaxBlockValues = 256;

// One block: levels q[values], scales[values / group] and, with `min`, mins[values / group].
using DecodeBlock = void (*)(const uint8_t* block, int8_t* q, float* scales, float* mins);

// A superblock's scales as its fields hold them (the 256-value formats): per group a small integer s (and with
// `min`, m) and per superblock d (and dmin), so that S = d*s and O = -(dmin*m); the int8 matmul sums a
// superblock's groups in integers with them (gguf_matmul.h).
struct SuperblockScales {
  int32_t scales[16];
  int32_t mins[16];
  float d;
  float dmin;
};
using DecodeSuperblock = void (*)(const uint8_t* block, int8_t* q, SuperblockScales* out);

struct Format {
  int64_t type;
  const char* name;
  int64_t values;  // weights per block
  int64_t bytes;   // bytes per block
  int64_t group;   // weights sharing one scale (and min): 16 or 32
  bool min;        // w = S*q + O
  int offset;      // q + offset lies in [0, 255] for every level the format can hold
  bool narrow;     // q + offset <= 63 (two int8 x uint8 pair sums add without overflowing int16)
  DecodeBlock decode;
  DecodeSuperblock superblock = nullptr;  // the 256-value formats: their integer scales
};

// The format of a ggml type id, or nullptr when it is not one of the block formats above.
const Format* find_format(int64_t type);

}  // namespace statelm::gguf
