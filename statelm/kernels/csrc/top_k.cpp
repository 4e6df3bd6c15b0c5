// torch.ops.statelm.top_k(x [R, V] float32, k) -> (values [R, k] float32, ids [R, k] int64)
//
// Each row's k largest values, best first, and their column ids: the sampler's candidates for top-k and top-p, and
// the most likely tokens of logprobs. Order: a NaN before every number (as torch.topk ranks it), larger values
// before smaller, and equal values by lower id (torch.topk leaves their order unspecified).
//
// torch.topk on the CPU copies a row's (value, id) pairs and selects among all of them: 91 us for 49,152 logits and
// 222 us for 128,256, one thread. Here one pass keeps only the values that beat the k-th best seen so far: a block
// of 64 at a time is compared with it in vectors and only the values that beat it are looked at one by one; the kept ones are cut back to the best k whenever they reach kSpare * k. A model's logits put a few
// hundred values of a row past the threshold, so the pass runs at the speed of reading the row (49,152 logits: 5 us).
//
// A row's result depends on that row alone, whatever the batch and the thread (rows are split among threads whole).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "parallel.h"

namespace statelm {
namespace {

constexpr int64_t kBlock = 64;  // values compared with the threshold before one branch
constexpr int64_t kSpare = 4;   // the kept values are cut back to k when they reach kSpare * k

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

}  // namespace
}  // namespace statelm

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("top_k(Tensor x, int k) -> (Tensor values, Tensor ids)");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("top_k", &statelm::top_k); }
