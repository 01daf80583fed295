#include "megatron/core/models/gpt/hf_mapping.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_deepseek.h"
#include "megatron/core/models/gpt/hf_gpt_oss.h"
#include "megatron/core/models/gpt/hf_rope.h"
#include "megatron/core/models/gpt/hf_util.h"

namespace megatron {

// The helpers hf_util.h shares with the other HF mappings (hf_deepseek.cpp, hf_gpt_oss.cpp).
namespace hf_detail {

// ---- small host helpers on row-major matrices --------------------------------------------------
Tensor as_fp32(const Tensor& t) {
  Tensor h = host(t);
  return h.dtype() == DType::Float32 ? h : h.to(DType::Float32);
}

Tensor host(const Tensor& t) { return t.device().is_host() ? t : t.to(Device::cpu()); }

Tensor transpose2d(const Tensor& t) { return transposed(t).materialize(); }

// Concatenates along dim 0.
Tensor concat_rows(const std::vector<Tensor>& parts) { return RowParts(parts).materialize(); }

// q [nq·d, ...], k/v [ng·d, ...] -> grouped [ng·(nq/ng+2)·d, ...] (per group: its q heads, k, v).
Tensor merge_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d) {
  return merge_qkv_rows(q, k, v, nq, ng, d).materialize();
}

std::vector<int64_t> merged_qkv_order(int64_t nq, int64_t ng, int64_t d) {
  const int64_t per = nq / ng;
  std::vector<int64_t> order;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t r = g * per * d; r < (g + 1) * per * d; ++r) order.push_back(r);
    for (int64_t r = g * d; r < (g + 1) * d; ++r) order.push_back(nq * d + r);
    for (int64_t r = g * d; r < (g + 1) * d; ++r) order.push_back((nq + ng) * d + r);
  }
  return order;
}

void split_qkv_order(int64_t nq, int64_t ng, int64_t d, std::vector<int64_t>& q, std::vector<int64_t>& k,
                     std::vector<int64_t>& v) {
  const std::vector<int64_t> merged = merged_qkv_order(nq, ng, d);
  std::vector<int64_t> stacked(merged.size());  // row i of [q; k; v] is row stacked[i] of the grouped QKV
  for (size_t r = 0; r < merged.size(); ++r) stacked[size_t(merged[r])] = int64_t(r);
  q.assign(stacked.begin(), stacked.begin() + nq * d);
  k.assign(stacked.begin() + nq * d, stacked.begin() + (nq + ng) * d);
  v.assign(stacked.begin() + (nq + ng) * d, stacked.end());
}

// The inverse of merge_qkv.
void split_qkv(const Tensor& qkv, int64_t nq, int64_t ng, int64_t d, Tensor& q, Tensor& k, Tensor& v) {
  std::vector<int64_t> qs, ks, vs;
  split_qkv_order(nq, ng, d, qs, ks, vs);
  q = rows_of(qkv, qs).materialize(), k = rows_of(qkv, ks).materialize(), v = rows_of(qkv, vs).materialize();
}

RowParts rows_of(const Tensor& t, const std::vector<int64_t>& order) {
  Tensor src = host(t);
  std::vector<Tensor> parts;
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && order[j] == order[j - 1] + 1) ++j;  // a run of consecutive rows is one view
    parts.push_back(src.slice(order[i], order[j - 1] + 1));
    i = j;
  }
  MG_ASSERT(!parts.empty(), "rows_of without rows");
  return RowParts(std::move(parts));
}

namespace {
// dst[a][b] = src[rows[b]][cols[a]] for a in [a0, a1), b over rows, elements of type T.
template <typename T>
void gather_transposed(const T* src, int64_t src_cols, const std::vector<int64_t>& rows,
                       const std::vector<int64_t>& cols, int64_t a0, int64_t a1, T* dst) {
  const int64_t n = int64_t(rows.size());
  for (int64_t b = 0; b < n; ++b) {
    const T* row = src + rows[size_t(b)] * src_cols;
    for (int64_t a = a0; a < a1; ++a) dst[(a - a0) * n + b] = row[cols[size_t(a)]];
  }
}
}  // namespace

RowParts transposed(const Tensor& t, std::vector<int64_t> rows, std::vector<int64_t> cols) {
  Tensor src = host(t);
  MG_ASSERT(src.dim() == 2, "transposed() of a {}-d tensor", src.dim());
  if (rows.empty())
    for (int64_t r = 0; r < src.size(0); ++r) rows.push_back(r);
  if (cols.empty())
    for (int64_t c = 0; c < src.size(1); ++c) cols.push_back(c);
  const int64_t out_rows = int64_t(cols.size()), out_cols = int64_t(rows.size()), src_cols = src.size(1);
  const size_t es = size_of(src.dtype());
  // Note [Streaming conversion]: blocks of about 4 MiB, so a transpose costs its source alone.
  const int64_t block = std::max<int64_t>(1, (int64_t(4) << 20) / std::max<int64_t>(1, out_cols * int64_t(es)));
  auto make = [src, rows = std::move(rows), cols = std::move(cols), src_cols](int64_t a0, int64_t a1) {
    Tensor out = Tensor::empty({a1 - a0, int64_t(rows.size())}, src.dtype());
    switch (size_of(src.dtype())) {
      case 1:
        gather_transposed(static_cast<const uint8_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint8_t*>(out.raw_data()));
        break;
      case 2:
        gather_transposed(static_cast<const uint16_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint16_t*>(out.raw_data()));
        break;
      case 4:
        gather_transposed(static_cast<const uint32_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint32_t*>(out.raw_data()));
        break;
      default:
        MG_ASSERT(size_of(src.dtype()) == 8, "transposed() of {}", to_string(src.dtype()));
        gather_transposed(static_cast<const uint64_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint64_t*>(out.raw_data()));
    }
    return out;
  };
  return RowParts(RowParts::Blocks{{out_rows, out_cols}, src.dtype(), block, std::move(make)});
}

// Pads the rows of a [V, h] table to `rows` with zeros, or strips it back.
Tensor resize_rows(const Tensor& t, int64_t rows) { return pad_rows(t, rows).materialize(); }

RowParts merge_qkv_rows(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d) {
  const int64_t per = nq / ng;
  std::vector<Tensor> parts;
  for (int64_t g = 0; g < ng; ++g) {
    parts.push_back(q.slice(g * per * d, (g + 1) * per * d));
    parts.push_back(k.slice(g * d, (g + 1) * d));
    parts.push_back(v.slice(g * d, (g + 1) * d));
  }
  return RowParts(std::move(parts));
}

RowParts pad_rows(const Tensor& t, int64_t rows) {
  Tensor src = host(t);
  if (src.size(0) >= rows) return RowParts(src.slice(0, rows));
  return RowParts({src}, rows - src.size(0));
}

Tensor HFReader::operator()(const std::string& name, const Shape& expected) const {
  Tensor t = get(name);
  MG_CHECK(is_floating(t.dtype()), "HF tensor '{}' has dtype {}, expected a floating-point type", name,
           to_string(t.dtype()));
  MG_CHECK(t.shape() == expected,
           "HF tensor '{}' has shape {}, but the config needs {}: the weights do not belong to this config.json", name,
           shape_str(t.shape()), shape_str(expected));
  return host(t);
}

std::string layer(int i, const char* rest) { return fmt::format("decoder.layers.{}.{}", i, rest); }

}  // namespace hf_detail

Shape RowParts::shape() const {
  if (blocks) return blocks->shape;
  MG_ASSERT(!parts.empty(), "RowParts without parts");
  Shape shape = parts[0].shape();
  if (shape.empty()) return shape;
  shape[0] = zero_rows;
  for (const Tensor& p : parts) shape[0] += p.size(0);
  return shape;
}

DType RowParts::dtype() const {
  if (blocks) return blocks->dtype;
  DType d = parts.at(0).dtype();
  for (const Tensor& p : parts)
    if (p.dtype() != d) d = DType::Float32;  // mixed pieces: fp32 holds each exactly
  return d;
}

size_t RowParts::count() const {
  if (!blocks) return parts.size();
  return size_t((blocks->shape[0] + blocks->block_rows - 1) / blocks->block_rows);
}

Tensor RowParts::piece(size_t k) const {
  if (!blocks) return parts.at(k);
  const int64_t begin = int64_t(k) * blocks->block_rows;
  return blocks->make(begin, std::min(blocks->shape[0], begin + blocks->block_rows));
}

Tensor RowParts::materialize() const {
  if (!blocks && parts.size() == 1 && zero_rows == 0) return hf_detail::as_fp32(parts[0]);
  Tensor out = Tensor::zeros(shape(), DType::Float32);
  int64_t row = 0;
  for (size_t k = 0; k < count(); ++k) {
    const Tensor p = piece(k);
    if (p.numel() == 0) continue;
    out.slice(row, row + p.size(0)).copy_from(p);
    row += p.size(0);
  }
  return out;
}

namespace {
using namespace hf_detail;

// A sink that collects a mapping's tensors into a map (the non-streaming API).
struct MapSink {
  TensorMap map;
  TensorSink sink{[this](const std::string& name, RowParts t) { map[name] = t.materialize(); }};
};

bool is_hf_moe(const std::string& model_type) {
  return model_type == "mixtral" || model_type == "qwen2_moe" || model_type == "qwen3_moe";
}

// The MoE fields of a mixtral / qwen2_moe / qwen3_moe config.json (Note [HF mixture of experts]).
void moe_config_from_hf(const nlohmann::json& j, const std::string& type, TransformerConfig& c) {
  auto get_int = [&](const char* key) -> int {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int>() : -1;
  };
  // Mixtral names it num_local_experts, Qwen num_experts (transformers 5 writes either for Qwen3-MoE).
  const int local = get_int("num_local_experts"), experts = get_int("num_experts");
  MG_CHECK(local < 0 || experts < 0 || local == experts,
           "config.json gives num_experts {} and num_local_experts {}: they must agree", experts, local);
  c.num_moe_experts = experts >= 0 ? experts : local;
  MG_CHECK(c.num_moe_experts > 0, "{} config.json needs a positive num_local_experts / num_experts", type);
  c.moe_router_topk = get_int("num_experts_per_tok");
  MG_CHECK(c.moe_router_topk > 0, "{} config.json needs num_experts_per_tok", type);
  c.moe_router_score_function = "softmax";
  if (type == "mixtral") {
    const float jitter = j.value("router_jitter_noise", 0.0f);
    MG_CHECK(jitter == 0.0f, "router_jitter_noise={} is not supported: only 0 (no router jitter)", jitter);
    c.moe_ffn_hidden_size = c.ffn_hidden_size;  // every layer is MoE; experts of intermediate_size
    c.moe_router_pre_softmax = false;           // softmax, top-k, renormalise
    c.moe_layer_freq = "1";
  } else {
    c.moe_ffn_hidden_size = get_int("moe_intermediate_size");
    MG_CHECK(c.moe_ffn_hidden_size > 0, "{} config.json needs moe_intermediate_size", type);
    c.moe_router_pre_softmax = !j.value("norm_topk_prob", false);
    const int step = j.contains("decoder_sparse_step") ? j["decoder_sparse_step"].get<int>() : 1;
    MG_CHECK(step >= 1, "decoder_sparse_step {} must be positive", step);
    std::vector<int> dense = j.value("mlp_only_layers", std::vector<int>{});
    std::string pattern = "[";
    bool all_moe = true;
    for (int i = 0; i < c.num_layers; ++i) {
      const bool moe = (i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end();
      all_moe = all_moe && moe;
      pattern += fmt::format("{}{}", i ? "," : "", moe ? 1 : 0);
    }
    c.moe_layer_freq = all_moe ? "1" : pattern + "]";
    if (type == "qwen2_moe") {
      c.moe_shared_expert_intermediate_size = std::max(0, get_int("shared_expert_intermediate_size"));
      c.moe_shared_expert_gate = c.moe_shared_expert_intermediate_size > 0;  // Qwen2-MoE's shared_expert_gate
    }
  }
  const bool aux = j.value("output_router_logits", false);
  c.moe_router_load_balancing_type = {"aux_loss"};
  c.moe_aux_loss_coeff = {aux ? j.value("router_aux_loss_coef", 0.0f) : 0.0f};
}

// The HF names of layer i's MoE block (Note [HF mixture of experts]).
struct MoENames {
  std::string base, router, shared_gate;
  bool mixtral;
  MoENames(const std::string& model_type, int i)
      : base(fmt::format("model.layers.{}.{}.", i, model_type == "mixtral" ? "block_sparse_moe" : "mlp")),
        router(base + "gate.weight"),
        shared_gate(base + "shared_expert_gate.weight"),
        mixtral(model_type == "mixtral") {
    MG_CHECK(is_hf_moe(model_type), "HF model_type '{}' has no mixture-of-experts layers: expected mixtral, "
             "qwen2_moe or qwen3_moe", model_type);
  }
  /// part 0: gate, 1: up, 2: down.
  std::string expert(int e, int part) const {
    static const char* const mixtral_parts[] = {"w1", "w3", "w2"};
    static const char* const qwen_parts[] = {"gate_proj", "up_proj", "down_proj"};
    return fmt::format("{}experts.{}.{}.weight", base, e, mixtral ? mixtral_parts[part] : qwen_parts[part]);
  }
  std::string shared(int part) const {
    static const char* const parts[] = {"gate_proj", "up_proj", "down_proj"};
    return fmt::format("{}shared_expert.{}.weight", base, parts[part]);
  }
};

}  // namespace

// ---- config ----------------------------------------------------------------------------------------
HFModelInfo config_from_hf(const nlohmann::json& j, int make_vocab_size_divisible_by) {
  MG_CHECK(j.is_object() && j.contains("model_type"), "config.json has no \"model_type\": not a HuggingFace config");
  HFModelInfo info;
  info.model_type = j["model_type"].get<std::string>();
  TransformerConfig& c = info.config;
  c.make_vocab_size_divisible_by = make_vocab_size_divisible_by;
  auto num = [&](const char* key, auto fallback) {
    return j.contains(key) && !j[key].is_null() ? j[key].get<decltype(fallback)>() : fallback;
  };
  if (info.model_type == "gpt2") {
    info.family = HFFamily::GPT2;
    c.num_layers = num("n_layer", 0);
    c.hidden_size = num("n_embd", 0);
    c.num_attention_heads = num("n_head", 0);
    c.ffn_hidden_size = num("n_inner", 0);  // null -> 4h
    c.max_position_embeddings = num("n_positions", 0);
    c.vocab_size = num("vocab_size", 0);
    c.layernorm_epsilon = num("layer_norm_epsilon", 1e-5f);
    c.normalization = "LayerNorm";
    c.activation = "gelu";
    std::string act = num("activation_function", std::string("gelu_new"));
    MG_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh",
             "GPT-2 activation_function '{}' is not supported: only the tanh GeLU (gelu_new)", act);
    c.add_bias_linear = true;
    c.add_qkv_bias = true;
    c.position_embedding_type = "learned_absolute";
    c.share_embeddings_and_output_weights = num("tie_word_embeddings", true);  // false: its own lm_head
    c.hidden_dropout = num("resid_pdrop", 0.1f);
    c.attention_dropout = num("attn_pdrop", 0.1f);
    c.init_method_std = num("initializer_range", 0.02f);
    MG_CHECK(!num("scale_attn_by_inverse_layer_idx", false) && !num("reorder_and_upcast_attn", false),
             "GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported");
  } else if (info.model_type == "llama" || info.model_type == "mistral" || info.model_type == "qwen2" ||
             info.model_type == "qwen3" || is_hf_moe(info.model_type)) {
    info.family = HFFamily::Llama;
    c.num_layers = num("num_hidden_layers", 0);
    c.hidden_size = num("hidden_size", 0);
    c.num_attention_heads = num("num_attention_heads", 0);
    c.num_query_groups = num("num_key_value_heads", c.num_attention_heads);
    c.kv_channels = num("head_dim", 0);
    c.ffn_hidden_size = num("intermediate_size", 0);
    c.max_position_embeddings = num("max_position_embeddings", 0);
    c.vocab_size = num("vocab_size", 0);
    c.layernorm_epsilon = num("rms_norm_eps", 1e-6f);
    c.normalization = "RMSNorm";
    c.activation = "swiglu";
    std::string act = num("hidden_act", std::string("silu"));
    MG_CHECK(act == "silu", "hidden_act '{}' is not supported: only silu (SwiGLU)", act);
    c.add_bias_linear = num("mlp_bias", false);
    MG_CHECK(!c.add_bias_linear, "mlp_bias=true is not supported");
    c.add_qkv_bias = info.model_type == "qwen2"       ? true
                     : info.model_type == "qwen2_moe" ? num("qkv_bias", true)
                                                      : num("attention_bias", false);
    // q_norm / k_norm: RMSNorm over each head
    c.qk_layernorm = info.model_type == "qwen3" || info.model_type == "qwen3_moe";
    check_hf_attention_window(j, info.model_type, c);  // hf_rope.h
    if (is_hf_moe(info.model_type)) moe_config_from_hf(j, info.model_type, c);
    rope_config_from_hf(j, c);  // Note [HF RoPE scaling]
    c.share_embeddings_and_output_weights = num("tie_word_embeddings", false);
    c.hidden_dropout = 0.0f;
    c.attention_dropout = num("attention_dropout", 0.0f);
    c.init_method_std = num("initializer_range", 0.02f);
  } else if (info.model_type == "gpt_oss") {
    info.family = HFFamily::GptOss;
    gpt_oss_config_from_hf(j, c);  // Note [HF GPT-OSS]
  } else if (is_hf_deepseek(info.model_type)) {
    info.family = HFFamily::DeepSeek;
    info.rope_interleave = num("rope_interleave", true);
    deepseek_config_from_hf(j, c);  // Note [HF DeepSeek-V3]
  } else {
    MG_CHECK(false,
             "HF model_type '{}' is not supported: expected gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, "
             "qwen3_moe, gpt_oss or deepseek_v3",
             info.model_type);
  }
  c.finalize();
  return info;
}

// ---- HF -> Megatron-Core -----------------------------------------------------------------------
TensorMap hf_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf) {
  if (info.family == HFFamily::DeepSeek) check_deepseek_mtp_copies(info, get_hf);
  MapSink out;
  hf_to_megatron(info, get_hf, out.sink);
  return std::move(out.map);
}

void hf_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf, TensorSink& out) {
  const TransformerConfig& c = info.config;
  const int64_t h = c.hidden_size, v = c.vocab_size, vp = c.padded_vocab_size, f = c.ffn_hidden_size;
  const int64_t nq = c.num_attention_heads, ng = c.num_query_groups, d = c.kv_channels;
  if (info.family == HFFamily::DeepSeek) return deepseek_to_megatron(info, get_hf, out);
  HFReader hf{get_hf};
  if (info.family == HFFamily::GptOss) return gpt_oss_to_megatron(c, get_hf, out);  // Note [HF GPT-OSS]
  if (info.family == HFFamily::GPT2) {
    out["embedding.word_embeddings.weight"] = pad_rows(hf("transformer.wte.weight", {v, h}), vp);
    out["embedding.position_embeddings.weight"] = hf("transformer.wpe.weight", {c.max_position_embeddings, h});
    for (int i = 0; i < c.num_layers; ++i) {
      auto p = [&](const char* rest) { return fmt::format("transformer.h.{}.{}", i, rest); };
      out[layer(i, "input_layernorm.weight")] = hf(p("ln_1.weight"), {h});
      out[layer(i, "input_layernorm.bias")] = hf(p("ln_1.bias"), {h});
      // c_attn [h, 3h] = [q | k | v] along its columns: ours is its transpose, rows grouped.
      out[layer(i, "self_attention.linear_qkv.weight")] =
          transposed(hf(p("attn.c_attn.weight"), {h, 3 * h}), {}, merged_qkv_order(nq, ng, d));
      Tensor b = hf(p("attn.c_attn.bias"), {3 * h});
      out[layer(i, "self_attention.linear_qkv.bias")] =
          merge_qkv_rows(b.slice(0, h), b.slice(h, 2 * h), b.slice(2 * h, 3 * h), nq, ng, d);
      out[layer(i, "self_attention.linear_proj.weight")] = transposed(hf(p("attn.c_proj.weight"), {h, h}));
      out[layer(i, "self_attention.linear_proj.bias")] = hf(p("attn.c_proj.bias"), {h});
      out[layer(i, "pre_mlp_layernorm.weight")] = hf(p("ln_2.weight"), {h});
      out[layer(i, "pre_mlp_layernorm.bias")] = hf(p("ln_2.bias"), {h});
      out[layer(i, "mlp.linear_fc1.weight")] = transposed(hf(p("mlp.c_fc.weight"), {h, f}));
      out[layer(i, "mlp.linear_fc1.bias")] = hf(p("mlp.c_fc.bias"), {f});
      out[layer(i, "mlp.linear_fc2.weight")] = transposed(hf(p("mlp.c_proj.weight"), {f, h}));
      out[layer(i, "mlp.linear_fc2.bias")] = hf(p("mlp.c_proj.bias"), {h});
    }
    out["decoder.final_layernorm.weight"] = hf("transformer.ln_f.weight", {h});
    out["decoder.final_layernorm.bias"] = hf("transformer.ln_f.bias", {h});
    if (!c.share_embeddings_and_output_weights) {
      out["output_layer.weight"] = pad_rows(hf("lm_head.weight", {v, h}), vp);
    }
    return;
  }
  out["embedding.word_embeddings.weight"] = pad_rows(hf("model.embed_tokens.weight", {v, h}), vp);
  for (int i = 0; i < c.num_layers; ++i) {
    auto p = [&](const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); };
    out[layer(i, "input_layernorm.weight")] = hf(p("input_layernorm.weight"), {h});
    out[layer(i, "self_attention.linear_qkv.weight")] =
        merge_qkv_rows(hf(p("self_attn.q_proj.weight"), {nq * d, h}), hf(p("self_attn.k_proj.weight"), {ng * d, h}),
                  hf(p("self_attn.v_proj.weight"), {ng * d, h}), nq, ng, d);
    if (c.add_qkv_bias) {
      out[layer(i, "self_attention.linear_qkv.bias")] =
          merge_qkv_rows(hf(p("self_attn.q_proj.bias"), {nq * d}), hf(p("self_attn.k_proj.bias"), {ng * d}),
                    hf(p("self_attn.v_proj.bias"), {ng * d}), nq, ng, d);
    }
    if (c.qk_layernorm) {
      out[layer(i, "self_attention.q_layernorm.weight")] = hf(p("self_attn.q_norm.weight"), {d});
      out[layer(i, "self_attention.k_layernorm.weight")] = hf(p("self_attn.k_norm.weight"), {d});
    }
    out[layer(i, "self_attention.linear_proj.weight")] = hf(p("self_attn.o_proj.weight"), {h, nq * d});
    out[layer(i, "pre_mlp_layernorm.weight")] = hf(p("post_attention_layernorm.weight"), {h});
    if (!c.is_moe_layer(i)) {
      out[layer(i, "mlp.linear_fc1.weight")] =
          RowParts({hf(p("mlp.gate_proj.weight"), {f, h}), hf(p("mlp.up_proj.weight"), {f, h})});
      out[layer(i, "mlp.linear_fc2.weight")] = hf(p("mlp.down_proj.weight"), {h, f});
      continue;
    }
    const MoENames names(info.model_type, i);
    const int64_t ef = c.moe_ffn_hidden_size, sf = c.moe_shared_expert_intermediate_size;
    out[layer(i, "mlp.router.weight")] = hf(names.router, {c.num_moe_experts, h});
    for (int e = 0; e < c.num_moe_experts; ++e) {
      const std::string ours = fmt::format("decoder.layers.{}.mlp.experts.local_experts.{}.", i, e);
      out[ours + "linear_fc1.weight"] = RowParts({hf(names.expert(e, 0), {ef, h}), hf(names.expert(e, 1), {ef, h})});
      out[ours + "linear_fc2.weight"] = hf(names.expert(e, 2), {h, ef});
    }
    if (sf > 0) {
      out[layer(i, "mlp.shared_experts.linear_fc1.weight")] =
          RowParts({hf(names.shared(0), {sf, h}), hf(names.shared(1), {sf, h})});
      out[layer(i, "mlp.shared_experts.linear_fc2.weight")] = hf(names.shared(2), {h, sf});
      if (c.moe_shared_expert_gate) out[layer(i, "mlp.shared_experts.gate_weight")] = hf(names.shared_gate, {1, h});
    }
  }
  out["decoder.final_layernorm.weight"] = hf("model.norm.weight", {h});
  if (!c.share_embeddings_and_output_weights) {
    out["output_layer.weight"] = pad_rows(hf("lm_head.weight", {v, h}), vp);
  }
}

// ---- Megatron-Core -> HF -------------------------------------------------------------------------
namespace {

// Note [Exporting zero-centered norms]
// --apply-layernorm-1p (Megatron's layernorm_zero_centered_gamma) stores gamma - 1 and the norm
// kernels multiply by (1 + w); HF multiplies by its weight, so the export adds the 1 back (norm
// weights only, never biases; the q/k norms of --qk-layernorm too). Importing an HF model needs no
// change: its weights are gamma and the imported checkpoint is not zero-centered.
Tensor norm_weight(const TransformerConfig& c, Tensor w) {
  if (!c.layernorm_zero_centered_gamma) return w;
  Tensor out = as_fp32(w).clone();
  float* d = out.data<float>();
  for (int64_t i = 0; i < out.numel(); ++i) d[i] += 1.0f;
  return out;
}

// Note [Exporting interleaved RoPE]
// --rotary-interleaved rotates channel pairs (2j, 2j+1) of the first r = kv_channels · rotary_percent
// channels of each head by angle θ_j; HF rotates (j, j + r/2) ("rotate_half") by the same θ_j. With
// the permutation P that sends our channel 2j to j and 2j+1 to j + r/2 (the rest stay),
// rotate_half(P x) = P interleaved(x), and q·k is unchanged when q and k are both permuted. So the
// export permutes the rows of each q and k head (weights and biases) and the per-head q/k norm
// weights (applied before RoPE, elementwise, so they move with their channels); values are untouched.
// The result is exact, and it imports back as a model without --rotary-interleaved that computes the same.
// The permutation is applied to row indices (`rows`: `heads` heads of d rows), so the rows stay views.
std::vector<int64_t> half_split_order(const std::vector<int64_t>& rows, int64_t heads, int64_t d, int64_t r) {
  std::vector<int64_t> out = rows;
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t j = 0; j < r / 2; ++j)
      for (int64_t part = 0; part < 2; ++part) out[size_t(hd * d + j + part * (r / 2))] = rows[size_t(hd * d + 2 * j + part)];
  return out;
}

}  // namespace

TensorMap megatron_to_hf(const HFModelInfo& info, const TensorMap& m) {
  TensorSource source{[&](const std::string& name) -> Tensor {
                        auto it = m.find(name);
                        MG_CHECK(it != m.end(), "tensor '{}' is missing from the Megatron state", name);
                        return as_fp32(it->second);
                      },
                      [&](const std::string& name) { return m.count(name) > 0; }};
  MapSink out;
  megatron_to_hf(info, source, out.sink);
  return std::move(out.map);
}

void megatron_to_hf(const HFModelInfo& info, const TensorSource& source, TensorSink& out) {
  if (info.family == HFFamily::DeepSeek) return megatron_to_deepseek(info, source, out);
  const TransformerConfig& c = info.config;
  const int64_t h = c.hidden_size, v = c.vocab_size, f = c.ffn_hidden_size;
  const int64_t nq = c.num_attention_heads, ng = c.num_query_groups, d = c.kv_channels;
  const int64_t rotary = c.use_rope() ? int64_t(float(d) * c.rotary_percent) : 0;
  // Note [Streaming conversion]: each tensor in its stored dtype, its rows handed on as views.
  auto get = [&](const std::string& name) -> Tensor { return host(source.get(name)); };
  auto norm = [&](const std::string& name) { return norm_weight(c, get(name)); };
  const bool interleaved = c.use_rope() && c.rotary_interleaved;
  // The rows of layer i's fused QKV (weight or bias) that make q, k and v, in HF's channel order
  // (Note [Exporting interleaved RoPE]).
  struct QKV {
    Tensor fused;
    std::vector<int64_t> q, k, v;
    std::vector<int64_t> stacked() const {
      std::vector<int64_t> all = q;
      all.insert(all.end(), k.begin(), k.end());
      all.insert(all.end(), v.begin(), v.end());
      return all;
    }
  };
  auto qkv = [&](int i, const char* what) {
    QKV r{get(layer(i, what)), {}, {}, {}};
    split_qkv_order(nq, ng, d, r.q, r.k, r.v);
    if (interleaved) r.q = half_split_order(r.q, nq, d, rotary), r.k = half_split_order(r.k, ng, d, rotary);
    return r;
  };
  auto qk_norm = [&](const std::string& name) {
    std::vector<int64_t> rows(static_cast<size_t>(d));
    for (int64_t j = 0; j < d; ++j) rows[size_t(j)] = j;
    return rows_of(norm(name), interleaved ? half_split_order(rows, 1, d, rotary) : rows);
  };
  if (info.family == HFFamily::GptOss) {  // Note [HF GPT-OSS]: computed in fp32
    return megatron_to_gpt_oss(c, [&](const std::string& name) { return as_fp32(source.get(name)); }, out);
  }
  if (info.family == HFFamily::GPT2) {
    // Note [GPT-2 export of biasless and position-free models]: HF GPT-2 always adds its biases and
    // its learned positions; a model trained with --disable-bias-linear (or without positions,
    // --position-embedding-type none) exports them as zeros, which computes the same.
    auto bias = [&](const std::string& name, int64_t n) {
      return c.add_bias_linear ? get(name) : Tensor::zeros({n}, DType::Float32);
    };
    out["transformer.wte.weight"] = pad_rows(get("embedding.word_embeddings.weight"), v);
    out["transformer.wpe.weight"] = c.use_learned_positions()
                                        ? get("embedding.position_embeddings.weight")
                                        : Tensor::zeros({c.max_position_embeddings, h}, DType::Float32);
    for (int i = 0; i < c.num_layers; ++i) {
      auto p = [&](const char* rest) { return fmt::format("transformer.h.{}.{}", i, rest); };
      out[p("ln_1.weight")] = norm(layer(i, "input_layernorm.weight"));
      out[p("ln_1.bias")] = get(layer(i, "input_layernorm.bias"));
      {  // the fused QKV is freed once written (Note [Streaming conversion])
        const QKV w = qkv(i, "self_attention.linear_qkv.weight");
        out[p("attn.c_attn.weight")] = transposed(w.fused, w.stacked());
      }
      if (c.add_bias_linear || c.add_qkv_bias) {  // Megatron: the linear biases include the QKV one
        const QKV b = qkv(i, "self_attention.linear_qkv.bias");
        out[p("attn.c_attn.bias")] = rows_of(b.fused, b.stacked());
      } else {
        out[p("attn.c_attn.bias")] = Tensor::zeros({3 * h}, DType::Float32);
      }
      out[p("attn.c_proj.weight")] = transposed(get(layer(i, "self_attention.linear_proj.weight")));
      out[p("attn.c_proj.bias")] = bias(layer(i, "self_attention.linear_proj.bias"), h);
      out[p("ln_2.weight")] = norm(layer(i, "pre_mlp_layernorm.weight"));
      out[p("ln_2.bias")] = get(layer(i, "pre_mlp_layernorm.bias"));
      out[p("mlp.c_fc.weight")] = transposed(get(layer(i, "mlp.linear_fc1.weight")));
      out[p("mlp.c_fc.bias")] = bias(layer(i, "mlp.linear_fc1.bias"), f);
      out[p("mlp.c_proj.weight")] = transposed(get(layer(i, "mlp.linear_fc2.weight")));
      out[p("mlp.c_proj.bias")] = bias(layer(i, "mlp.linear_fc2.bias"), h);
    }
    out["transformer.ln_f.weight"] = norm("decoder.final_layernorm.weight");
    out["transformer.ln_f.bias"] = get("decoder.final_layernorm.bias");
    if (!c.share_embeddings_and_output_weights) out["lm_head.weight"] = pad_rows(get("output_layer.weight"), v);
    return;
  }
  out["model.embed_tokens.weight"] = pad_rows(get("embedding.word_embeddings.weight"), v);
  for (int i = 0; i < c.num_layers; ++i) {
    auto p = [&](const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); };
    out[p("input_layernorm.weight")] = norm(layer(i, "input_layernorm.weight"));
    for (const char* what : {"weight", "bias"}) {
      if (what == std::string("bias") && !c.add_qkv_bias) continue;
      const QKV t = qkv(i, fmt::format("self_attention.linear_qkv.{}", what).c_str());
      out[p(fmt::format("self_attn.q_proj.{}", what).c_str())] = rows_of(t.fused, t.q);
      out[p(fmt::format("self_attn.k_proj.{}", what).c_str())] = rows_of(t.fused, t.k);
      out[p(fmt::format("self_attn.v_proj.{}", what).c_str())] = rows_of(t.fused, t.v);
    }
    if (c.qk_layernorm) {
      out[p("self_attn.q_norm.weight")] = qk_norm(layer(i, "self_attention.q_layernorm.weight"));
      out[p("self_attn.k_norm.weight")] = qk_norm(layer(i, "self_attention.k_layernorm.weight"));
    }
    out[p("self_attn.o_proj.weight")] = get(layer(i, "self_attention.linear_proj.weight"));
    out[p("post_attention_layernorm.weight")] = norm(layer(i, "pre_mlp_layernorm.weight"));
    // [gate; up] -> gate, up
    auto split_fc1 = [&](const std::string& fc1_name, const std::string& gate, const std::string& up) {
      Tensor fc1 = get(fc1_name);
      const int64_t half = fc1.size(0) / 2;
      out[gate] = fc1.slice(0, half);
      out[up] = fc1.slice(half, 2 * half);
    };
    if (!c.is_moe_layer(i)) {
      split_fc1(layer(i, "mlp.linear_fc1.weight"), p("mlp.gate_proj.weight"), p("mlp.up_proj.weight"));
      out[p("mlp.down_proj.weight")] = get(layer(i, "mlp.linear_fc2.weight"));
      continue;
    }
    const MoENames names(info.model_type, i);
    out[names.router] = get(layer(i, "mlp.router.weight"));
    for (int e = 0; e < c.num_moe_experts; ++e) {
      const std::string ours = fmt::format("decoder.layers.{}.mlp.experts.local_experts.{}.", i, e);
      split_fc1(ours + "linear_fc1.weight", names.expert(e, 0), names.expert(e, 1));
      out[names.expert(e, 2)] = get(ours + "linear_fc2.weight");
    }
    if (c.moe_shared_expert_intermediate_size > 0) {
      split_fc1(layer(i, "mlp.shared_experts.linear_fc1.weight"), names.shared(0), names.shared(1));
      out[names.shared(2)] = get(layer(i, "mlp.shared_experts.linear_fc2.weight"));
      if (c.moe_shared_expert_gate) out[names.shared_gate] = get(layer(i, "mlp.shared_experts.gate_weight"));
    }
  }
  out["model.norm.weight"] = norm("decoder.final_layernorm.weight");
  if (!c.share_embeddings_and_output_weights) out["lm_head.weight"] = pad_rows(get("output_layer.weight"), v);
}

// ---- Megatron-Core config -> HF config -------------------------------------------------------------
// Note [Which HF model a checkpoint exports as]
// A GeLU MLP is GPT-2 (LayerNorm, learned positions or none, full multi-head attention); --swiglu is
// the Llama family (RMSNorm, RoPE over every channel, no linear biases): qwen2 with --add-qkv-bias
// (HF Qwen2 biases q/k/v and not o_proj, as --disable-bias-linear --add-qkv-bias does), qwen3 with
// --qk-layernorm, else llama; MoE layers pick mixtral, qwen2_moe or qwen3_moe. What the model
// computes and HF cannot is refused in one line naming the flag; what HF expresses another way is
// converted exactly: --apply-layernorm-1p (Note [Exporting zero-centered norms]),
// --rotary-interleaved (Note [Exporting interleaved RoPE]), --untie-embeddings-and-output-weights
// (lm_head, tie_word_embeddings false: HF GPT-2 ties only when told to), and for GPT-2
// --disable-bias-linear / --position-embedding-type none (zero biases, zero positions). The
// remaining TransformerConfig fields do not change what a trained model computes (dropout,
// initialisation, parallel layout, recomputation, MoE dispatch) or are written as they are (sizes,
// heads, query groups, kv channels, epsilon, rotary base, vocabulary: the padding is stripped).
namespace hf_detail {
double shortest(float x) { return std::stod(fmt::format("{}", x)); }
}  // namespace hf_detail

nlohmann::json hf_config_from_megatron(const TransformerConfig& c) {
  if (uses_gpt_oss_features(c)) return hf_gpt_oss_config(c);  // Note [HF GPT-OSS]
  if (c.multi_latent_attention) return deepseek_config_to_hf(c);  // Note [HF DeepSeek-V3]
  MG_CHECK(!c.apply_residual_connection_post_layernorm,
           "--apply-residual-connection-post-layernorm has no HuggingFace export: GPT-2 and Llama-type models add the "
           "residual before the norm");
  // DeepSeek-V3 is the HF type that stores MTP weights (model.layers.{num_hidden_layers + k}.*);
  // the types exported here have none, and dropping the block would lose trained weights.
  MG_CHECK(c.mtp_num_layers == 0,
           "--mtp-num-layers {} has no HuggingFace export to GPT-2 or Llama-type models (they have no MTP "
           "modules): export a checkpoint trained without MTP",
           c.mtp_num_layers);
  const bool llama = c.gated_linear_unit;
  if (!llama) {
    MG_CHECK(c.normalization == "LayerNorm",
             "--normalization {} with a GeLU MLP has no HuggingFace export: GPT-2 uses LayerNorm (Llama-type exports "
             "need --swiglu)",
             c.normalization);
    MG_CHECK(!c.use_rope(),
             "--position-embedding-type rope with a GeLU MLP has no HuggingFace export: GPT-2 has learned positions "
             "(Llama-type exports need --swiglu and RMSNorm)");
    MG_CHECK(!c.qk_layernorm, "--qk-layernorm has no HuggingFace export with a GeLU MLP: GPT-2 has no q/k norms");
    MG_CHECK(!c.is_moe(),
             "--num-experts with a GeLU MLP has no HuggingFace export: HF MoE models are Llama-type "
             "(--swiglu, RMSNorm, RoPE)");
    MG_CHECK(c.num_query_groups == c.num_attention_heads,
             "--group-query-attention has no HuggingFace export with a GeLU MLP: GPT-2 has one key/value head per "
             "query head");
    MG_CHECK(c.kv_channels * c.num_attention_heads == c.hidden_size,
             "--kv-channels {} has no HuggingFace export with a GeLU MLP: GPT-2's heads are --hidden-size / "
             "--num-attention-heads = {} wide",
             c.kv_channels, c.hidden_size / c.num_attention_heads);
    return {{"model_type", "gpt2"},
            {"architectures", {"GPT2LMHeadModel"}},
            {"n_embd", c.hidden_size},
            {"n_layer", c.num_layers},
            {"n_head", c.num_attention_heads},
            {"n_inner", c.ffn_hidden_size},
            {"n_positions", c.max_position_embeddings},
            {"vocab_size", c.vocab_size},
            {"layer_norm_epsilon", shortest(c.layernorm_epsilon)},
            {"activation_function", "gelu_new"},
            {"tie_word_embeddings", c.share_embeddings_and_output_weights}};
  }
  MG_CHECK(c.normalization == "RMSNorm",
           "--normalization {} with --swiglu has no HuggingFace export: Llama-type models use RMSNorm (GPT-2 exports "
           "need a GeLU MLP)",
           c.normalization);
  MG_CHECK(c.use_rope(),
           "--position-embedding-type {} with --swiglu has no HuggingFace export: Llama-type models use RoPE",
           c.position_embedding_type);
  MG_CHECK(!c.add_bias_linear,
           "linear biases (Megatron's default; no --disable-bias-linear) with --swiglu have no HuggingFace export: "
           "Llama-type models have no MLP or output-projection biases (train with --disable-bias-linear, and "
           "--add-qkv-bias for Qwen2's q/k/v biases)");
  MG_CHECK(c.rotary_percent == 1.0f,
           "--rotary-percent {} has no HuggingFace export for a Llama-type model: HF Llama, Qwen2, Qwen3 and their MoE "
           "relatives rotate every channel of a head",
           c.rotary_percent);
  MG_CHECK(!(c.add_qkv_bias && c.qk_layernorm),
           "--add-qkv-bias with --qk-layernorm has no HuggingFace export: Qwen3 and Qwen3-MoE (q/k norms) have q/k/v "
           "biases only with an o_proj bias too, and Qwen2 (q/k/v biases) has no q/k norms");
  std::string model_type = c.qk_layernorm ? "qwen3" : c.add_qkv_bias ? "qwen2" : "llama";
  if (c.is_moe()) {
    MG_CHECK(c.moe_router_score_function == "softmax" && c.moe_router_num_groups == 0 &&
                 c.moe_router_topk_scaling_factor == 0.0f && !c.moe_router_enable_expert_bias &&
                 c.moe_expert_capacity_factor == 0.0f,
             "this MoE checkpoint's router has no HuggingFace equivalent: Mixtral and Qwen-MoE route by softmax "
             "top-k, without groups, scaling, expert bias or capacity");
    const bool all_moe = std::all_of(c.moe_layer_pattern.begin(), c.moe_layer_pattern.end(), [](int v) { return v; });
    if (c.moe_shared_expert_intermediate_size > 0) {
      MG_CHECK(!c.qk_layernorm && c.moe_shared_expert_gate,
               "shared experts export as Qwen2-MoE, which gates them and has no --qk-layernorm: add "
               "--moe-shared-expert-gate, drop --qk-layernorm");
      model_type = "qwen2_moe";
    } else if (c.qk_layernorm) {
      model_type = "qwen3_moe";
    } else {
      MG_CHECK(all_moe && !c.moe_router_pre_softmax && c.moe_ffn_hidden_size == c.ffn_hidden_size,
               "an MoE checkpoint without --qk-layernorm or shared experts exports as Mixtral, which has every layer "
               "MoE, no --moe-router-pre-softmax and --moe-ffn-hidden-size equal to --ffn-hidden-size");
      model_type = "mixtral";
    }
  }
  static const std::map<std::string, std::string> architectures = {{"llama", "LlamaForCausalLM"},
                                                                    {"qwen2", "Qwen2ForCausalLM"},
                                                                    {"qwen3", "Qwen3ForCausalLM"},
                                                                    {"mixtral", "MixtralForCausalLM"},
                                                                    {"qwen2_moe", "Qwen2MoeForCausalLM"},
                                                                    {"qwen3_moe", "Qwen3MoeForCausalLM"}};
  nlohmann::json j = {{"model_type", model_type},
                      {"architectures", {architectures.at(model_type)}},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.ffn_hidden_size},
                      {"num_hidden_layers", c.num_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_query_groups},
                      {"head_dim", c.kv_channels},
                      {"rms_norm_eps", shortest(c.layernorm_epsilon)},
                      {"rope_theta", shortest(c.rotary_base)},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"vocab_size", c.vocab_size},
                      {"hidden_act", "silu"},
                      {"attention_bias", c.add_qkv_bias},
                      {"tie_word_embeddings", c.share_embeddings_and_output_weights}};
  if (model_type == "qwen2") {
    j.erase("attention_bias");  // HF Qwen2 always biases q, k and v
    j["use_sliding_window"] = false;
  }
  rope_config_to_hf(c, j);  // partial_rotary_factor, rope_scaling (Note [HF RoPE scaling])
  if (!c.is_moe()) return j;
  const float aux = c.moe_aux_loss_coeff.empty() ? 0.0f : c.moe_aux_loss_coeff[0];
  MG_CHECK(aux == 0.0f || (c.moe_router_load_balancing_type.size() == 1 &&
                           c.moe_router_load_balancing_type[0] == "aux_loss"),
           "only --moe-router-load-balancing-type aux_loss has a HuggingFace equivalent (router_aux_loss_coef)");
  j["num_experts_per_tok"] = c.moe_router_topk;
  j["router_aux_loss_coef"] = aux;
  j["output_router_logits"] = aux > 0.0f;
  if (model_type == "mixtral") {
    j["num_local_experts"] = c.num_moe_experts;
    j.erase("attention_bias");
    MG_CHECK(!c.add_qkv_bias, "Mixtral has no q/k/v biases: drop --add-qkv-bias");
    return j;
  }
  j["num_experts"] = c.num_moe_experts;
  j["moe_intermediate_size"] = c.moe_ffn_hidden_size;
  j["norm_topk_prob"] = !c.moe_router_pre_softmax;
  j["decoder_sparse_step"] = 1;
  std::vector<int> dense;
  for (int i = 0; i < c.num_layers; ++i)
    if (!c.is_moe_layer(i)) dense.push_back(i);
  j["mlp_only_layers"] = dense;
  if (model_type == "qwen2_moe") {
    j.erase("attention_bias");
    j["qkv_bias"] = c.add_qkv_bias;
    j["shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size;
  }
  return j;
}

// ---- HF folders ------------------------------------------------------------------------------------
struct HFFolder::Shard {
  safetensors::File file;
};

namespace {
nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  MG_CHECK(in.good(), "cannot read {}", p.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MG_CHECK(false, "{} is not valid JSON: {}", p.string(), e.what());
  }
  return {};
}
}  // namespace

HFFolder::HFFolder(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  const fs::path root(dir), single = root / "model.safetensors", index = root / "model.safetensors.index.json";
  config_ = read_json(root / "config.json");
  if (fs::exists(index)) {
    nlohmann::json j = read_json(index);
    MG_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "{} has no weight_map", index.string());
    std::map<std::string, std::shared_ptr<const Shard>> files;
    for (const auto& [name, file] : j["weight_map"].items()) {
      const std::string f = file.get<std::string>();
      auto& shard = files[f];
      if (!shard) {
        MG_CHECK(fs::exists(root / f), "{} lists shard {}, which is missing from {}", index.string(), f, dir);
        shard = std::make_shared<const Shard>(Shard{safetensors::File((root / f).string())});
      }
      MG_CHECK(shard->file.contains(name), "{} puts tensor '{}' in {}, which does not hold it", index.string(), name,
               f);
      by_tensor_[name] = shard;
    }
  } else {
    MG_CHECK(fs::exists(single), "{} has neither model.safetensors nor model.safetensors.index.json", dir);
    auto shard = std::make_shared<const Shard>(Shard{safetensors::File(single.string())});
    for (const std::string& n : shard->file.names()) by_tensor_[n] = shard;
  }
}

HFModelInfo config_from_hf(const HFFolder& folder, int make_vocab_size_divisible_by) {
  HFModelInfo info = config_from_hf(folder.config(), make_vocab_size_divisible_by);
  TransformerConfig& c = info.config;
  if (info.family != HFFamily::DeepSeek || c.mtp_num_layers == 0) return info;
  int present = 0;  // Note [HF DeepSeek-V3 MTP]: the depths whose eh_proj the folder holds
  for (int k = 0; k < c.mtp_num_layers; ++k)
    present += folder.has(fmt::format("model.layers.{}.eh_proj.weight", c.num_layers + k));
  MG_CHECK(present == 0 || present == c.mtp_num_layers,
           "the HF checkpoint {} holds the eh_proj of {} of its num_nextn_predict_layers {} MTP layers (model.layers.{} "
           "on): give all of them or none",
           folder.dir(), present, c.mtp_num_layers, c.num_layers);
  if (present == 0) c.mtp_num_layers = 0;
  return info;
}

bool HFFolder::has(const std::string& name) const { return by_tensor_.count(name) > 0; }

std::vector<std::string> HFFolder::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& [name, shard] : by_tensor_) out.push_back(name);
  return out;
}

Tensor HFFolder::get(const std::string& name) const {
  auto it = by_tensor_.find(name);
  MG_CHECK(it != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, name);
  return it->second->file.read(name, DType::Float32);
}

Tensor HFFolder::read(const std::string& name) const {
  auto it = by_tensor_.find(name);
  MG_CHECK(it != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, name);
  return it->second->file.read(name);
}

Shape HFFolder::shape(const std::string& name) const {
  auto it = by_tensor_.find(name);
  MG_CHECK(it != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, name);
  return it->second->file.entry(name).shape;
}

DType HFFolder::dtype(const std::string& name) const {
  auto it = by_tensor_.find(name);
  MG_CHECK(it != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, name);
  return it->second->file.entry(name).dtype;
}

bool HFFolder::same_bytes(const std::string& a, const std::string& b) const {
  auto ia = by_tensor_.find(a), ib = by_tensor_.find(b);
  MG_CHECK(ia != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, a);
  MG_CHECK(ib != by_tensor_.end(), "the HF checkpoint {} has no tensor '{}'", dir_, b);
  const safetensors::File &fa = ia->second->file, &fb = ib->second->file;
  const safetensors::Entry &ea = fa.entry(a), &eb = fb.entry(b);
  if (ea.dtype != eb.dtype || ea.shape != eb.shape) return false;
  const safetensors::MappedTensor va = fa.view(a), vb = fb.view(b);
  const auto *pa = static_cast<const std::byte*>(va.data()), *pb = static_cast<const std::byte*>(vb.data());
  constexpr size_t chunk = size_t(16) << 20;
  for (size_t at = 0; at < ea.nbytes(); at += chunk) {
    const size_t n = std::min(chunk, ea.nbytes() - at);
    const bool equal = std::memcmp(pa + at, pb + at, n) == 0;
    fa.release(ea.begin + at, ea.begin + at + n), fb.release(eb.begin + at, eb.begin + at + n);
    if (!equal) return false;
  }
  return true;
}

// ---- model state -----------------------------------------------------------------------------------
TensorMap model_state_dict(const GPTModel& model) {
  TensorMap out;
  for (const Parameter* p : model.params().parameters()) out[p->name] = as_fp32(p->data).clone();
  return out;
}

TensorMap model_grad_dict(const GPTModel& model) {
  TensorMap out;
  for (const Parameter* p : model.params().parameters()) out[p->name] = as_fp32(p->main_grad).clone();
  return out;
}

TensorMap model_buffer_dict(GPTModel& model) {
  TensorMap out;
  for (const ModelBuffer& b : model.buffers()) out[b.name] = as_fp32(*b.tensor).clone();
  return out;
}

void load_model_state_dict(GPTModel& model, const TensorMap& state, const std::string& source) {
  std::map<std::string, Tensor*> buffers;
  for (const ModelBuffer& b : model.buffers()) buffers[b.name] = b.tensor;
  for (Parameter* p : model.params().parameters()) {
    auto it = state.find(p->name);
    MG_CHECK(it != state.end(), "{} has no tensor '{}' that the model needs", source, p->name);
    MG_CHECK(it->second.shape() == p->data.shape(), "{}: tensor '{}' has shape {}, the model needs {}", source, p->name,
             shape_str(it->second.shape()), shape_str(p->data.shape()));
    p->data.copy_from(it->second);
  }
  for (const auto& [name, t] : state) {
    if (model.params().find(name) != nullptr) continue;
    auto b = buffers.find(name);
    MG_CHECK(b != buffers.end(), "{} has a tensor '{}' that this model does not have", source, name);
    MG_CHECK(t.shape() == b->second->shape(), "{}: tensor '{}' has shape {}, the model needs {}", source, name,
             shape_str(t.shape()), shape_str(b->second->shape()));
    b->second->copy_from(as_fp32(t).to(b->second->dtype()));
  }
}

}  // namespace megatron
