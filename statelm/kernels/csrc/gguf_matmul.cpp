// torch.ops.statelm.gguf_matmul(x [M, K] float32, weights, types, arithmetic) -> y [M, N] = x @ W.T
// torch.ops.statelm.gguf_matmul_groups(xs, weights, types, parts, arithmetics) -> ys: several gguf_matmul calls at
//   once (a mixture of experts' experts, each on its own tokens), their tiles shared among the threads together
// torch.ops.statelm.gguf_dequantize(weight, type, rows?) -> the float32 rows of one block matrix
// torch.ops.statelm.gguf_interleave(weight, type) -> the block matrix in the interleaved layout (gguf_tiles.h)
//
// `weights` are uint8 tensors [rows, row bytes], each a block matrix of ggml type `types[i]` as the GGUF file
// stores it (usually a view of the memory-mapped file), or interleaved (`types[i]` | kInterleavedType: the first
// `rows` rows of gguf_interleave's result); their rows are stacked into the N output columns in order. `arithmetic`: 0 float32 activations, 1 int8, 2 int16 (see gguf_matmul.h).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_matmul.h"
#include "gguf_simd.h"
#include "gguf_tiles.h"
#include "huge_pages.h"
#include "parallel.h"

namespace statelm::gguf {

namespace {

// Bytes of a mapped matrix gguf_interleave copies before it hands their pages back.
constexpr int64_t kReleaseBytes = int64_t{8} << 20;

// Whether a tile's rows are first copied into a per-thread buffer, in address order, and read from there. The tile
// builders read their 8 or 16 rows side by side, a few hundred bytes of each at a time: the hardware prefetchers
// keep up with that only where rows are long and read in address order. Short rows (up to 2 KiB: Q4_K, Q6_K, Q4_1
// at K = 2048 and less) and Q6_K's blocks (read from their end: the scales first) came from memory at 4-6 GB/s
// where one copy streams them at the machine's rate and the kernel then reads them from L1/L2 (bench.qdecode:
// 1.4-1.7x at one to eight rows); longer rows of the other formats read directly were faster than copied. The
// copy holds the same bytes, so results do not change. (Software prefetches of the next tile did not help: in
// tile order they halved the rate of long rows, in address order they made no difference.)
bool stage_tiles(const Part& part, int64_t k) {
  if (part.interleaved) return false;  // already in the order the builders read
  return k / part.format->values * part.format->bytes <= 2048 || part.format->type == kQ6_K;
}

// The tile of columns [column, column + kTileColumns) of part as a part of its own: its rows copied side by side
// into this thread's buffer (valid until the next call on the thread).
Part staged_tile(const Part& part, int64_t column, int64_t k) {
  const int64_t row_bytes = k / part.format->values * part.format->bytes;
  const int64_t count = std::min(kTileColumns, part.rows - column);
  uint8_t* buffer = scratch<uint8_t, 7>(kTileColumns * row_bytes);
  if (part.row_stride == row_bytes) {
    std::memcpy(buffer, part.data + column * row_bytes, count * row_bytes);
  } else {
    for (int64_t c = 0; c < count; ++c) {
      std::memcpy(buffer + c * row_bytes, part.data + (column + c) * part.row_stride, row_bytes);
    }
  }
  return {buffer, row_bytes, part.format, count, part.first_column + column};
}

// The largest magnitude of a block of 32 values.
inline float block_amax(const float* values) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(values), b = _mm512_loadu_ps(values + 16);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#elif defined(STATELM_GGUF_AVX2)
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(values + 8 * i)));
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
  return _mm256_cvtss_f32(m);
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(values[i]));
  return amax;
#endif
}

// One block of 32 values: q = round(x * inverse) (half to even, the default rounding of every build) and its two
// halves' level sums. The vector builds make the same float steps as the scalar one.
template <typename T>
inline void quantize_block(const float* values, float inverse, T* q, int32_t halves[2]) {
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inverse);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(values), scale));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(values + 16), scale));
  halves[0] = _mm512_reduce_add_epi32(qa);
  halves[1] = _mm512_reduce_add_epi32(qb);
  if constexpr (sizeof(T) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(qa));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(qb));
  }
#elif defined(STATELM_GGUF_AVX2)
  const __m256 scale = _mm256_set1_ps(inverse);
  __m256i levels[4];
  for (int i = 0; i < 4; ++i) levels[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * i), scale));
  for (int h = 0; h < 2; ++h) {
    __m256i sum = _mm256_add_epi32(levels[2 * h], levels[2 * h + 1]);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    halves[h] = _mm_cvtsi128_si32(s);
  }
  // packs interleave 128-bit lanes: 0xD8 puts the 64-bit quarters back in value order
  const __m256i low = _mm256_permute4x64_epi64(_mm256_packs_epi32(levels[0], levels[1]), 0xD8);
  const __m256i high = _mm256_permute4x64_epi64(_mm256_packs_epi32(levels[2], levels[3]), 0xD8);
  if constexpr (sizeof(T) == 1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi16(low, high), 0xD8));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), high);
  }
#else
  halves[0] = halves[1] = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(values[i] * inverse));
    q[i] = static_cast<T>(v);
    halves[i / 16] += v;
  }
#endif
}

#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
// IntRows::grouped_pairs of rows [m0, m0 + G) (rows past M zero): 8 rows' 16 levels widened to int16, 8 words a
// row, transposed into [word][G].
void group_pairs(const int8_t* levels, int64_t m0, int64_t rows, int64_t k, int32_t* out) {
  constexpr int64_t G = IntRows::kGroupRows;
  int32_t* into = out + m0 * (k / 2);
  for (int64_t v = 0; v < k; v += 16) {
    simd::V words[G];
    for (int64_t r = 0; r < G; ++r) {
      words[r] = m0 + r < rows ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                     levels + (m0 + r) * k + v)))
                               : simd::zero();
    }
    simd::transpose(words);
    for (int64_t w = 0; w < G; ++w) simd::store(into + (v / 2 + w) * G, words[w]);
  }
}
#endif

// Per row and span of values (32, or a superblock's 256): amax, dx = amax / limit, and each block of 32's levels
// (quantize_block); sums of the levels per 16 and per 32 values, and dx times them; where `quads` (a tile kernel
// will read the rows), IntRows::grouped too, and where `pairs` (int8 levels only) IntRows::grouped_pairs.
template <typename T>
void quantize_rows(const at::Tensor& x, int32_t limit, int64_t span, bool quads, bool pairs, std::vector<T>& levels,
                   IntRows& out) {
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0), blocks = k / kBlock, per_span = span / kBlock;
  out.k = k;
  out.rows = rows;
  levels.resize(rows * k);
  out.dx.resize(rows * blocks);
  out.sums16.resize(rows * blocks * 2);
  out.sums32.resize(rows * blocks);
  out.sx16.resize(rows * blocks * 2);
  out.sx32.resize(rows * blocks);
  out.pairs16.resize(span == kSuperblock ? rows * blocks : 0);
  out.pairs32.resize(span == kSuperblock ? rows * blocks / 2 : 0);
#if defined(STATELM_GGUF_AVX2)
  // IntRows::grouped: word w of row m at [m / G][w][m % G] (resize zeroes the rows past M)
  constexpr int64_t G = IntRows::kGroupRows;
  const int64_t words = k * static_cast<int64_t>(sizeof(T)) / 4;
  if (quads) out.grouped.resize((rows + G - 1) / G * G * words);
#endif
  const float* in = x.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 8192 / k);
  statelm::parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b0 = 0; b0 < blocks; b0 += per_span) {
        float amax = 0.0f;
        for (int64_t b = b0; b < b0 + per_span; ++b) amax = std::max(amax, block_amax(in + m * stride + b * kBlock));
        const float inverse = amax > 0.0f ? static_cast<float>(limit) / amax : 0.0f;
        const float dx = amax / static_cast<float>(limit);
        for (int64_t b = b0; b < b0 + per_span; ++b) {
          int32_t halves[2];
          quantize_block(in + m * stride + b * kBlock, inverse, levels.data() + m * k + b * kBlock, halves);
          const int64_t at = m * blocks + b;
          out.dx[at] = dx;
          for (int h = 0; h < 2; ++h) {
            out.sums16[2 * at + h] = halves[h];
            out.sx16[2 * at + h] = dx * static_cast<float>(halves[h]);
          }
          out.sums32[at] = halves[0] + halves[1];
          out.sx32[at] = dx * static_cast<float>(halves[0] + halves[1]);
        }
      }
      if (span == kSuperblock) {
        const auto pair = [](int32_t low, int32_t high) {
          return static_cast<int32_t>((static_cast<uint32_t>(low) & 0xFFFF) | (static_cast<uint32_t>(high) << 16));
        };
        for (int64_t at = m * blocks; at < (m + 1) * blocks; ++at) {
          out.pairs16[at] = pair(out.sums16[2 * at], out.sums16[2 * at + 1]);
          if (at % 2) out.pairs32[at / 2] = pair(out.sums32[at - 1], out.sums32[at]);
        }
      }
#if defined(STATELM_GGUF_AVX2)
      if (quads) {
        int32_t* into = out.grouped.data() + m / G * G * words + m % G;
        const auto* row = reinterpret_cast<const uint8_t*>(levels.data() + m * k);
        for (int64_t w = 0; w < words; ++w) std::memcpy(into + w * G, row + 4 * w, 4);
      }
#endif
    }
  });
#if defined(STATELM_GGUF_AVX2) && !defined(STATELM_GGUF_VNNI)
  if constexpr (sizeof(T) == 1) {
    if (pairs) {
      out.grouped_pairs.resize((rows + G - 1) / G * G * (k / 2));
      statelm::parallel_for((rows + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) group_pairs(levels.data(), g * G, rows, k, out.grouped_pairs.data());
      });
    }
  }
#else
  (void)pairs;
#endif
}

std::vector<Part> parts_of(at::TensorList weights, at::IntArrayRef types, int64_t k) {
  TORCH_CHECK(weights.size() == types.size(), "gguf_matmul: one type per weight");
  std::vector<Part> parts;
  int64_t column = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const bool interleaved = (types[i] & kInterleavedType) != 0;
    const Format* f = find_format(types[i] & ~kInterleavedType);
    TORCH_CHECK(f != nullptr, "gguf_matmul: ggml type ", types[i], " is not a supported block format");
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
                "gguf_matmul: weights must be uint8 [rows, row bytes] with contiguous rows");
    const int64_t row_bytes = k / f->values * f->bytes;
    TORCH_CHECK(!interleaved || interleavable(*f, row_bytes), "gguf_matmul: ", f->name, " rows of ", row_bytes,
                " bytes have no interleaved layout here");
    TORCH_CHECK(k % f->values == 0 && w.size(1) == (interleaved ? interleaved_row_bytes(*f, row_bytes) : row_bytes),
                "gguf_matmul: a ", f->name, " weight of ", w.size(1), " bytes a row does not match K = ", k);
    TORCH_CHECK(!interleaved || w.stride(0) == w.size(1), "gguf_matmul: an interleaved weight must be contiguous");
    parts.push_back({w.data_ptr<uint8_t>(), w.stride(0), f, w.size(0), column, interleaved});
    column += w.size(0);
  }
  return parts;
}

// One x and the block matrices it multiplies (gguf_matmul's arguments), its quantized rows and its result.
struct Group {
  std::vector<Part> parts;
  Arithmetic kind;
  int64_t rows, k, n;
  IntRows quantized;        // int8 (for the 32-value formats) or int16
  IntRows superblock_rows;  // int8 for the 256-value formats
  FloatRows floats;
  at::Tensor y;
  const IntRows& int_rows(const Part& part) const {
    return kind == Arithmetic::kInt8 && sums_superblocks(*part.format) ? superblock_rows : quantized;
  }
};

Group make_group(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types, int64_t arithmetic) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32 rows");
  TORCH_CHECK(arithmetic >= 0 && arithmetic <= 2, "arithmetic must be 0 (float32), 1 (int8) or 2 (int16)");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  Group g{parts_of(weights, types, k), static_cast<Arithmetic>(arithmetic), rows, k, 0, {}, {}, {}, {}};
  for (const Part& part : g.parts) g.n += part.rows;
  g.y = at::empty({rows, g.n}, x.options());
  if (rows == 0 || g.n == 0) return g;
  // int8 rows few enough for stream_int8_rows skip the tile kernels where every part's format streams
  const bool tiles = g.kind == Arithmetic::kInt16 || !std::all_of(g.parts.begin(), g.parts.end(), [&](const Part& p) {
    return streams(*p.format, rows);
  });
  // int8 on a 256-value format sums its superblocks in integers, of x quantized per 256 values (each part's
  // arithmetic is its format's, whatever it is stacked with)
  const auto any_part = [&](auto&& test) { return std::any_of(g.parts.begin(), g.parts.end(), test); };
  const bool blocks = any_part([](const Part& p) { return !sums_superblocks(*p.format); });
  const bool superblocks = any_part([](const Part& p) { return sums_superblocks(*p.format); });
  if (g.kind == Arithmetic::kInt8 && blocks) {
    // the formats widens_int8 takes read the rows' int16 pairs where the rows pass over panels
    const bool widened = rows >= kPanelRows && any_part([](const Part& p) { return widens_int8(*p.format); });
    const bool quads = tiles && any_part([&](const Part& p) {
      return !sums_superblocks(*p.format) && !(widened && widens_int8(*p.format));
    });
    quantize_rows(x, 127, kBlock, quads, widened, g.quantized.q8, g.quantized);
  }
  if (g.kind == Arithmetic::kInt8 && superblocks) {
    quantize_rows(x, 127, kSuperblock, tiles, false, g.superblock_rows.q8, g.superblock_rows);
  }
  if (g.kind == Arithmetic::kInt16) quantize_rows(x, 32767, kBlock, tiles, false, g.quantized.q16, g.quantized);
  g.floats = {x.data_ptr<float>(), x.stride(0), rows};
  return g;
}

// Every group's y = x @ W.T, their tiles shared out among the threads together (each tile's arithmetic as alone).
void multiply(std::vector<Group>& groups) {
  struct Tile {
    int64_t group, part, column, count;  // count: tiles of the part from column on, one panel (int_tile_chunk)
  };
  // Panels where kPanelRows rows or more pass over built tiles (int kinds, parts not staged), as wide as leaves every
  // thread four of them
  int64_t all_tiles = 0;
  for (const Group& g : groups) {
    for (const Part& p : g.parts) all_tiles += g.rows > 0 ? (p.rows + kTileColumns - 1) / kTileColumns : 0;
  }
  const int64_t widest = std::clamp<int64_t>(all_tiles / (4 * statelm::num_threads()), 1, kPanelTiles);
  std::vector<Tile> tiles;
  int64_t acc_size = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    if (g.rows == 0) continue;
    for (size_t p = 0; p < g.parts.size(); ++p) {
      const Part& part = g.parts[p];
      const bool panels = g.kind != Arithmetic::kFloat && g.rows >= kPanelRows && !stage_tiles(part, g.k);
      const int64_t step = (panels ? widest : 1) * kTileColumns;
      for (int64_t c = 0; c < part.rows; c += step) {
        const int64_t count = (std::min(step, part.rows - c) + kTileColumns - 1) / kTileColumns;
        tiles.push_back({static_cast<int64_t>(i), static_cast<int64_t>(p), c, count});
      }
    }
    acc_size = std::max(acc_size, g.rows * (g.kind == Arithmetic::kFloat ? 4 : widest) * kTileColumns);
  }
  statelm::parallel_for(static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    float* acc = scratch<float, 6>(acc_size);
    for (int64_t t = begin; t < end; ++t) {
      const Group& g = groups[tiles[t].group];
      const int64_t k = g.k, rows = g.rows, n = g.n;
      const int64_t acc_width = g.kind == Arithmetic::kFloat ? 4 * kTileColumns : kTileColumns;
      // The next chunk of an interleaved part is asked for ahead, or memory idles while the rows' arithmetic runs:
      // by the VNNI build's int8 and int16 kernels a share each block (Ahead), but at one row only for the formats
      // asks_ahead_at_one_row names (the others are bound by memory already), and by the AVX2 build's so for 5 to
      // kSpreadRowsBelow - 1 rows; else all at once where a tile is built (the AVX2 build's panels, the scalar
      // build), and not for rows streamed (it halved them).
      const Part& home = g.parts[tiles[t].part];
      const bool streamed = streams(*home.format, rows);  // as int8 rows (int_tile_chunk)
      const bool spread =
          g.kind != Arithmetic::kFloat &&
          (kAskAhead ? rows > 1 || (g.kind == Arithmetic::kInt8 && asks_ahead_at_one_row(home.format->type))
                     : !streamed && rows < kSpreadRowsBelow);
      const bool at_once = !spread && (g.kind != Arithmetic::kInt8 || !streamed);
      const bool staged = stage_tiles(home, k);
      const Part part = staged ? staged_tile(home, tiles[t].column, k) : home;
      const int64_t column = staged ? 0 : tiles[t].column, count = tiles[t].count;
      std::fill(acc, acc + count * rows * acc_width, 0.0f);
      for (int64_t first = 0; first < k; first += kChunkValues) {
        const int64_t values = std::min(kChunkValues, k - first);
        Ahead ahead;
        if (spread || at_once) {
          ahead = first + kChunkValues < k
                      ? chunk_bytes(part, column, first + kChunkValues, std::min(kChunkValues, k - first - kChunkValues))
                      : chunk_bytes(part, column + count * kTileColumns, 0, std::min(kChunkValues, k));
        }
        if (at_once) ahead.all();
        if (g.kind == Arithmetic::kFloat) {
          float_tile_chunk(part, column, first, values, g.floats, acc);
        } else {
          int_tile_chunk(part, column, count, first, values, g.int_rows(home), g.kind == Arithmetic::kInt16,
                         spread ? ahead : Ahead{}, acc);
        }
      }
      float* out = g.y.data_ptr<float>();
      for (int64_t i = 0; i < count; ++i) {
        const int64_t first_column = column + i * kTileColumns;
        const int64_t columns = std::min(kTileColumns, part.rows - first_column);
        const float* results = acc + i * rows * acc_width;
        for (int64_t m = 0; m < rows; ++m) {
          float* dst = out + m * n + part.first_column + first_column;
          for (int64_t c = 0; c < columns; ++c) {
            if (g.kind == Arithmetic::kFloat) {
              const float* chains = results + (m * kTileColumns + c) * 4;
              dst[c] = (chains[0] + chains[1]) + (chains[2] + chains[3]);
            } else {
              dst[c] = results[m * kTileColumns + c];
            }
          }
        }
      }
    }
  });
}

at::Tensor gguf_matmul(const at::Tensor& x, at::TensorList weight_list, at::IntArrayRef types, int64_t arithmetic) {
  std::vector<Group> groups;
  groups.push_back(make_group(x, weight_list, types, arithmetic));
  multiply(groups);
  return groups[0].y;
}

// Several gguf_matmul calls at once: group i multiplies xs[i] by the next parts[i] of weights (and types) in
// arithmetics[i]; the results are those of the calls made one by one, bit for bit.
std::vector<at::Tensor> gguf_matmul_groups(at::TensorList xs, at::TensorList weight_list, at::IntArrayRef types,
                                           at::IntArrayRef parts, at::IntArrayRef arithmetics) {
  TORCH_CHECK(parts.size() == xs.size() && arithmetics.size() == xs.size(),
              "gguf_matmul_groups: one part count and one arithmetic per x");
  TORCH_CHECK(weight_list.size() == types.size(), "gguf_matmul_groups: one type per weight");
  std::vector<Group> groups;
  size_t next = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK(parts[i] > 0 && next + parts[i] <= weight_list.size(), "gguf_matmul_groups: parts exceed the weights");
    groups.push_back(make_group(xs[i], weight_list.slice(next, parts[i]), types.slice(next, parts[i]), arithmetics[i]));
    next += parts[i];
  }
  TORCH_CHECK(next == weight_list.size(), "gguf_matmul_groups: weights left over after the groups' parts");
  multiply(groups);
  std::vector<at::Tensor> ys;
  for (Group& g : groups) ys.push_back(g.y);
  return ys;
}

// Rows (all, or those listed) of one block matrix as float32, w = S*q (+ O) exactly as gguf-py dequantizes; `type`
// with kInterleavedType: the matrix in gguf_interleave's layout, each row gathered back into the file's bytes.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, const c10::optional<at::Tensor>& rows) {
  const bool interleaved = (type & kInterleavedType) != 0;
  const Format* f = find_format(type & ~kInterleavedType);
  TORCH_CHECK(f != nullptr, "gguf_dequantize: ggml type ", type, " is not a supported block format");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1,
              "gguf_dequantize: weight must be uint8 [rows, row bytes] with contiguous rows");
  const int64_t row_bytes = interleaved ? file_row_bytes(*f, weight.size(1)) : weight.size(1);
  TORCH_CHECK(!interleaved || (interleavable(*f, row_bytes) && interleaved_row_bytes(*f, row_bytes) == weight.size(1) &&
                               weight.stride(0) == weight.size(1)),
              "gguf_dequantize: not a contiguous interleaved ", f->name, " matrix here");
  TORCH_CHECK(row_bytes % f->bytes == 0, "gguf_dequantize: rows are not whole ", f->name, " blocks");
  const int64_t k = row_bytes / f->bytes * f->values;
  at::Tensor index = rows.has_value() ? rows->to(at::kLong).contiguous() : at::arange(weight.size(0), at::kLong);
  const int64_t count = index.numel();
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < weight.size(0), "gguf_dequantize: row ", ids[i], " out of range");
  }
  auto out = at::empty({count, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* data = weight.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  statelm::parallel_for(count, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    int8_t q[kMaxBlockValues];
    float scales[kMaxBlockValues / 16], mins[kMaxBlockValues / 16];
    std::vector<uint8_t> gathered(interleaved ? row_bytes : 0);
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = data + ids[i] * weight.stride(0);
      if (interleaved) {
        gather_row(*f, data, ids[i], row_bytes, gathered.data());
        row = gathered.data();
      }
      for (int64_t b = 0; b < k / f->values; ++b) {
        f->decode(row + b * f->bytes, q, scales, mins);
        float* w = dst + i * k + b * f->values;
        for (int64_t v = 0; v < f->values; ++v) {
          w[v] = scales[v / f->group] * static_cast<float>(q[v]);
          if (f->min) w[v] += mins[v / f->group];
        }
      }
    }
  });
  return out;
}

// The block matrix in the interleaved layout (gguf_tiles.h), [rows rounded up to kTileColumns, interleaved row
// bytes]; an empty tensor where this build has no interleaved layout for the format. release: weight views a mapped
// file, whose pages are handed back as their rows are copied (release_file_pages), a few MiB at a time, so that
// the copy and the file never both hold a matrix (the largest, an LM head, is a tenth of a 1B model).
at::Tensor gguf_interleave(const at::Tensor& weight, int64_t type, bool release) {
  const Format* f = find_format(type);
  TORCH_CHECK(f != nullptr, "gguf_interleave: ggml type ", type, " is not a supported block format");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1,
              "gguf_interleave: weight must be uint8 [rows, row bytes] with contiguous rows");
  const int64_t rows = weight.size(0), row_bytes = weight.size(1), stride = weight.stride(0);
  TORCH_CHECK(row_bytes % f->bytes == 0, "gguf_interleave: rows are not whole ", f->name, " blocks");
  if (!interleavable(*f, row_bytes)) return at::empty({0, 0}, weight.options());
  const int64_t out_row_bytes = interleaved_row_bytes(*f, row_bytes);
  auto out = statelm::empty_on_huge_pages({(rows + kTileColumns - 1) / kTileColumns * kTileColumns, out_row_bytes});
  const uint8_t* source = weight.data_ptr<uint8_t>();
  const int64_t batch = std::max<int64_t>(1, kReleaseBytes / (stride * kTileColumns)) * kTileColumns;
  for (int64_t first = 0; first < rows; first += batch) {
    const int64_t count = std::min(batch, rows - first);
    interleave_blocks(*f, source + first * stride, count, row_bytes, stride,
                      out.data_ptr<uint8_t>() + first * out_row_bytes);
    // pages wholly inside the rows copied so far; one straddling two batches goes with the second. The whole prefix
    // is advised again each time, not only the new rows: one call leaves some pages resident (advising only the new
    // rows left ~50 pages of a 68 MiB matrix, test_mapped_pages), and a later call takes them
    if (release) statelm::release_file_pages(source, source + (first + count) * stride);
  }
  return out;
}

}  // namespace
}  // namespace statelm::gguf

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("gguf_matmul(Tensor x, Tensor[] weights, int[] types, int arithmetic) -> Tensor");
  m.def("gguf_matmul_groups(Tensor[] xs, Tensor[] weights, int[] types, int[] parts, int[] arithmetics) -> Tensor[]");
  m.def("gguf_dequantize(Tensor weight, int type, Tensor? rows) -> Tensor");
  m.def("gguf_interleave(Tensor weight, int type, bool release=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) {
  m.impl("gguf_matmul", &statelm::gguf::gguf_matmul);
  m.impl("gguf_matmul_groups", &statelm::gguf::gguf_matmul_groups);
  m.impl("gguf_dequantize", &statelm::gguf::gguf_dequantize);
  m.impl("gguf_interleave", &statelm::gguf::gguf_interleave);
}
