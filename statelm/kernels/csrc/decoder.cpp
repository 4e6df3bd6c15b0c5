// torch.ops.statelm.decoder_layers: every decoder layer of a Llama-family model on packed weights, in one call.
//
// The model's Python forward calls about ten kernels a layer, and at one decode row per sequence the Python and
// dispatch around them cost a third of a step. This op makes exactly the same kernel calls, in the same order on
// the same tensors, from C++ (so its result is the Python forward's, bit for bit), and releases the GIL for the
// whole model. It serves the kernels compute path on packed weights; the Python forward stays the reference.
//
// Per layer, `weights` holds kLayerTensors tensors (an undefined one is absent):
//   input_norm, qkv.values, qkv.scales, qkv.mins, qkv.bias, o.values, o.scales, o.mins, o.bias, post_norm,
//   gate_up.values, gate_up.scales, gate_up.mins, down.values, down.scales, down.mins, q_norm, k_norm
// and `dims` is [num_heads, num_kv_heads, head_dim, qkv_out, o_out, gate_up_out, down_out, sliding_window].

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t kLayerTensors = 18;

enum Slot : int64_t {
  kInputNorm, kQkvValues, kQkvScales, kQkvMins, kQkvBias, kOValues, kOScales, kOMins, kOBias, kPostNorm,
  kGateUpValues, kGateUpScales, kGateUpMins, kDownValues, kDownScales, kDownMins, kQNorm, kKNorm
};

c10::optional<at::Tensor> maybe(const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; }

at::Tensor matmul(const at::Tensor& x, const at::Tensor* w, int64_t out_features, const at::Tensor& bias, bool int8) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::quantized_matmul", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const c10::optional<at::Tensor>&, int64_t, bool)>();
  at::Tensor out = op.call(x, w[0], w[1], maybe(w[2]), out_features, int8);
  return bias.defined() ? out + bias : out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::add_rms_norm_", "")
                       .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(residual, delta, weight, eps);
}

void rope(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::rope_", "")
                       .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(x, positions, table);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::silu_mul", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

// One layer's KV in the pool: keys, values and (q8_0) their scales.
struct LayerKV {
  at::Tensor k, v;
  c10::optional<at::Tensor> k_scale, v_scale;
};

void kv_store(const at::Tensor& k, const at::Tensor& v, const LayerKV& cache, const at::Tensor& slot_mapping) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::kv_store", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                   const at::Tensor&)>();
  op.call(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, slot_mapping);
}

at::Tensor attention(const at::Tensor& q, const LayerKV& cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, double scale, int64_t window) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::paged_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, int64_t,
                                         const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&)>();
  return op.call(q, cache.k, cache.v, block_tables, seq_lens, query_start, scale, window, cache.k_scale,
                 cache.v_scale);
}

// A head-wise RMSNorm of q or k [T, heads, D] (Qwen3), as the Python ops compute it: on a reshaped copy.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x.reshape({-1, x.size(2)}), weight, eps).view(x.sizes());
}

// Hidden states [T, H] after the final norm, from embeddings x [T, H] (float32), through every layer.
at::Tensor decoder_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& rope_table,
                          const c10::List<c10::optional<at::Tensor>>& weight_list, at::TensorList k_caches,
                          at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start, const at::Tensor& final_norm, at::IntArrayRef dims,
                          double eps, double scale, bool int8_activations) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  std::vector<at::Tensor> weights;  // undefined where absent
  weights.reserve(weight_list.size());
  for (const c10::optional<at::Tensor>& t : weight_list) weights.push_back(t.has_value() ? *t : at::Tensor());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerTensors && v_caches.size() == k_caches.size(),
              "decoder_layers: weights must hold ", kLayerTensors, " tensors per layer");
  TORCH_CHECK(dims.size() == 8, "decoder_layers: dims must have 8 entries");
  TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == k_caches.size()),
              "decoder_layers: k_scales and v_scales hold one tensor per layer (q8_0) or none");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(), "x must be [T, H] float32");
  const int64_t heads = dims[0], kv_heads = dims[1], head_dim = dims[2];
  const int64_t qkv_out = dims[3], o_out = dims[4], gate_up_out = dims[5], down_out = dims[6], window = dims[7];
  const int64_t tokens = x_in.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor x = x_in;
  at::Tensor residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kLayerTensors;
    at::Tensor h;
    if (layer == 0) {
      residual = x;
      h = rms_norm(x, w[kInputNorm], eps);
    } else {
      h = add_rms_norm(residual, x, w[kInputNorm], eps);
    }
    at::Tensor qkv = matmul(h, w + kQkvValues, qkv_out, w[kQkvBias], int8_activations);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    if (w[kQNorm].defined() && w[kKNorm].defined()) {
      q = head_norm(q, w[kQNorm], eps);
      k = head_norm(k, w[kKNorm], eps);
    }
    rope(q, positions, rope_table);
    rope(k, positions, rope_table);
    LayerKV cache{k_caches[layer], v_caches[layer]};
    if (!k_scales.empty()) {
      cache.k_scale = k_scales[layer];
      cache.v_scale = v_scales[layer];
    }
    kv_store(k, v, cache, slot_mapping);
    at::Tensor out = attention(q, cache, block_tables, seq_lens, query_start, scale, window);
    at::Tensor o = matmul(out.reshape({tokens, q_size}), w + kOValues, o_out, w[kOBias], int8_activations);
    h = add_rms_norm(residual, o, w[kPostNorm], eps);
    at::Tensor gate_up = matmul(h, w + kGateUpValues, gate_up_out, at::Tensor(), int8_activations);
    x = matmul(silu_mul(gate_up), w + kDownValues, down_out, at::Tensor(), int8_activations);
  }
  return add_rms_norm(residual, x, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def(
      "decoder_layers(Tensor x, Tensor positions, Tensor rope_table, Tensor?[] weights, Tensor[] k_caches, "
      "Tensor[] v_caches, Tensor[] k_scales, Tensor[] v_scales, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
      "Tensor final_norm, int[] dims, float eps, float scale, bool int8_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
