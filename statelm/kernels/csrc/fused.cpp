// Fused element-wise ops of a Llama-family decoder layer, in float32: RMSNorm (optionally adding the
// residual first), SiLU-and-multiply, rotary embedding applied in place, and a mixture of experts' weighted sums.
//
// Every row is computed by the same scalar loop whatever the number of rows, so a row's result never depends
// on its batch. The rows are short (hidden sizes of a few thousand), so the call overhead these ops save
// matters more than vectorising them, and they run on the calling thread: waking a second thread for a few
// microseconds of work costs more than the work, and far more when another process holds that core. SiLU's
// exponentials and the experts' sums are the exceptions at many rows (a 500-token prompt's are milliseconds a
// layer): their rows are spread over the kernel threads (statelm::parallel_for, which runs one row inline).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace {

constexpr int64_t kRowGrain = 1 << 30;  // one thread (see above)
constexpr int64_t kValuesPerChunk = 16384;  // a thread's share of silu_mul or expert_sum: enough to pay a wake-up

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, " must be a 2-D float32 tensor");
  TORCH_CHECK(x.stride(1) == 1, name, " must have contiguous rows");
}

inline void normalise_row(const float* in, const float* weight, float* out, int64_t n, double eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += in[i] * in[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sum) / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = (in[i] * scale) * weight[i];
}

// x [T, H] -> RMSNorm(x) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == x.size(1));
  auto out = at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = x.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      normalise_row(x.data_ptr<float>() + t * x.stride(0), w, out.data_ptr<float>() + t * n, n, eps);
    }
  });
  return out;
}

// residual += delta (in place), then RMSNorm(residual) * weight.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta must have the same shape");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == residual.size(1));
  auto out = at::empty({residual.size(0), residual.size(1)}, residual.options());
  const int64_t n = residual.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, residual.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = residual.data_ptr<float>() + t * residual.stride(0);
      const float* d = delta.data_ptr<float>() + t * delta.stride(0);
      for (int64_t i = 0; i < n; ++i) r[i] += d[i];
      normalise_row(r, w, out.data_ptr<float>() + t * n, n, eps);
    }
  });
  return out;
}

// A float's bits as an integer that orders as the float does (negative floats' magnitude bits flipped); its own
// inverse.
constexpr int32_t ordered(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

// e^x for x in [-87, 88] (clamped there), within 2 ulp: 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2
// (Cody-Waite's split of ln 2), e^r by its Taylor polynomial to r^7. Plain float operations, the clamp on ordered
// integers (a float comparison's possible trap keeps the compiler from vectorising a select), no branch and no
// call: the compiler vectorises a loop of it for the build's instruction set and every class computes the same
// bits (-ffp-contract=off). glibc's exp, a call a value, made SiLU 3-5x slower.
inline float exp_clamped(float x) {
  constexpr int32_t kLow = ordered(std::bit_cast<int32_t>(-87.0f)), kHigh = ordered(std::bit_cast<int32_t>(88.0f));
  x = std::bit_cast<float>(ordered(std::min(std::max(ordered(std::bit_cast<int32_t>(x)), kLow), kHigh)));
  const float shifted = x * 1.44269504f + 12582912.0f;  // + 1.5 * 2^23: the sum rounds x / ln 2 to an integer n
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 = 0.693145752 + 1.42860677e-6
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>((std::bit_cast<int32_t>(shifted) - 0x4B400000 + 127) << 23);  // 2^n
}

// gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t half = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), half}, gate_up.options());
  // its exponentials cost microseconds a row: a prompt's rows share the kernel threads (one row stays on this one)
  const int64_t grain = std::max<int64_t>(1, kValuesPerChunk / half);
  statelm::parallel_for(gate_up.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
      const float* u = g + half;
      float* o = out.data_ptr<float>() + t * half;
      for (int64_t i = 0; i < half; ++i) o[i] = (g[i] / (1.0f + exp_clamped(-g[i]))) * u[i];
    }
  });
  return out;
}

// A mixture of experts' outputs summed per token: rows [P, H] are the experts' outputs in expert order, pairs [P]
// each row's (token * top_k + slot) and weights [T * top_k] each (token, slot)'s router weight; out [T, H] is, per
// token, ((0 + rows[slot 0] * w0) + rows[slot 1] * w1) + ... in slot order, the products rounded before each sum
// (the build contracts no multiply-add), as models/moe.py sums them with torch ops.
at::Tensor expert_sum(const at::Tensor& rows, const at::Tensor& pairs, const at::Tensor& weights, int64_t top_k) {
  check_rows(rows, "rows");
  TORCH_CHECK(top_k > 0, "top_k must be positive");
  TORCH_CHECK(pairs.dim() == 1 && pairs.scalar_type() == at::kLong && pairs.is_contiguous() &&
                  pairs.numel() == rows.size(0), "pairs must be one contiguous int64 index a row");
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.numel() == rows.size(0), "weights must be one contiguous float32 weight a row");
  TORCH_CHECK(rows.size(0) % top_k == 0, "rows must be top_k per token");
  const int64_t count = rows.size(0), tokens = count / top_k, width = rows.size(1);
  std::vector<int64_t> row_of(count, -1);  // the row holding each (token, slot)
  const int64_t* pair = pairs.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(pair[i] >= 0 && pair[i] < count && row_of[pair[i]] < 0, "pairs must name each (token, slot) once");
    row_of[pair[i]] = i;
  }
  auto out = at::empty({tokens, width}, rows.options());
  const float* in = rows.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = rows.stride(0);
  statelm::parallel_for(tokens, std::max<int64_t>(1, kValuesPerChunk / (top_k * width)), [&](int64_t begin,
                                                                                                 int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* sum = o + t * width;
      std::fill(sum, sum + width, 0.0f);
      for (int64_t slot = 0; slot < top_k; ++slot) {
        const float* row = in + row_of[t * top_k + slot] * stride;
        const float weight = w[t * top_k + slot];
        for (int64_t i = 0; i < width; ++i) sum[i] += row[i] * weight;
      }
    }
  });
  return out;
}

// x [T, heads, D] (rows may be strided, heads and D contiguous) rotated in place by each token's position: table
// [P, 2, D] holds cos and the sign-folded sin per position, and each dimension's rotary partner is the one half a
// head away (Hugging Face's rotate-half layout) or, interleaved, its neighbour (llama.cpp's: dimensions 2i, 2i+1).
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be a 3-D float32 tensor");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x must have contiguous heads");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == at::kFloat && table.size(2) == x.size(2));
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0));
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table.size(0), "position ", pos[t], " outside the rope table");
  }
  const int64_t first_step = interleaved ? 2 : 1, partner = interleaved ? 1 : half;
  const int64_t pairs_end = interleaved ? dim : half;
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table.data_ptr<float>() + pos[t] * 2 * dim;
      const float* sin = cos + dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = x.data_ptr<float>() + t * x.stride(0) + h * dim;
        for (int64_t i = 0; i < pairs_end; i += first_step) {
          const float a = row[i], b = row[i + partner];
          row[i] = a * cos[i] + b * sin[i];
          row[i + partner] = b * cos[i + partner] + a * sin[i + partner];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor table, bool interleaved) -> ()");
  m.def("expert_sum(Tensor rows, Tensor pairs, Tensor weights, int top_k) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("expert_sum", &expert_sum);
}
