// torch.ops.statelm.quantized_matmul(x [M, K] float32, values, scales, mins?, out_features, int8_activations)
//     -> y [M, out_features] float32 = x @ W.T, W a packed weight (layout in qmatmul.h).
//
// With int8_activations the activations are quantized to int8 per row and block of 32 and the block dot
// products are integer (llama.cpp's arithmetic; qmatmul_int8.cpp); without, they stay float32 and only float
// rounding separates the result from a float matmul on the dequantized weights (qmatmul_float.cpp).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "qmatmul.h"

namespace {

using statelm::qmatmul::kBlock;
using statelm::qmatmul::kGroup;

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32 rows");
  const bool q4 = mins.has_value();
  const int64_t k = x.size(1), blocks = k / kBlock, groups = (out_features + kGroup - 1) / kGroup;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(values.is_contiguous() && values.scalar_type() == (q4 ? at::kByte : at::kChar) &&
                  values.numel() == groups * blocks * kGroup * (q4 ? kBlock / 2 : kBlock),
              "values must be the packed layout of an [N, K] weight (uint8 for q4, int8 for q8)");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == groups * blocks * kGroup,
              "scales must be float32 [N/8, K/32, 8]");
  if (q4) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->numel() == scales.numel(),
                "mins must be float32 [N/8, K/32, 8]");
  }
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return out;
  const statelm::qmatmul::Weights w{static_cast<const uint8_t*>(values.data_ptr()), scales.data_ptr<float>(),
                                    q4 ? mins->data_ptr<float>() : nullptr, out_features, blocks, q4};
  if (int8_activations) {
    statelm::qmatmul::matmul_int8_activations(x, w, out.data_ptr<float>());
  } else {
    statelm::qmatmul::matmul_float_activations(x, w, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def(
      "quantized_matmul(Tensor x, Tensor values, Tensor scales, Tensor? mins, int out_features, "
      "bool int8_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("quantized_matmul", &quantized_matmul); }
