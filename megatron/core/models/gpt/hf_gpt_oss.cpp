#include "megatron/core/models/gpt/hf_gpt_oss.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "megatron/core/models/gpt/hf_util.h"
#include "megatron/core/models/gpt/hf_rope.h"

namespace megatron {

using namespace hf_detail;

namespace {

constexpr float kQuickGeluAlpha = 1.702f;  // Megatron's quick_gelu: x·σ(1.702x)

// HF's layer_types when config.json has none: sliding on even layers (GptOssConfig).
std::vector<std::string> layer_types_of(const nlohmann::json& j, int num_layers) {
  std::vector<std::string> types;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    types = j["layer_types"].get<std::vector<std::string>>();
    MG_CHECK(int(types.size()) == num_layers, "gpt_oss layer_types has {} entries for {} layers", types.size(),
             num_layers);
  } else {
    for (int i = 0; i < num_layers; ++i) types.push_back((i + 1) % 2 ? "sliding_attention" : "full_attention");
  }
  for (const std::string& t : types)
    MG_CHECK(t == "sliding_attention" || t == "full_attention",
             "gpt_oss layer_types entry '{}' is not supported: expected sliding_attention or full_attention", t);
  return types;
}

// Row r of t [2f, ...] moves to row to(r): the gate/up (de)interleaving, as one pass over the rows.
template <typename To>
Tensor permute_rows(const Tensor& t, To to) {
  Tensor src = as_fp32(t);
  Tensor out = Tensor::empty(src.shape(), DType::Float32);
  const int64_t rows = src.size(0), row = rows == 0 ? 0 : src.numel() / rows;
  const float* s = src.data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) std::memcpy(o + to(r) * row, s + r * row, size_t(row) * sizeof(float));
  return out;
}

// HF's interleaved gate/up (gate at rows 0, 2, ..., up at 1, 3, ...) -> our [gate; up].
Tensor deinterleave_rows(const Tensor& t) {
  const int64_t half = t.size(0) / 2;
  return permute_rows(t, [half](int64_t r) { return r % 2 == 0 ? r / 2 : half + r / 2; });
}

// The inverse: our [gate; up] rows -> HF's interleaved order.
Tensor interleave_rows(const Tensor& t) {
  const int64_t half = t.size(0) / 2;
  return permute_rows(t, [half](int64_t r) { return r < half ? 2 * r : 2 * (r - half) + 1; });
}

// Expert e's [rows, cols] matrix of an HF [E, rows, cols] tensor (or its [cols] row of [E, cols]),
// as an fp32 copy of that expert alone.
Tensor expert_slice(const Tensor& t, int64_t e) {
  Tensor src = host(t);
  Shape shape(src.shape().begin() + 1, src.shape().end());
  return src.slice(e, e + 1).view(shape).to(DType::Float32);
}

// [E, ...] from the experts' tensors, expert(e) made when the writer reaches it (Note [Streaming
// conversion] in tools/convert_checkpoint.cpp: the stacked tensor is never assembled).
RowParts stack_experts(int64_t experts, const Shape& each, const std::function<Tensor(int64_t)>& expert) {
  Shape shape = {experts};
  shape.insert(shape.end(), each.begin(), each.end());
  Shape one = shape;
  one[0] = 1;
  return RowParts(RowParts::Blocks{shape, DType::Float32, 1, [expert, one](int64_t e, int64_t) {
                                     return as_fp32(expert(e)).view(one);
                                   }});
}

std::string hf_layer(int i, const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); }
std::string expert(int i, int e, const char* rest) {
  return fmt::format("decoder.layers.{}.mlp.experts.local_experts.{}.{}", i, e, rest);
}

}  // namespace

void gpt_oss_config_from_hf(const nlohmann::json& j, TransformerConfig& c) {
  auto num = [&](const char* key, auto fallback) {
    return j.contains(key) && !j[key].is_null() ? j[key].get<decltype(fallback)>() : fallback;
  };
  c.num_layers = num("num_hidden_layers", 0);
  c.hidden_size = num("hidden_size", 0);
  c.num_attention_heads = num("num_attention_heads", 0);
  c.num_query_groups = num("num_key_value_heads", c.num_attention_heads);
  c.kv_channels = num("head_dim", 0);
  c.ffn_hidden_size = num("intermediate_size", 0);
  c.moe_ffn_hidden_size = c.ffn_hidden_size;
  c.max_position_embeddings = num("max_position_embeddings", 0);
  c.vocab_size = num("vocab_size", 0);
  c.layernorm_epsilon = num("rms_norm_eps", 1e-5f);
  c.normalization = "RMSNorm";
  MG_CHECK(num("attention_bias", true),
           "gpt_oss with attention_bias false is not supported: Megatron's --add-bias-linear gives q/k/v/o, the router "
           "and the experts their biases together");
  c.add_bias_linear = true;
  // Note [HF GPT-OSS]: the experts' clamped SwiGLU is Megatron's quick-GeGLU with offset 1.
  const double alpha = num("swiglu_alpha", double(kQuickGeluAlpha));
  MG_CHECK(std::abs(alpha - double(kQuickGeluAlpha)) < 1e-6,
           "gpt_oss swiglu_alpha {} is not supported: Megatron's quick-GeGLU has alpha 1.702", alpha);
  c.activation = "quick_geglu";
  c.glu_linear_offset = 1.0f;
  c.activation_func_clamp_value = float(num("swiglu_limit", 7.0));
  MG_CHECK(c.activation_func_clamp_value > 0.0f, "gpt_oss swiglu_limit must be positive (got {})",
           c.activation_func_clamp_value);
  c.softmax_type = "learnable";
  const std::vector<std::string> types = layer_types_of(j, c.num_layers);
  const int window = num("sliding_window", 0);
  const bool any_sliding = std::count(types.begin(), types.end(), "sliding_attention") > 0;
  if (window > 0 && any_sliding) {
    c.window_size_left = window - 1;  // HF: keys i - W < j <= i
    if (std::count(types.begin(), types.end(), "full_attention") > 0) {
      std::string pattern = "[";
      for (size_t i = 0; i < types.size(); ++i)
        pattern += fmt::format("{}{}", i ? "," : "", types[i] == "sliding_attention" ? 1 : 0);
      c.window_attn_skip_freq = pattern + "]";
    }
  } else {
    MG_CHECK(!any_sliding, "gpt_oss sliding_attention layers need a positive sliding_window");
  }
  c.num_moe_experts = num("num_local_experts", 0);
  c.moe_router_topk = num("num_experts_per_tok", 0);
  c.moe_layer_freq = "1";
  c.moe_router_score_function = "softmax";
  c.moe_router_pre_softmax = false;  // top-k of the logits, softmax over the chosen
  const float aux = num("router_aux_loss_coef", 0.0f);
  c.moe_router_load_balancing_type = {"aux_loss"};
  c.moe_aux_loss_coeff = {num("output_router_logits", false) ? aux : 0.0f};
  rope_config_from_hf(j, c);  // Note [HF RoPE scaling]
  c.share_embeddings_and_output_weights = num("tie_word_embeddings", false);
  c.hidden_dropout = 0.0f;
  c.attention_dropout = num("attention_dropout", 0.0f);
  c.init_method_std = num("initializer_range", 0.02f);
}

bool uses_gpt_oss_features(const TransformerConfig& c) {
  return c.quick_geglu() || c.has_attention_sinks() || c.window_size_left >= 0;
}

nlohmann::json hf_gpt_oss_config(const TransformerConfig& c) {
  MG_CHECK(c.quick_geglu() && c.glu_linear_offset == 1.0f && c.activation_func_clamp_value > 0.0f,
           "a model with attention sinks or windows exports as HF gpt_oss, whose experts are --quick-geglu "
           "--glu-linear-offset 1 --activation-func-clamp-value <limit>");
  MG_CHECK(c.softmax_type == "learnable", "HF gpt_oss has learned attention sinks: train with --softmax-type learnable");
  MG_CHECK(c.normalization == "RMSNorm" && !c.layernorm_zero_centered_gamma &&
               !c.apply_residual_connection_post_layernorm,
           "HF gpt_oss uses RMSNorm before attention and MLP: train with --normalization RMSNorm, without "
           "--apply-layernorm-1p or --apply-residual-connection-post-layernorm");
  MG_CHECK(c.use_rope() && c.rotary_percent == 1.0f && !c.rotary_interleaved && !c.qk_layernorm,
           "HF gpt_oss rotates every channel of a head with half-split RoPE and has no q/k norms: use --position-"
           "embedding-type rope or yarn, no --rotary-percent, --rotary-interleaved or --qk-layernorm");
  MG_CHECK(c.add_bias_linear, "HF gpt_oss has biases in every linear layer: train without --disable-bias-linear");
  const bool all_moe =
      c.is_moe() && std::all_of(c.moe_layer_pattern.begin(), c.moe_layer_pattern.end(), [](int v) { return v; });
  MG_CHECK(all_moe && c.moe_shared_expert_intermediate_size == 0,
           "HF gpt_oss has every layer MoE and no shared experts: use --num-experts with --moe-layer-freq 1");
  MG_CHECK(c.moe_router_score_function == "softmax" && !c.moe_router_pre_softmax && c.moe_router_num_groups == 0 &&
               c.moe_router_topk_scaling_factor == 0.0f && !c.moe_router_enable_expert_bias &&
               c.moe_expert_capacity_factor == 0.0f,
           "HF gpt_oss routes by softmax over the top-k logits: no --moe-router-pre-softmax, groups, scaling, expert "
           "bias or capacity");
  const float aux = router_aux_loss_coef_to_hf(c);
  std::vector<std::string> types;
  for (int i = 0; i < c.num_layers; ++i)
    types.push_back(c.layer_window_left(i) >= 0 ? "sliding_attention" : "full_attention");
  nlohmann::json j = llama_family_config(c, "gpt_oss", "GptOssForCausalLM", c.moe_ffn_hidden_size, c.num_query_groups,
                                         c.kv_channels, /*attention_bias=*/true);
  j["attention_dropout"] = shortest(c.attention_dropout);
  j["swiglu_limit"] = shortest(c.activation_func_clamp_value);
  j["swiglu_alpha"] = shortest(kQuickGeluAlpha);
  j["num_local_experts"] = c.num_moe_experts;
  j["num_experts_per_tok"] = c.moe_router_topk;
  j["router_aux_loss_coef"] = aux;
  j["output_router_logits"] = aux > 0.0f;
  j["layer_types"] = types;
  j["sliding_window"] = c.window_size_left >= 0 ? c.window_size_left + 1 : 128;
  // transformers 5's rope_parameters: GptOssConfig takes a missing one for YaRN with factor 32, so
  // plain RoPE must say "default" (Note [HF RoPE scaling]).
  rope_config_to_hf(c, j, /*rope_parameters=*/true);
  return j;
}

void gpt_oss_to_megatron(const TransformerConfig& c, const std::function<Tensor(const std::string&)>& get_hf,
                         TensorSink& out) {
  const int64_t h = c.hidden_size, v = c.vocab_size, vp = c.padded_vocab_size, f = c.moe_ffn_hidden_size;
  const int64_t nq = c.num_attention_heads, ng = c.num_query_groups, d = c.kv_channels, e_count = c.num_moe_experts;
  const HFReader hf{get_hf};  // in its dtype: the experts are converted one at a time (expert_slice)
  out["embedding.word_embeddings.weight"] = pad_rows(hf("model.embed_tokens.weight", {v, h}), vp);
  for (int i = 0; i < c.num_layers; ++i) {
    auto p = [&](const char* rest) { return hf_layer(i, rest); };
    out[layer(i, "input_layernorm.weight")] = hf(p("input_layernorm.weight"), {h});
    out[layer(i, "self_attention.linear_qkv.weight")] =
        merge_qkv_rows(hf(p("self_attn.q_proj.weight"), {nq * d, h}), hf(p("self_attn.k_proj.weight"), {ng * d, h}),
                  hf(p("self_attn.v_proj.weight"), {ng * d, h}), nq, ng, d);
    out[layer(i, "self_attention.linear_qkv.bias")] =
        merge_qkv_rows(hf(p("self_attn.q_proj.bias"), {nq * d}), hf(p("self_attn.k_proj.bias"), {ng * d}),
                  hf(p("self_attn.v_proj.bias"), {ng * d}), nq, ng, d);
    out[layer(i, "self_attention.linear_proj.weight")] = hf(p("self_attn.o_proj.weight"), {h, nq * d});
    out[layer(i, "self_attention.linear_proj.bias")] = hf(p("self_attn.o_proj.bias"), {h});
    out[layer(i, "self_attention.core_attention.softmax_offset")] = hf(p("self_attn.sinks"), {nq});
    out[layer(i, "pre_mlp_layernorm.weight")] = hf(p("post_attention_layernorm.weight"), {h});
    out[layer(i, "mlp.router.weight")] = hf(p("mlp.router.weight"), {e_count, h});
    out[layer(i, "mlp.router.bias")] = hf(p("mlp.router.bias"), {e_count});
    const Tensor gate_up = hf(p("mlp.experts.gate_up_proj"), {e_count, h, 2 * f});
    const Tensor gate_up_bias = hf(p("mlp.experts.gate_up_proj_bias"), {e_count, 2 * f});
    const Tensor down = hf(p("mlp.experts.down_proj"), {e_count, f, h});
    const Tensor down_bias = hf(p("mlp.experts.down_proj_bias"), {e_count, h});
    for (int e = 0; e < e_count; ++e) {
      out[expert(i, e, "linear_fc1.weight")] = deinterleave_rows(transpose2d(expert_slice(gate_up, e)));
      out[expert(i, e, "linear_fc1.bias")] = deinterleave_rows(expert_slice(gate_up_bias, e));
      out[expert(i, e, "linear_fc2.weight")] = transpose2d(expert_slice(down, e));
      out[expert(i, e, "linear_fc2.bias")] = expert_slice(down_bias, e);
    }
  }
  out["decoder.final_layernorm.weight"] = hf("model.norm.weight", {h});
  if (!c.share_embeddings_and_output_weights) {
    out["output_layer.weight"] = pad_rows(hf("lm_head.weight", {v, h}), vp);
  }
}

void megatron_to_gpt_oss(const TransformerConfig& c, const std::function<Tensor(const std::string&)>& get,
                         TensorSink& out) {
  const int64_t v = c.vocab_size, nq = c.num_attention_heads, ng = c.num_query_groups, d = c.kv_channels;
  out["model.embed_tokens.weight"] = pad_rows(get("embedding.word_embeddings.weight"), v);
  for (int i = 0; i < c.num_layers; ++i) {
    auto p = [&](const char* rest) { return hf_layer(i, rest); };
    out[p("input_layernorm.weight")] = as_fp32(get(layer(i, "input_layernorm.weight")));
    Tensor q, k, vv;
    split_qkv(get(layer(i, "self_attention.linear_qkv.weight")), nq, ng, d, q, k, vv);
    out[p("self_attn.q_proj.weight")] = q, out[p("self_attn.k_proj.weight")] = k, out[p("self_attn.v_proj.weight")] = vv;
    split_qkv(get(layer(i, "self_attention.linear_qkv.bias")), nq, ng, d, q, k, vv);
    out[p("self_attn.q_proj.bias")] = q, out[p("self_attn.k_proj.bias")] = k, out[p("self_attn.v_proj.bias")] = vv;
    out[p("self_attn.o_proj.weight")] = as_fp32(get(layer(i, "self_attention.linear_proj.weight")));
    out[p("self_attn.o_proj.bias")] = as_fp32(get(layer(i, "self_attention.linear_proj.bias")));
    out[p("self_attn.sinks")] = as_fp32(get(layer(i, "self_attention.core_attention.softmax_offset")));
    out[p("post_attention_layernorm.weight")] = as_fp32(get(layer(i, "pre_mlp_layernorm.weight")));
    out[p("mlp.router.weight")] = as_fp32(get(layer(i, "mlp.router.weight")));
    out[p("mlp.router.bias")] = as_fp32(get(layer(i, "mlp.router.bias")));
    const int64_t e_count = c.num_moe_experts, h = c.hidden_size, f = c.moe_ffn_hidden_size;
    auto ours = [&, i](const char* rest) { return [&get, i, rest](int64_t e) { return get(expert(i, int(e), rest)); }; };
    const auto fc1 = ours("linear_fc1.weight"), fc1_bias = ours("linear_fc1.bias"), fc2 = ours("linear_fc2.weight"),
               fc2_bias = ours("linear_fc2.bias");
    out[p("mlp.experts.gate_up_proj")] =
        stack_experts(e_count, {h, 2 * f}, [&](int64_t e) { return transpose2d(interleave_rows(fc1(e))); });
    out[p("mlp.experts.gate_up_proj_bias")] =
        stack_experts(e_count, {2 * f}, [&](int64_t e) { return interleave_rows(fc1_bias(e)); });
    out[p("mlp.experts.down_proj")] = stack_experts(e_count, {f, h}, [&](int64_t e) { return transpose2d(fc2(e)); });
    out[p("mlp.experts.down_proj_bias")] = stack_experts(e_count, {h}, fc2_bias);
  }
  out["model.norm.weight"] = as_fp32(get("decoder.final_layernorm.weight"));
  if (!c.share_embeddings_and_output_weights) out["lm_head.weight"] = pad_rows(get("output_layer.weight"), v);
}

}  // namespace megatron
