// torch.ops.statelm.decoder_layers: every decoder layer of a Llama-family model on packed weights, in one call.
// Llama's block, and the variants' (models/variants.py) whose departures are in its arguments: Gemma's norms after
// attention and after the MLP ("sandwich"), OLMo 2's after them only ("post", with a QK-norm over all heads), GeGLU,
// soft-capped attention scores, sliding layers with their own rope table, Granite's residual multiplier.
//
// The model's Python forward calls about ten kernels a layer, and at one decode row per sequence the Python and
// dispatch around them cost a third of a step. This op makes exactly the same kernel calls, in the same order on
// the same tensors, from C++ (so its result is the Python forward's, bit for bit), and releases the GIL for the
// whole model. It serves the kernels compute path on packed weights; the Python forward stays the reference.
//
// A model's layers are prepared once into a torch.classes.statelm.PreparedLayers, whose constructor takes, per layer,
// kLayerTensors tensors in `tensors` (an undefined one is absent):
//   input_norm, qkv_bias, o_bias, post_norm, q_norm, k_norm, router, pre_feedforward_norm, post_feedforward_norm
// (post_norm: the pre layout's norm before the MLP, the others' after attention) and its packed linears,
// each `parts[i]` consecutive block matrices of `blocks` (types in `block_types`): qkv, o, then gate_up and down; or,
// where `experts[layer]` is not 0 (a mixture of that many experts, models/moe.py), the router (packed where the
// router tensor is absent) and each expert's gate_up and down in expert order. `layer_kinds[layer]` is 1 for a
// sliding layer (window dims[4], the step's local rope table where given), else 0 (window dims[3]). `dims` is
// [num_heads, num_kv_heads, head_dim, full_window, sliding_window, experts_per_token, renormalise, layout, gelu],
// layout 0 for pre, 1 for sandwich, 2 for post.
// Each step then passes them and what changes: the embeddings, positions, rope tables, KV caches and the
// attention layout.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "parallel.h"

namespace {

constexpr int64_t kLayerTensors = 9;
constexpr size_t kDims = 9;
// What a layer's serial stretches (attention, norms, activations) give an idle core time to load at one decode row:
// about its L2. More is evicted before it is read.
constexpr int64_t kReadAheadBytes = 2 << 20;

// VariantDecoderLayer's norm layouts: Llama's, norms before and after attention and MLP (Gemma), after only (OLMo 2).
enum Layout : int64_t { kPre, kSandwich, kPost };

enum Slot : int64_t {
  kInputNorm, kQkvBias, kOBias, kPostNorm, kQNorm, kKNorm, kRouter, kPreFeedforward, kPostFeedforward
};

// One packed linear: its block matrices and their ggml types.
struct Linear {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> types;
};

// Starts loading the first bytes of w's blocks into the caches (statelm::read_ahead) while the caller goes on.
void read_ahead(const Linear& w) {
  std::vector<statelm::Span> spans;
  int64_t left = kReadAheadBytes;
  for (const at::Tensor& block : w.blocks) {
    if (left <= 0) break;
    const int64_t bytes = std::min<int64_t>(left, block.nbytes());
    spans.push_back({block.data_ptr(), bytes});
    left -= bytes;
  }
  statelm::read_ahead(std::move(spans));
}

at::Tensor matmul(const at::Tensor& x, const Linear& w, const at::Tensor& bias, int64_t arithmetic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::gguf_matmul", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, int64_t)>();
  at::Tensor out = op.call(x, w.blocks, w.types, arithmetic);
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

void rope(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table, bool interleaved) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::rope_", "")
                       .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  op.call(x, positions, table, interleaved);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::silu_mul", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

// GeGLU as LayerOps.gelu_tanh_mul computes it: the same ATen calls on the same views.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
  return at::gelu(halves[0], "tanh") * halves[1];
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
                     const at::Tensor& seq_lens, const at::Tensor& query_start, double scale, int64_t window,
                     double softcap) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::paged_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, int64_t,
                                         const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                         double)>();
  return op.call(q, cache.k, cache.v, block_tables, seq_lens, query_start, scale, window, cache.k_scale,
                 cache.v_scale, softcap);
}

// The RMSNorm of q or k [T, heads, D] per head (Qwen3, Gemma 3) or over all heads at once (OLMo 2), as the weight's
// size says, as the Python ops compute it: on rows of the weight's size.
at::Tensor qk_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x.reshape({-1, weight.size(0)}), weight, eps).view(x.sizes());
}

// A mixture of experts' MLP (models/moe.py's MoEMLP.forward on the kernels path, the same calls in the same order):
// the router's probabilities, each token's top-k experts ascending, the (token, slot) pairs grouped by expert, every
// chosen expert's gate+up and then down projections of its tokens in one gguf_matmul_groups call each, and each
// token's weighted sum of its experts (expert_sum).
// The linears point into the PreparedLayers' own list.
struct Experts {
  at::Tensor router;                     // [E, H] float32, or undefined: then
  const Linear* packed_router = nullptr;  // its blocks
  std::vector<const Linear*> gate_up, down;  // per expert
};

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::float_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x, weight);
}

std::vector<at::Tensor> matmul_groups(const std::vector<at::Tensor>& xs, const std::vector<const Linear*>& linears,
                                      int64_t arithmetic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::gguf_matmul_groups", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, at::TensorList, at::IntArrayRef,
                                                      at::IntArrayRef, at::IntArrayRef)>();
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> types, parts;
  for (const Linear* linear : linears) {
    blocks.insert(blocks.end(), linear->blocks.begin(), linear->blocks.end());
    types.insert(types.end(), linear->types.begin(), linear->types.end());
    parts.push_back(static_cast<int64_t>(linear->blocks.size()));
  }
  const std::vector<int64_t> arithmetics(xs.size(), arithmetic);
  return op.call(xs, blocks, types, parts, arithmetics);
}

at::Tensor expert_sum(const at::Tensor& rows, const at::Tensor& pairs, const at::Tensor& weights, int64_t top_k) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("statelm::expert_sum", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(rows, pairs, weights, top_k);
}

at::Tensor moe_mlp(const at::Tensor& h, const Experts& experts, int64_t top_k, bool normalize, int64_t arithmetic) {
  const at::Tensor logits = experts.router.defined() ? float_linear(h, experts.router)
                                                    : matmul(h, *experts.packed_router, at::Tensor(), arithmetic);
  const at::Tensor probabilities = at::softmax(logits, -1, at::kFloat);
  auto [weights, chosen] = probabilities.topk(top_k, -1);
  if (normalize) weights = weights / weights.sum(-1, true);
  auto [ascending, order] = chosen.sort(-1);  // each token's experts ascending: the order its outputs are summed in
  weights = weights.gather(-1, order).flatten();
  const at::Tensor picks_tensor = ascending.flatten().contiguous();
  const int64_t* picks = picks_tensor.data_ptr<int64_t>();
  const int64_t count = picks_tensor.numel();
  std::vector<int64_t> pairs(count);  // (token, slot) pairs by expert, then by token
  for (int64_t p = 0; p < count; ++p) pairs[p] = p;
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return picks[a] < picks[b]; });
  std::vector<int64_t> token_of(count), sizes;  // each pair's token
  for (int64_t p = 0; p < count; ++p) token_of[p] = pairs[p] / top_k;
  std::vector<const Linear*> gate_up, down;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t expert = picks[pairs[p]];
    if (p > 0 && expert == picks[pairs[p - 1]]) {
      ++sizes.back();
      continue;
    }
    TORCH_CHECK(expert >= 0 && expert < static_cast<int64_t>(experts.gate_up.size()), "moe: expert out of range");
    sizes.push_back(1);
    gate_up.push_back(experts.gate_up[expert]);
    down.push_back(experts.down[expert]);
  }
  const std::vector<at::Tensor> xs = h.index_select(0, at::tensor(token_of, at::kLong)).split_with_sizes(sizes);
  const at::Tensor gate_up_rows = at::cat(matmul_groups(xs, gate_up, arithmetic));
  const std::vector<at::Tensor> hidden = silu_mul(gate_up_rows).split_with_sizes(sizes);
  return expert_sum(at::cat(matmul_groups(hidden, down, arithmetic)), at::tensor(pairs, at::kLong), weights, top_k);
}

// A model's layers as decoder_layers runs them: what does not change between steps, converted once
// (models/fused_decoder.py builds one per model and compute path).
struct PreparedLayers : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;  // kLayerTensors a layer, undefined where absent
  std::vector<Linear> linears;
  std::vector<int64_t> first_linear;  // each layer's linears: [first_linear[l], first_linear[l + 1])
  std::vector<Experts> experts;       // per layer (none for a dense MLP); they point into `linears`
  std::vector<int64_t> expert_counts, kinds;
  at::Tensor final_norm;
  int64_t heads, kv_heads, head_dim, windows[2], top_k;  // windows: of full and sliding layers
  Layout layout;
  bool renormalise, gelu;
  double eps, scale, softcap, residual_multiplier;

  PreparedLayers(const c10::List<c10::optional<at::Tensor>>& tensor_list, std::vector<at::Tensor> blocks,
                 std::vector<int64_t> block_types, std::vector<int64_t> parts, at::Tensor final_norm_weight,
                 std::vector<int64_t> dims, std::vector<int64_t> experts_per_layer, std::vector<int64_t> layer_kinds,
                 double eps_, double scale_, double softcap_, double residual_multiplier_)
      : expert_counts(std::move(experts_per_layer)),
        kinds(std::move(layer_kinds)),
        final_norm(std::move(final_norm_weight)),
        eps(eps_),
        scale(scale_),
        softcap(softcap_),
        residual_multiplier(residual_multiplier_) {
    const int64_t layers = static_cast<int64_t>(kinds.size());
    tensors.reserve(tensor_list.size());
    for (const c10::optional<at::Tensor>& t : tensor_list) tensors.push_back(t.has_value() ? *t : at::Tensor());
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kLayerTensors,
                "PreparedLayers: tensors must hold ", kLayerTensors, " tensors per layer");
    TORCH_CHECK(static_cast<int64_t>(expert_counts.size()) == layers, "PreparedLayers: one expert count a layer");
    TORCH_CHECK(blocks.size() == block_types.size(), "PreparedLayers: one type per block matrix");
    TORCH_CHECK(dims.size() == kDims, "PreparedLayers: dims must have ", kDims, " entries");
    heads = dims[0], kv_heads = dims[1], head_dim = dims[2], windows[0] = dims[3], windows[1] = dims[4];
    top_k = dims[5], renormalise = dims[6] != 0, gelu = dims[8] != 0;
    TORCH_CHECK(dims[7] >= kPre && dims[7] <= kPost, "PreparedLayers: layout 0 (pre), 1 (sandwich) or 2 (post)");
    layout = static_cast<Layout>(dims[7]);
    linears.resize(parts.size());
    size_t next = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      for (int64_t p = 0; p < parts[i]; ++p, ++next) {
        TORCH_CHECK(next < blocks.size(), "PreparedLayers: fewer block matrices than parts counts");
        linears[i].blocks.push_back(blocks[next]);
        linears[i].types.push_back(block_types[next]);
      }
    }
    TORCH_CHECK(next == blocks.size(), "PreparedLayers: more block matrices than parts counts");
    first_linear.assign(layers + 1, 0);
    experts.resize(layers);
    for (int64_t layer = 0; layer < layers; ++layer) {
      const at::Tensor& router = tensors[layer * kLayerTensors + kRouter];
      const int64_t count = expert_counts[layer], first = first_linear[layer] + (router.defined() ? 2 : 3);
      first_linear[layer + 1] = count ? first + 2 * count : first_linear[layer] + 4;
      TORCH_CHECK(first_linear[layer + 1] <= static_cast<int64_t>(linears.size()),
                  "PreparedLayers: parts must count each layer's linears (qkv, o, then gate_up and down, or the "
                  "router and each expert's)");
      if (count) {
        experts[layer].router = router;
        if (!router.defined()) experts[layer].packed_router = &linears[first_linear[layer] + 2];
        for (int64_t e = 0; e < count; ++e) {
          experts[layer].gate_up.push_back(&linears[first + 2 * e]);
          experts[layer].down.push_back(&linears[first + 2 * e + 1]);
        }
      }
    }
    TORCH_CHECK(first_linear[layers] == static_cast<int64_t>(linears.size()),
                "PreparedLayers: parts count more linears than the layers have");
  }
  PreparedLayers(const PreparedLayers&) = delete;  // its experts point into its own linears
  PreparedLayers& operator=(const PreparedLayers&) = delete;
};

// Hidden states [T, H] after the final norm, from embeddings x [T, H] (float32), through every layer prepared.
at::Tensor decoder_layers(const c10::intrusive_ptr<PreparedLayers>& prepared, const at::Tensor& x_in,
                          const at::Tensor& positions, const at::Tensor& rope_table,
                          const c10::optional<at::Tensor>& local_rope_table, at::TensorList k_caches,
                          at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start, int64_t arithmetic, bool interleaved_rope) {
  const PreparedLayers& s = *prepared;
  const int64_t layers = static_cast<int64_t>(s.kinds.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && v_caches.size() == k_caches.size(),
              "decoder_layers: one K and one V cache a layer");
  TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == k_caches.size()),
              "decoder_layers: k_scales and v_scales hold one tensor per layer (q8_0) or none");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(), "x must be [T, H] float32");
  const int64_t tokens = x_in.size(0), q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const at::Tensor local_table = local_rope_table.has_value() ? *local_rope_table : rope_table;
  const double eps = s.eps;
  at::Tensor x = x_in;
  at::Tensor residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = s.tensors.data() + layer * kLayerTensors;
    const Linear* linear = s.linears.data() + s.first_linear[layer];
    at::Tensor h;
    if (s.layout == kPost) {  // no norm before attention
      residual = layer == 0 ? x : residual.add_(x);
      h = residual;
    } else if (layer == 0) {
      residual = x;
      h = rms_norm(x, w[kInputNorm], eps);
    } else {
      h = add_rms_norm(residual, x, w[kInputNorm], eps);
    }
    at::Tensor qkv = matmul(h, linear[0], w[kQkvBias], arithmetic);
    read_ahead(linear[1]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, s.heads, s.head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, s.kv_heads, s.head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, s.kv_heads, s.head_dim});
    if (w[kQNorm].defined() && w[kKNorm].defined()) {
      q = qk_norm(q, w[kQNorm], eps);
      k = qk_norm(k, w[kKNorm], eps);
    }
    const bool sliding = s.kinds[layer] != 0;
    const at::Tensor& table = sliding ? local_table : rope_table;
    rope(q, positions, table, interleaved_rope);
    rope(k, positions, table, interleaved_rope);
    LayerKV cache{k_caches[layer], v_caches[layer]};
    if (!k_scales.empty()) {
      cache.k_scale = k_scales[layer];
      cache.v_scale = v_scales[layer];
    }
    kv_store(k, v, cache, slot_mapping);
    at::Tensor out = attention(q, cache, block_tables, seq_lens, query_start, s.scale, s.windows[sliding], s.softcap);
    at::Tensor o = matmul(out.reshape({tokens, q_size}), linear[1], w[kOBias], arithmetic);
    const bool routed = s.expert_counts[layer] != 0;
    if (!routed || !w[kRouter].defined()) read_ahead(linear[2]);  // gate_up or the packed router (experts: unknown)
    if (s.layout == kSandwich) {
      h = add_rms_norm(residual, rms_norm(o, w[kPostNorm], eps), w[kPreFeedforward], eps);
    } else if (s.layout == kPost) {
      h = residual.add_(rms_norm(o, w[kPostNorm], eps));
    } else {
      h = add_rms_norm(residual, s.residual_multiplier == 1.0 ? o : o * s.residual_multiplier, w[kPostNorm], eps);
    }
    if (routed) {
      x = moe_mlp(h, s.experts[layer], s.top_k, s.renormalise, arithmetic);
    } else {
      at::Tensor gate_up = matmul(h, linear[2], at::Tensor(), arithmetic);
      read_ahead(linear[3]);
      const at::Tensor activated = s.gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up);
      gate_up.reset();  // [T, 2I] float32, not held through the down projection (a prompt's peak memory)
      x = matmul(activated, linear[3], at::Tensor(), arithmetic);
    }
    if (s.layout != kPre) {
      x = rms_norm(x, w[kPostFeedforward], eps);
    } else if (s.residual_multiplier != 1.0) {
      x = x * s.residual_multiplier;
    }
    if (layer + 1 < layers) read_ahead(s.linears[s.first_linear[layer + 1]]);
  }
  return add_rms_norm(residual, x, s.final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.class_<PreparedLayers>("PreparedLayers")
      .def(torch::init<const c10::List<c10::optional<at::Tensor>>&, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::vector<int64_t>, at::Tensor, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, double, double, double, double>());
  m.def(
      "decoder_layers(__torch__.torch.classes.statelm.PreparedLayers layers, Tensor x, Tensor positions, "
      "Tensor rope_table, Tensor? local_rope_table, Tensor[] k_caches, Tensor[] v_caches, Tensor[] k_scales, "
      "Tensor[] v_scales, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
      "int arithmetic, bool interleaved_rope) -> Tensor");
}

TORCH_LIBRARY_IMPL(statelm, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
