// The int8 and int16 arithmetics of the GGUF matmul (see gguf_matmul.h): exact integer group sums, then float.
//
// A tile's decoded levels are laid out so that one vector load holds a few values of every column of the tile,
// and each row's activations are broadcast against it; vector lanes are output columns, so no horizontal sums:
//   AVX512-VNNI, 16 columns: int8 levels + offset as uint8 [block][8 quads][16][4], one vpdpbusd per quad and
//     row; int16 levels [block][16 pairs][16][2], one vpdpwssd per pair and row.
//   AVX2, 8 columns: int8 as uint8 levels + offset (narrow formats: vpmaddubsw pairs of two quads add in int16)
//     or as signed levels (Q8_0, IQ4: the sign moves to the activations); int16 levels with vpmaddwd, two tiles a
//     broadcast on 32-value groups without a minimum (rows_tile_pair), which the int8 rows of Q8_0 and IQ4_NL take
//     in panels (widens_int8).
//   scalar: the decoded levels as they are.
// SIMD builds read the rows' activations from IntRows::grouped (8 rows' words side by side): one pointer, fixed
// offsets.
// Levels stored with an offset give sum((q + offset) * x) = I + offset * sum(x): the group's activation sum
// times the offset is subtracted, so every build reaches the same exact I. int8 on a 256-value format (kSuper) sums
// a superblock's groups times their integer scales (AVX2: in the vpmaddwd that widens the pair sums; VNNI: a
// vpmulld a group) and takes its float steps once, after its last block (close_superblock).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "gguf_matmul.h"
#include "gguf_simd.h"
#include "gguf_tiles.h"

namespace statelm::gguf {
namespace {

constexpr int64_t W = kTileColumns;
constexpr int kRowsPerTile = IntRows::kGroupRows;

#if defined(STATELM_GGUF_AVX2)
using namespace simd;

// acc[r] += the float step of group h of block b (kb in K) for R rows; a block's groups in K order.
template <int R, bool kG16, bool kMin>
inline void add_group(const Int8Tile& t, const IntRows& x, int64_t m0, int64_t b, int64_t kb, int h, int offset,
                      const V sums[R], VF acc[R]) {
  const int64_t size = kG16 ? 16 : 32, group = kG16 ? 2 * kb + h : kb, tile_group = kG16 ? 2 * b + h : b;
  const VF scales = load_f(t.scales + tile_group * W);
  for (int r = 0; r < R; ++r) {
    const int32_t offset_sum = offset ? offset * x.sum(m0 + r, group, size) : 0;
    acc[r] = group_step<kMin>(acc[r], sums[r], offset_sum, scales, x.scale(m0 + r, kb), t.mins + tile_group * W,
                              kMin ? x.sx(m0 + r, group, size) : 0.0f);
  }
}

// The slot (scale_slot) of a 256-value format's group g of the tile: its integer scale, or with kMins its min.
template <bool kMins = false>
inline V tile_slot(const Int8Tile& t, int64_t g) {
  return scale_slot(load((kMins ? t.sub_mins : t.sub_scales) + g * W));
}

// Closes superblock s of the tile (superblock in K) for R rows (close_superblock).
template <int R, bool kG16, bool kMin>
inline void close_tile_superblock(const Int8Tile& t, const IntRows& x, int64_t m0, int64_t s, int64_t superblock,
                                  int offset, V total[R], VF acc[R]) {
  constexpr int kGroups = kG16 ? 16 : 8;
  constexpr int64_t size = kG16 ? 16 : 32;
  V scale_slots[kGroups], min_slots[kMin ? kGroups : 1];  // scales: read only to take an offset out
  for (int g = 0; g < kGroups; ++g) {
    if (offset) scale_slots[g] = tile_slot(t, kGroups * s + g);
    if constexpr (kMin) min_slots[g] = tile_slot<true>(t, kGroups * s + g);
  }
  close_superblock<R, kGroups, kMin>(reinterpret_cast<const uint8_t*>(scale_slots),
                                     reinterpret_cast<const uint8_t*>(min_slots), load_f(t.d + s * W),
                                     kMin ? load_f(t.neg_dmin + s * W) : set_f(0.0f), offset,
                                     x.level_pairs(m0, superblock * kGroups, size), x.k / size / 2,
                                     x.dx.data() + m0 * (x.k / kBlock) + superblock * (kSuperblock / kBlock),
                                     x.k / kBlock, total, acc);
}

// Whether block kb (in K) is its superblock's last.
inline bool ends_superblock(int64_t kb) { return kb % (kSuperblock / kBlock) == kSuperblock / kBlock - 1; }
#endif

#if defined(STATELM_GGUF_VNNI)
// R rows: one vpdpbusd (uint8 levels + offset) or vpdpwssd (int16 pairs) per quad or pair and row; kSuper (int8 on
// a 256-value format): each group's sums times its integer scale into the superblock's total.
template <int R, bool kInt16, bool kG16, bool kMin, bool kSuper>
void rows_tile(const Int8Tile& t, const IntRows& x, const int32_t* words, int64_t m0, int64_t block0,
               const Ahead& ahead, float* acc) {
  constexpr int kSteps = kInt16 ? 16 : 8;  // words of a block's activations a row
  constexpr int64_t kBlockBytes = kInt16 ? 2 * W * kBlock : W * kBlock;
  constexpr int64_t G = IntRows::kGroupRows;
  const int32_t* group = words + m0 * (x.k / kBlock * kSteps);  // m0: a multiple of G (run_rows)
  VF a[R];
  V total[R];
  for (int r = 0; r < R; ++r) a[r] = load_f(acc + (m0 + r) * W), total[r] = zero();
  const Ahead::Shares shares = ahead.shares(t.blocks);
  for (int64_t b = 0; b < t.blocks; ++b) {
    shares.ask(b);
    const int64_t kb = block0 + b;
    const int32_t* xs = group + kb * kSteps * G;  // the rows' words of block kb: [step][G]
    V sums[2][R];
    for (int r = 0; r < R; ++r) sums[0][r] = sums[1][r] = zero();
#pragma GCC unroll 16
    for (int step = 0; step < kSteps; ++step) {
      const V w = _mm512_loadu_si512(t.levels + b * kBlockBytes + step * 64);
      const int half = kG16 && step >= kSteps / 2 ? 1 : 0;
      for (int r = 0; r < R; ++r) {
        const V xr = _mm512_set1_epi32(xs[step * G + r]);
        if constexpr (kInt16) {
          sums[half][r] = _mm512_dpwssd_epi32(sums[half][r], w, xr);
        } else {
          sums[half][r] = _mm512_dpbusd_epi32(sums[half][r], w, xr);
        }
      }
    }
    for (int h = 0; h < (kG16 ? 2 : 1); ++h) {
      if constexpr (kSuper) {
        const V s = tile_slot(t, kG16 ? 2 * b + h : b);
        for (int r = 0; r < R; ++r) total[r] = add32(total[r], mul32(sums[h][r], s));
      } else {
        add_group<R, kG16, kMin>(t, x, m0, b, kb, h, t.offset, sums[h], a);
      }
    }
    if (kSuper && ends_superblock(kb)) {
      close_tile_superblock<R, kG16, kMin>(t, x, m0, b / 8, kb / 8, t.offset, total, a);
    }
  }
  for (int r = 0; r < R; ++r) store_f(acc + (m0 + r) * W, a[r]);
}
#elif defined(STATELM_GGUF_AVX2)
// R rows: int16 pairs with vpmaddwd; narrow uint8 levels + offset with vpmaddubsw, four quads' pair sums added in
// int16 where levels are below 32 (4 * 2 * 31 * 127 < 32768: 1.1x at 256 rows of Q4_K), else two; wide levels
// (Q8_0, IQ4: + 128; an interleaved Q8_0 part read in place: signed already) back to signed, their sign moved to x.
// A block of two groups (Q6_K) finishes its first group's sums and float step before the second's, so that R rows
// need R accumulators (16 registers: two groups' 2R spilled at R = 8). kSuper (int8 on a 256-value format): vpmaddwd
// multiplies the pair sums by the group's integer scale as it widens them into the superblock's total. Asks for
// `ahead` a share each block, as VNNI's (given only below kSpreadRowsBelow rows).
template <int R, bool kInt16, bool kG16, bool kMin, bool kSuper>
void rows_tile(const Int8Tile& t, const IntRows& x, const int32_t* words, int64_t m0, int64_t block0,
               const Ahead& ahead, float* acc) {
  const bool wide = !kInt16 && !t.format->narrow;
  constexpr int kWords = kInt16 ? 16 : 8;  // words of a block's activations a row
  constexpr int kGroups = kG16 ? 2 : 1;
  constexpr int kGroupWords = kWords / kGroups;
  constexpr int64_t G = IntRows::kGroupRows;
  const int32_t* group = words + m0 * (x.k / kBlock * kWords);  // m0: a multiple of G (run_rows)
  const int offset = wide ? 0 : t.offset;
  const V flip = set8(static_cast<uint8_t>(t.flip ^ 0x80));  // wide levels' bytes to signed q
  constexpr int kQuads = kG16 ? 2 : 4;  // narrow quads added in int16: levels below 32 (the 32-value groups' formats)
  VF a[R];
  V total[R];
  for (int r = 0; r < R; ++r) a[r] = load_f(acc + (m0 + r) * W), total[r] = zero();
  const Ahead::Shares shares = ahead.shares(t.blocks);
  for (int64_t b = 0; b < t.blocks; ++b) {
    shares.ask(b);
    const int64_t kb = block0 + b;
    const int32_t* xs = group + kb * kWords * G;  // the rows' words of block kb: [word][G]
    for (int h = 0; h < kGroups; ++h) {
      V sums[R];
      for (int r = 0; r < R; ++r) sums[r] = zero();
      const V slot = kSuper ? tile_slot(t, kG16 ? 2 * b + h : b) : zero();
      if constexpr (kInt16) {
#pragma GCC unroll 16
        for (int pair = kGroupWords * h; pair < kGroupWords * (h + 1); ++pair) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.levels + b * 2 * W * kBlock + pair * 32));
          for (int r = 0; r < R; ++r) {
            sums[r] = running(dot16(sums[r], w, set32(xs[pair * G + r])));
          }
        }
      } else if (wide) {
        const uint8_t* levels = t.levels + b * W * kBlock + (b / 2 + 1) * t.pair_header;
#pragma GCC unroll 8
        for (int quad = kGroupWords * h; quad < kGroupWords * (h + 1); ++quad) {
          const WideQuad w = wide_quad(load(levels + quad * 32), flip);
          for (int r = 0; r < R; ++r) {
            const V xr = set32(xs[quad * G + r]);
            if constexpr (kSuper) {
              total[r] = running(dot16(total[r], wide_pair_sums(w, xr), slot));
            } else {
              sums[r] = running(dot_wide(sums[r], w, xr));
            }
          }
        }
      } else {
#pragma GCC unroll 4
        for (int quad = kGroupWords * h; quad < kGroupWords * (h + 1); quad += kQuads) {
          const uint8_t* w = t.levels + b * W * kBlock + quad * 32;
          const V w0 = load(w), w1 = load(w + 32);
          const V w2 = kQuads == 4 ? load(w + 64) : w0, w3 = kQuads == 4 ? load(w + 96) : w0;
          for (int r = 0; r < R; ++r) {
            V pairs = add16(pair_sums(w0, set32(xs[quad * G + r])), pair_sums(w1, set32(xs[(quad + 1) * G + r])));
            if constexpr (kQuads == 4) {
              pairs = add16(pairs, add16(pair_sums(w2, set32(xs[(quad + 2) * G + r])),
                                         pair_sums(w3, set32(xs[(quad + 3) * G + r]))));
            }
            if constexpr (kSuper) {
              total[r] = running(dot16(total[r], pairs, slot));
            } else {
              sums[r] = running(widen_pairs(sums[r], pairs));
            }
          }
        }
      }
      if constexpr (!kSuper) add_group<R, kG16, kMin>(t, x, m0, b, kb, h, offset, sums, a);
    }
    if (kSuper && ends_superblock(kb)) close_tile_superblock<R, kG16, kMin>(t, x, m0, b / 8, kb / 8, offset, total, a);
  }
  for (int r = 0; r < R; ++r) store_f(acc + (m0 + r) * W, a[r]);
}

// Two tiles of int16 pairs at once for R <= 4 rows (the rows' half `half` of group m0) and 32-value groups without
// a minimum (Q8_0, IQ4_NL widened; Q4_0, Q5_0 in int16): each row's broadcast serves both tiles, 2R accumulators
// and the two tiles' words in 11 registers. rows_tile's int16 form takes a broadcast, a vpmaddwd and an add a pair
// and row, bound by the instructions the core issues; this one a sixth fewer a multiply-add.
template <int R>
void rows_tile_pair(const Int8Tile& t0, const Int8Tile& t1, const IntRows& x, const int32_t* words, int64_t m0,
                    int64_t half, int64_t block0, float* acc0, float* acc1) {
  constexpr int kWords = 16;  // int16 pairs of a block's activations a row
  constexpr int64_t G = IntRows::kGroupRows;
  const int64_t r0 = m0 + half * 4;
  const int32_t* group = words + m0 * (x.k / kBlock * kWords) + half * 4;
  VF a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = load_f(acc0 + (r0 + r) * W), a1[r] = load_f(acc1 + (r0 + r) * W);
  for (int64_t b = 0; b < t0.blocks; ++b) {
    const int64_t kb = block0 + b;
    const int32_t* xs = group + kb * kWords * G;
    V sums0[R], sums1[R];
    for (int r = 0; r < R; ++r) sums0[r] = sums1[r] = zero();
#pragma GCC unroll 16
    for (int pair = 0; pair < kWords; ++pair) {
      const int64_t at = b * 2 * W * kBlock + pair * 32;
      const V w0 = load(t0.levels + at), w1 = load(t1.levels + at);
      for (int r = 0; r < R; ++r) {
        const V xr = set32(xs[pair * G + r]);
        sums0[r] = running(dot16(sums0[r], w0, xr));
        sums1[r] = running(dot16(sums1[r], w1, xr));
      }
    }
    add_group<R, false, false>(t0, x, r0, b, kb, 0, 0, sums0, a0);
    add_group<R, false, false>(t1, x, r0, b, kb, 0, 0, sums1, a1);
  }
  for (int r = 0; r < R; ++r) store_f(acc0 + (r0 + r) * W, a0[r]), store_f(acc1 + (r0 + r) * W, a1[r]);
}
#else
// The scalar build: signed levels [W, values] as decoded; kSuper: per superblock, T and M (gguf_matmul.h).
template <bool kInt16, bool kG16, bool kMin, bool kSuper>
void rows_scalar(const Int8Tile& t, const IntRows& x, int64_t block0, float* acc) {
  const int8_t* levels = reinterpret_cast<const int8_t*>(t.levels);
  const int64_t values = t.blocks * kBlock, size = kG16 ? 16 : 32, groups = values / size;
  const int64_t per_superblock = kSuperblock / size;
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t c = 0; c < W; ++c) {
      float a = acc[r * W + c];
      int32_t superblock_total = 0, superblock_mins = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = block0 * kBlock + g * size, group = k0 / size;
        int32_t total = 0;
        for (int64_t i = 0; i < size; ++i) {
          const int32_t xq = kInt16 ? x.q16[r * x.k + k0 + i] : x.q8[r * x.k + k0 + i];
          total += levels[c * values + g * size + i] * xq;
        }
        if constexpr (kSuper) {
          superblock_total += t.sub_scales[g * W + c] * total;
          if constexpr (kMin) superblock_mins += t.sub_mins[g * W + c] * x.sum(r, group, size);
          if (g % per_superblock == per_superblock - 1) {
            const int64_t s = g / per_superblock;
            const float dx = x.scale(r, k0 / kBlock);
            a = std::fma(static_cast<float>(superblock_total), t.d[s * W + c] * dx, a);
            if constexpr (kMin) a = std::fma(static_cast<float>(superblock_mins), t.neg_dmin[s * W + c] * dx, a);
            superblock_total = superblock_mins = 0;
          }
        } else {
          a = std::fma(static_cast<float>(total), t.scales[g * W + c] * x.scale(r, k0 / kBlock), a);
          if constexpr (kMin) a = std::fma(t.mins[g * W + c], x.sx(r, group, size), a);
        }
      }
      acc[r * W + c] = a;
    }
  }
}
#endif

// fn(std::integral_constant<int, rows>), 1 <= rows <= kMost: a count of rows as the kernels' template argument.
template <int kMost, class Fn>
__attribute__((always_inline)) inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (kMost > 1) {
    if (rows < kMost) return with_rows<kMost - 1>(rows, fn);
  }
  fn(std::integral_constant<int, kMost>());
}

// The tiles of a panel (int_tile_chunk), each with its results acc + i * rows * W.
struct Panel {
  const Int8Tile* tiles;
  int64_t count;
};

template <bool kInt16, bool kG16, bool kMin, bool kSuper>
void run_rows(const Panel& panel, const IntRows& x, const int32_t* words, int64_t block0, const Ahead& ahead,
              float* acc) {
#if defined(STATELM_GGUF_AVX2)
  for (int64_t m0 = 0; m0 < x.rows; m0 += kRowsPerTile) {
    int64_t i = 0;
#if !defined(STATELM_GGUF_VNNI)
    // int16 pairs on 32-value groups without a minimum: tiles two by two (rows_tile_pair)
    if constexpr (kInt16 && !kG16 && !kMin && !kSuper) {
      for (; i + 1 < panel.count; i += 2) {
        for (int64_t half = 0; half < 2 && m0 + 4 * half < x.rows; ++half) {
          with_rows<4>(std::min<int64_t>(4, x.rows - m0 - 4 * half), [&](auto rows) {
            rows_tile_pair<decltype(rows)::value>(panel.tiles[i], panel.tiles[i + 1], x, words, m0, half, block0,
                                                  acc + i * x.rows * W, acc + (i + 1) * x.rows * W);
          });
        }
      }
    }
#endif
    for (; i < panel.count; ++i) {
      const Ahead& asked = m0 == 0 && i == 0 ? ahead : Ahead{};  // once, by the first rows
      with_rows<kRowsPerTile>(std::min<int64_t>(kRowsPerTile, x.rows - m0), [&](auto rows) {
        rows_tile<decltype(rows)::value, kInt16, kG16, kMin, kSuper>(panel.tiles[i], x, words, m0, block0, asked,
                                                                     acc + i * x.rows * W);
      });
    }
  }
#else
  (void)ahead, (void)words;
  for (int64_t i = 0; i < panel.count; ++i) {
    rows_scalar<kInt16, kG16, kMin, kSuper>(panel.tiles[i], x, block0, acc + i * x.rows * W);
  }
#endif
}

template <bool kInt16>
void dispatch(const Panel& panel, const IntRows& x, const int32_t* words, int64_t block0, const Ahead& ahead,
              float* acc) {
  const Format& f = *panel.tiles[0].format;
  const auto run = [&]<bool kG16, bool kMin, bool kSuper>() {
    run_rows<kInt16, kG16, kMin, kSuper>(panel, x, words, block0, ahead, acc);
  };
  const auto run_kind = [&]<bool kSuper>() {
    if (f.group == 16) {
      f.min ? run.template operator()<true, true, kSuper>() : run.template operator()<true, false, kSuper>();
    } else {
      f.min ? run.template operator()<false, true, kSuper>() : run.template operator()<false, false, kSuper>();
    }
  };
  if constexpr (!kInt16) {  // int8 sums a 256-value format's superblocks in integers (its x quantized per 256)
    if (sums_superblocks(f)) return run_kind.template operator()<true>();
  }
  run_kind.template operator()<false>();
}

}  // namespace

void int_tile_chunk(const Part& part, int64_t column, int64_t tiles, int64_t first, int64_t values, const IntRows& x,
                    bool int16, const Ahead& ahead, float* acc) {
  if (!int16 && tiles == 1 && stream_int8_rows(part, column, first, values, x, ahead, acc)) {
    return;
  }
  // int8 rows on a format the AVX2 build widens: the same exact sums in int16, of the rows' levels as pairs
  const bool pairs = !int16 && widens_int8(*part.format) && !x.grouped_pairs.empty();
  Int8Tile built[kPanelTiles];
  for (int64_t i = 0; i < tiles; ++i) {
    built[i] = int8_tile_in_place(part, column + i * W, first, values, i);
    if (int16 || pairs) built[i] = widen_int16(built[i], i);
  }
  const Panel panel{built, tiles};
  if (int16 || pairs) {
    dispatch<true>(panel, x, pairs ? x.grouped_pairs.data() : x.grouped.data(), first / kBlock, ahead, acc);
  } else {
    dispatch<false>(panel, x, x.grouped.data(), first / kBlock, ahead, acc);
  }
}

}  // namespace statelm::gguf
