// The sampler's two passes over a row of the vocabulary, on the CPU. A row's result depends on that row alone,
// whatever the batch and the thread (rows are split among threads whole).
//
// torch.ops.statelm.top_k(x [R, V] float32, k) -> (values [R, k] float32, ids [R, k] int64)
//
// Each row's k largest values, best first, and their column ids: the sampler's candidates for top-k and top-p, and
// the most likely tokens of logprobs. Order: a NaN before every number (as torch.topk ranks it), larger values
// before smaller, and equal values by lower id (torch.topk leaves their order unspecified).
//
// torch.topk on the CPU copies a row's (value, id) pairs and selects among all of them: 91 us for 49,152 logits and
// 222 us for 128,256, one thread. Here one pass keeps only the values that beat the k-th best seen so far: a block
// of 64 at a time is compared with it in vectors and only the values that beat it are looked at one by one; the
// kept ones are cut back to the best k whenever they reach kSpare * k. A model's logits put a few hundred values of
// a row past the threshold, so the pass runs at about the speed of reading the row (49,152 logits: 10 us).
//
// torch.ops.statelm.inverse_cdf(probs [R, N] float32, uniforms [R] float32) -> (positions [R] int64, totals [R])
//
// A draw by inverse CDF: each row's total mass and the first position whose running sum passes uniform * total
// (N - 1 where rounding leaves none). The sums are kept per chunk of kChunk values, each chunk's in kLanes
// lane-wise chains added up in a fixed tree (the same bits in every CPU class), so the total costs a vector pass
// and the running sum walks chunk by chunk, then value by value inside the one chunk it is crossed in: a few
// microseconds where torch.cumsum's sequential scan and searchsorted took 50 us over 49,152 probabilities.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel.h"

namespace statelm {
namespace {

constexpr int64_t kBlock = 64;  // values compared with the threshold before one branch
constexpr int64_t kSpare = 4;   // the kept values are cut back to k when they reach kSpare * k
constexpr int64_t kChunk = 256;  // values a running sum steps over at once
constexpr int kLanes = 16;       // the chains of a chunk's sum

struct Candidate {
  float value;
  int64_t id;
};

// Whether a ranks before b: a NaN first, then the larger value, then the lower id.
bool before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.id < b.id;
}

// Whether a value read after the kept ones can enter them: it beats their worst, `threshold` (a later value equal to
// it ranks after it, by id), or it is a NaN (above every number; after the kept NaNs, by id).
inline bool enters(float value, float threshold) { return value > threshold || value != value; }

// Which of x[0, kBlock) enter, bit j for x[j]: a comparison "not less than or equal", which a NaN passes too.
inline uint64_t entering(const float* x, float threshold) {
  uint64_t bits = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(threshold);
  for (int64_t j = 0; j < kBlock; j += 16) {
    bits |= uint64_t{_mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_NLE_UQ)} << j;
  }
#elif defined(__AVX2__)
  const __m256 t = _mm256_set1_ps(threshold);
  for (int64_t j = 0; j < kBlock; j += 8) {
    bits |= uint64_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), t, _CMP_NLE_UQ))) << j;
  }
#else
  const __m128 t = _mm_set1_ps(threshold);
  for (int64_t j = 0; j < kBlock; j += 4) bits |= uint64_t(_mm_movemask_ps(_mm_cmpnle_ps(_mm_loadu_ps(x + j), t))) << j;
#endif
  return bits;
}

// Cuts `kept` back to its best k and returns the worst of them, what a later value must beat.
float cut(std::vector<Candidate>& kept, int64_t k) {
  std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
  kept.resize(k);
  return kept[k - 1].value;
}

void top_k_row(const float* x, int64_t n, int64_t k, float* values, int64_t* ids, std::vector<Candidate>& kept) {
  kept.clear();
  for (int64_t i = 0; i < k; ++i) kept.push_back({x[i], i});
  float threshold = cut(kept, k);
  const auto consider = [&](int64_t i) {
    if (!enters(x[i], threshold)) return;
    kept.push_back({x[i], i});
    if (static_cast<int64_t>(kept.size()) >= kSpare * k) threshold = cut(kept, k);
  };
  int64_t i = k;
  for (; i + kBlock <= n && !std::isnan(threshold); i += kBlock) {  // a NaN threshold: the best k are NaNs already
    // the threshold only rises, so a value that did not enter against the block's threshold never will
    for (uint64_t bits = entering(x + i, threshold); bits != 0; bits &= bits - 1) consider(i + __builtin_ctzll(bits));
  }
  for (; i < n && !std::isnan(threshold); ++i) consider(i);
  if (static_cast<int64_t>(kept.size()) > k) cut(kept, k);
  std::sort(kept.begin(), kept.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    values[j] = kept[j].value;
    ids[j] = kept[j].id;
  }
}

std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "top_k: x must be [R, V] float32 CPU rows, contiguous within a row");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "top_k: k must be 1..", x.size(1), ", got ", k);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* data = x.const_data_ptr<float>();
  float* value_data = values.data_ptr<float>();
  int64_t* id_data = ids.data_ptr<int64_t>();
  statelm::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> kept;
    kept.reserve(kSpare * k);
    for (int64_t row = begin; row < end; ++row) {
      top_k_row(data + row * stride, n, k, value_data + row * k, id_data + row * k, kept);
    }
  });
  return {values, ids};
}

// The sum of x[0, n), n <= kChunk: lane j sums x[j], x[j + kLanes], ... in order, the lanes then added pairwise
// (j, j + 8), (j, j + 4), (j, j + 2), (0, 1). Lane-wise adds, which the compiler may vectorise without changing a bit.
float chunk_sum(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[i + j];
  }
  for (int j = 0; i + j < n; ++j) lanes[j] += x[i + j];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

// Row p[0, n): its total and the first position whose running sum passes uniform * total (n - 1 if none does).
std::pair<int64_t, float> crossing(const float* p, int64_t n, float uniform, std::vector<float>& sums) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  sums.resize(chunks);
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = chunk_sum(p + c * kChunk, std::min(kChunk, n - c * kChunk));
    total += sums[c];
  }
  const float threshold = uniform * total;
  float running = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float after = running + sums[c];
    if (after > threshold) {  // crossed in this chunk: walk its values (a rounding apart, maybe not: go on)
      float inside = running;
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
        inside += p[i];
        if (inside > threshold) return {i, total};
      }
    }
    running = after;
  }
  return {n - 1, total};
}

std::tuple<at::Tensor, at::Tensor> inverse_cdf(const at::Tensor& probs, const at::Tensor& uniforms_in) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.device().is_cpu() &&
                  probs.stride(1) == 1 && probs.size(1) >= 1,
              "inverse_cdf: probs must be [R, N] float32 CPU rows, N >= 1, contiguous within a row");
  const at::Tensor uniforms = uniforms_in.to(at::kFloat).contiguous();
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0), "inverse_cdf: one uniform per row");
  const int64_t rows = probs.size(0), n = probs.size(1), stride = probs.stride(0);
  at::Tensor positions = at::empty({rows}, probs.options().dtype(at::kLong));
  at::Tensor totals = at::empty({rows}, probs.options());
  const float* data = probs.const_data_ptr<float>();
  const float* u = uniforms.const_data_ptr<float>();
  int64_t* position_data = positions.data_ptr<int64_t>();
  float* total_data = totals.data_ptr<float>();
  statelm::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t row = begin; row < end; ++row) {
      std::tie(position_data[row], total_data[row]) = crossing(data + row * stride, n, u[row], sums);
    }
  });
  return {positions, totals};
}

}  // namespace
}  // namespace statelm

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("top_k(Tensor x, int k) -> (Tensor values, Tensor ids)");
  m.def("inverse_cdf(Tensor probs, Tensor uniforms) -> (Tensor positions, Tensor totals)");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) {
  m.impl("top_k", &statelm::top_k);
  m.impl("inverse_cdf", &statelm::inverse_cdf);
}
