// HF config.json <-> TransformerConfig (hf_config.h): the readers and the writer of the GPT-2 and
// Llama families (Mixtral and the Qwen MoE types included); gpt_oss and deepseek_v3 dispatch to
// hf_gpt_oss.cpp and hf_deepseek.cpp, the RoPE and attention-window fields to hf_rope.cpp. The
// tensors that go with a config are hf_mapping.cpp's.
#include "megatron/core/models/gpt/hf_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "megatron/core/models/gpt/hf_deepseek.h"
#include "megatron/core/models/gpt/hf_gpt_oss.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/models/gpt/hf_rope.h"
#include "megatron/core/models/gpt/hf_util.h"

namespace megatron {

namespace hf_detail {

bool is_hf_moe(const std::string& model_type) {
  return model_type == "mixtral" || model_type == "qwen2_moe" || model_type == "qwen3_moe";
}

float router_aux_loss_coef_to_hf(const TransformerConfig& c) {
  const float aux = c.moe_aux_loss_coeff.empty() ? 0.0f : c.moe_aux_loss_coeff[0];
  MG_CHECK(aux == 0.0f || (c.moe_router_load_balancing_type.size() == 1 &&
                           c.moe_router_load_balancing_type[0] == "aux_loss"),
           "only --moe-router-load-balancing-type aux_loss has a HuggingFace equivalent (router_aux_loss_coef)");
  return aux;
}

nlohmann::json llama_family_config(const TransformerConfig& c, const std::string& model_type,
                                   const std::string& architecture, int64_t intermediate_size, int64_t kv_heads,
                                   int64_t head_dim, bool attention_bias) {
  return {{"model_type", model_type},
          {"architectures", {architecture}},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", intermediate_size},
          {"num_hidden_layers", c.num_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", kv_heads},
          {"head_dim", head_dim},
          {"rms_norm_eps", shortest(c.layernorm_epsilon)},
          {"max_position_embeddings", c.max_position_embeddings},
          {"vocab_size", c.vocab_size},
          {"hidden_act", "silu"},
          {"attention_bias", attention_bias},
          {"tie_word_embeddings", c.share_embeddings_and_output_weights}};
}

}  // namespace hf_detail

namespace {
using namespace hf_detail;

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

}  // namespace

// ---- HF config -> Megatron-Core config ------------------------------------------------------------
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

// The folder form: the tensors settle what the config alone cannot (Note [HF DeepSeek-V3 MTP]).
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
  nlohmann::json j = llama_family_config(c, model_type, architectures.at(model_type), c.ffn_hidden_size,
                                         c.num_query_groups, c.kv_channels, c.add_qkv_bias);
  if (model_type == "qwen2") {
    j.erase("attention_bias");  // HF Qwen2 always biases q, k and v
    j["use_sliding_window"] = false;
  }
  rope_config_to_hf(c, j);  // rope_theta, partial_rotary_factor, rope_scaling (Note [HF RoPE scaling])
  if (!c.is_moe()) return j;
  const float aux = router_aux_loss_coef_to_hf(c);
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

}  // namespace megatron
