#include "megatron/core/models/gpt/hf_deepseek.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "megatron/core/models/gpt/hf_rope.h"
#include "megatron/core/models/gpt/hf_util.h"

namespace megatron {

using namespace hf_detail;

bool is_hf_deepseek(const std::string& model_type) { return model_type == "deepseek_v3"; }

// ---- config ----------------------------------------------------------------------------------------
namespace {
// HF runs a layer of index >= first_k_dense_replace as MoE, the MTP layers included; Megatron builds
// the MTP layers from the decoder's last layer (get_gpt_mtp_block_spec). They agree when that is MoE.
void check_mtp_layers(const TransformerConfig& c) {
  MG_CHECK(c.mtp_num_layers == 0 || (c.num_layers > 0 && c.is_moe_layer(c.num_layers - 1)),
           "DeepSeek-V3 multi-token prediction ({} layers) with a dense last decoder layer is not supported: HF makes "
           "the MTP layers MoE, Megatron copies the last decoder layer",
           c.mtp_num_layers);
}

}  // namespace

void deepseek_config_from_hf(const nlohmann::json& j, TransformerConfig& c) {
  auto num = [&](const char* key, auto fallback) {
    return j.contains(key) && !j[key].is_null() ? j[key].get<decltype(fallback)>() : fallback;
  };
  auto required = [&](const char* key) {
    MG_CHECK(j.contains(key) && j[key].is_number_integer(), "deepseek_v3 config.json needs an integer {}", key);
    return j[key].get<int>();
  };
  c.num_layers = required("num_hidden_layers");
  c.hidden_size = required("hidden_size");
  c.num_attention_heads = required("num_attention_heads");
  c.num_query_groups = c.num_attention_heads;
  const int kv_heads = num("num_key_value_heads", c.num_attention_heads);
  MG_CHECK(kv_heads == c.num_attention_heads,
           "deepseek_v3 num_key_value_heads {} differs from num_attention_heads {}: multi-latent attention has one "
           "key/value head per query head",
           kv_heads, c.num_attention_heads);
  c.ffn_hidden_size = required("intermediate_size");
  c.max_position_embeddings = num("max_position_embeddings", 0);
  c.vocab_size = required("vocab_size");
  c.layernorm_epsilon = num("rms_norm_eps", 1e-6f);
  // HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon 1e-6 whatever
  // rms_norm_eps says; Megatron's MLA norms take --norm-epsilon like the others.
  MG_CHECK(c.layernorm_epsilon == 1e-6f,
           "deepseek_v3 rms_norm_eps {} is not supported: HF's latent norms (q_a_layernorm, kv_a_layernorm) always use "
           "1e-6 and Megatron's use --norm-epsilon, so only 1e-6 computes the same",
           c.layernorm_epsilon);
  c.normalization = "RMSNorm";
  c.activation = "swiglu";
  const std::string act = num("hidden_act", std::string("silu"));
  MG_CHECK(act == "silu", "hidden_act '{}' is not supported: only silu (SwiGLU)", act);
  c.add_bias_linear = false;
  MG_CHECK(!num("attention_bias", false), "deepseek_v3 attention_bias=true is not supported: Megatron's MLA projections "
                                          "have no biases");
  // Multi-latent attention (Note [Multi-latent attention]).
  c.multi_latent_attention = true;
  c.qk_layernorm = true;  // q_a_layernorm, kv_a_layernorm
  c.q_lora_rank = num("q_lora_rank", 0);
  c.kv_lora_rank = required("kv_lora_rank");
  c.qk_head_dim = required("qk_nope_head_dim");
  c.qk_pos_emb_head_dim = required("qk_rope_head_dim");
  c.v_head_dim = required("v_head_dim");
  c.kv_channels = c.v_head_dim;  // not used by MLA
  // RoPE over the qk_rope_head_dim channels (HF's head_dim for the rotary tables).
  rope_config_from_hf(j, c);  // Note [HF RoPE scaling]; refuses unknown rope types
  MG_CHECK(c.use_rope(), "deepseek_v3 config.json without RoPE is not supported");
  // HF scales the softmax by mscale(factor, mscale_all_dim)² (yarn_apply_mscale); Megatron's MLA
  // takes mscale_all_dim from its YaRN settings, so the two must agree.
  const nlohmann::json rope = j.contains("rope_scaling") && j["rope_scaling"].is_object()       ? j["rope_scaling"]
                              : j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"]
                                                                                                 : nlohmann::json();
  const double mscale_all_dim =
      rope.is_object() && rope.contains("mscale_all_dim") && !rope["mscale_all_dim"].is_null()
          ? rope["mscale_all_dim"].get<double>()
          : 0.0;
  MG_CHECK(!c.use_yarn() || double(c.yarn_mscale_all_dim) == mscale_all_dim,
           "deepseek_v3 rope_scaling with mscale_all_dim {} but no mscale: HF then scales cos/sin by mscale(factor) and "
           "the softmax by mscale(factor, mscale_all_dim)², which Megatron's --mscale/--mscale-all-dim cannot express",
           mscale_all_dim);
  // Mixture of experts: dense first layers, then MoE (Note [HF DeepSeek-V3]).
  c.num_moe_experts = required("n_routed_experts");
  c.moe_router_topk = required("num_experts_per_tok");
  c.moe_ffn_hidden_size = required("moe_intermediate_size");
  c.moe_shared_expert_intermediate_size = num("n_shared_experts", 0) * c.moe_ffn_hidden_size;
  const int dense = num("first_k_dense_replace", 0);
  const int freq = num("moe_layer_freq", 1);
  MG_CHECK(freq == 1, "deepseek_v3 moe_layer_freq {} is not supported: HF DeepSeek-V3 makes every layer after "
                      "first_k_dense_replace an MoE layer", freq);
  MG_CHECK(dense >= 0 && dense <= c.num_layers, "first_k_dense_replace {} must be within [0, num_hidden_layers {}]",
           dense, c.num_layers);
  if (dense == 0) {
    c.moe_layer_freq = "1";
  } else {
    c.moe_layer_freq = fmt::format("([0]*{}+[1]*{})", dense, c.num_layers - dense);
  }
  const std::string scoring = num("scoring_func", std::string("sigmoid"));
  MG_CHECK(scoring == "sigmoid", "deepseek_v3 scoring_func '{}' is not supported: DeepSeek-V3 routes by sigmoid",
           scoring);
  const std::string method = num("topk_method", std::string("noaux_tc"));
  MG_CHECK(method == "noaux_tc", "deepseek_v3 topk_method '{}' is not supported: only noaux_tc (the expert bias)",
           method);
  c.moe_router_score_function = "sigmoid";
  c.moe_router_enable_expert_bias = true;
  c.moe_router_pre_softmax = false;
  MG_CHECK(num("norm_topk_prob", true) || c.moe_router_topk == 1,
           "deepseek_v3 norm_topk_prob=false is not supported: Megatron renormalises the chosen sigmoid scores");
  const int groups = num("n_group", 1), group_topk = num("topk_group", 1);
  c.moe_router_num_groups = groups > 1 ? groups : 0;
  c.moe_router_group_topk = groups > 1 ? group_topk : 0;
  // HF scores a group by the sum of its top 2; Megatron's topk / group_topk agrees for DeepSeek-V3 (8 / 4).
  if (groups > 1 && (group_topk <= 0 || c.moe_router_topk / group_topk != 2)) c.moe_router_group_score_topk = 2;
  c.moe_router_topk_scaling_factor = num("routed_scaling_factor", 1.0f);
  if (c.moe_router_topk_scaling_factor == 1.0f) c.moe_router_topk_scaling_factor = 0.0f;  // Megatron's None
  c.moe_router_load_balancing_type = {"aux_loss"};
  c.moe_aux_loss_coeff = {0.0f};
  c.share_embeddings_and_output_weights = num("tie_word_embeddings", false);
  c.hidden_dropout = 0.0f;
  c.attention_dropout = num("attention_dropout", 0.0f);
  c.init_method_std = num("initializer_range", 0.02f);
  c.mtp_num_layers = num("num_nextn_predict_layers", 0);  // Note [HF DeepSeek-V3 MTP]
  MG_CHECK(c.mtp_num_layers >= 0, "deepseek_v3 num_nextn_predict_layers {} must not be negative", c.mtp_num_layers);
}

nlohmann::json deepseek_config_to_hf(const TransformerConfig& c) {
  MG_CHECK(c.qk_layernorm, "--multi-latent-attention without --qk-layernorm has no HuggingFace export: DeepSeek-V3 "
                           "normalises its latents");
  MG_CHECK(c.gated_linear_unit && c.use_rmsnorm() && !c.add_bias_linear,
           "--multi-latent-attention exports as DeepSeek-V3, which needs --swiglu, --normalization RMSNorm and "
           "--disable-bias-linear");
  MG_CHECK(!c.layernorm_zero_centered_gamma, "--apply-layernorm-1p has no DeepSeek-V3 export");
  MG_CHECK(c.layernorm_epsilon == 1e-6f,
           "--norm-epsilon {} has no DeepSeek-V3 export: HF's latent norms always use 1e-6 (give --norm-epsilon 1e-6)",
           c.layernorm_epsilon);
  nlohmann::json j = llama_family_config(c, "deepseek_v3", "DeepseekV3ForCausalLM", c.ffn_hidden_size,
                                         c.num_attention_heads, c.qk_pos_emb_head_dim, /*attention_bias=*/false);
  j["q_lora_rank"] = c.q_lora_rank > 0 ? nlohmann::json(c.q_lora_rank) : nlohmann::json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_head_dim;
  j["qk_rope_head_dim"] = c.qk_pos_emb_head_dim;
  j["qk_head_dim"] = c.qk_head_dim + c.qk_pos_emb_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["rope_interleave"] = true;  // Note [Importing DeepSeek's interleaved RoPE]
  rope_config_to_hf(c, j);  // rope_theta, rope_scaling (Note [HF RoPE scaling])
  MG_CHECK(c.is_moe(), "--multi-latent-attention without --num-experts has no HuggingFace export: DeepSeek-V3 has "
                       "MoE layers");
  MG_CHECK(c.moe_router_score_function == "sigmoid" && c.moe_router_enable_expert_bias && !c.moe_router_pre_softmax &&
               c.moe_expert_capacity_factor == 0.0f && !c.moe_shared_expert_gate,
           "this MoE router has no DeepSeek-V3 export: it needs --moe-router-score-function sigmoid "
           "--moe-router-enable-expert-bias, no --moe-router-pre-softmax, no capacity and no shared-expert gate");
  int dense = 0;
  while (dense < c.num_layers && !c.is_moe_layer(dense)) ++dense;
  for (int i = dense; i < c.num_layers; ++i)
    MG_CHECK(c.is_moe_layer(i), "--moe-layer-freq {} has no DeepSeek-V3 export: dense layers must all come first",
             c.moe_layer_freq);
  MG_CHECK(c.moe_shared_expert_intermediate_size % c.moe_ffn_hidden_size == 0,
           "--moe-shared-expert-intermediate-size {} has no DeepSeek-V3 export: it must be a multiple of "
           "--moe-ffn-hidden-size {} (n_shared_experts)",
           c.moe_shared_expert_intermediate_size, c.moe_ffn_hidden_size);
  const float aux = c.moe_aux_loss_coeff.empty() ? 0.0f : c.moe_aux_loss_coeff[0];
  MG_CHECK(aux == 0.0f, "--moe-aux-loss-coeff has no DeepSeek-V3 export (HF DeepSeek-V3 has no auxiliary loss)");
  j["n_routed_experts"] = c.num_moe_experts;
  j["num_experts_per_tok"] = c.moe_router_topk;
  j["moe_intermediate_size"] = c.moe_ffn_hidden_size;
  j["n_shared_experts"] = c.moe_shared_expert_intermediate_size / c.moe_ffn_hidden_size;
  j["first_k_dense_replace"] = dense;
  if (c.moe_router_num_groups > 0) {
    const int per_score = c.moe_router_group_score_topk > 0 ? c.moe_router_group_score_topk
                                                            : c.moe_router_topk / c.moe_router_group_topk;
    MG_CHECK(per_score == 2,
             "group-limited routing summing {} scores per group has no DeepSeek-V3 export: HF sums each group's top 2 "
             "(give --moe-router-group-score-topk 2)",
             per_score);
  }
  j["n_group"] = c.moe_router_num_groups > 0 ? c.moe_router_num_groups : 1;
  j["topk_group"] = c.moe_router_num_groups > 0 ? c.moe_router_group_topk : 1;
  j["norm_topk_prob"] = true;
  j["routed_scaling_factor"] = c.moe_router_topk_scaling_factor > 0.0f ? shortest(c.moe_router_topk_scaling_factor) : 1.0;
  check_mtp_layers(c);
  j["num_nextn_predict_layers"] = c.mtp_num_layers;  // Note [HF DeepSeek-V3 MTP]
  return j;
}

// ---- tensors ---------------------------------------------------------------------------------------
namespace {

// Note [Importing DeepSeek's interleaved RoPE]: within each of `heads` blocks of `block` rows, the pe
// rope rows at `offset` go from pair order (2j, 2j+1) to half-split order (j, j + pe/2), or back.
Tensor permute_rope_rows(const Tensor& t, int64_t heads, int64_t block, int64_t offset, int64_t pe,
                         bool to_half_split) {
  Tensor src = host(t);
  Tensor out = src.clone();
  const size_t row = size_t(src.numel() / src.size(0)) * size_of(src.dtype());  // bytes per row, any dtype
  const auto* s = static_cast<const std::byte*>(src.raw_data());
  auto* o = static_cast<std::byte*>(out.raw_data());
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t j = 0; j < pe / 2; ++j)
      for (int64_t part = 0; part < 2; ++part) {
        const int64_t pair = hd * block + offset + 2 * j + part, half = hd * block + offset + j + part * (pe / 2);
        const int64_t from = to_half_split ? pair : half, to = to_half_split ? half : pair;
        std::memcpy(o + size_t(to) * row, s + size_t(from) * row, row);
      }
  return out;
}

struct Dims {
  int64_t h, n, qk, pe, dv, qr, kvr, v, vp, f, ef, sf;
  explicit Dims(const TransformerConfig& c)
      : h(c.hidden_size),
        n(c.num_attention_heads),
        qk(c.qk_head_dim),
        pe(c.qk_pos_emb_head_dim),
        dv(c.v_head_dim),
        qr(c.q_lora_rank),
        kvr(c.kv_lora_rank),
        v(c.vocab_size),
        vp(c.padded_vocab_size),
        f(c.ffn_hidden_size),
        ef(c.moe_ffn_hidden_size),
        sf(c.moe_shared_expert_intermediate_size) {}
};

// The HF and Megatron names of one transformer layer: decoder layer i is model.layers.i.* and
// decoder.layers.i.*; MTP depth k (Note [HF DeepSeek-V3 MTP]) is model.layers.{L + k}.* and
// mtp.layers.k.transformer_layer.*.
struct LayerNames {
  std::string hf, ours;  // prefixes, ending in '.'
  bool moe;
  std::string theirs(const char* rest) const { return hf + rest; }
  std::string mine(const std::string& rest) const { return ours + rest; }
};

std::vector<LayerNames> layer_names(const TransformerConfig& c) {
  std::vector<LayerNames> out;
  for (int i = 0; i < c.num_layers; ++i)
    out.push_back({fmt::format("model.layers.{}.", i), fmt::format("decoder.layers.{}.", i), c.is_moe_layer(i)});
  for (int k = 0; k < c.mtp_num_layers; ++k)
    out.push_back({fmt::format("model.layers.{}.", c.num_layers + k), fmt::format("mtp.layers.{}.transformer_layer.", k),
                   true});
  return out;
}

}  // namespace

void check_deepseek_mtp_copies(const HFModelInfo& info, const std::function<Shape(const std::string&)>& shape_of,
                               const std::function<bool(const std::string&, const std::string&)>& same) {
  const TransformerConfig& c = info.config;
  if (c.mtp_num_layers == 0) return;
  const Dims d(c);
  const std::string head = c.share_embeddings_and_output_weights ? "model.embed_tokens.weight" : "lm_head.weight";
  for (const std::string& name : {std::string("model.embed_tokens.weight"), head}) {
    MG_CHECK(shape_of(name) == Shape({d.v, d.h}),
             "HF tensor '{}' has shape {}, but the config needs {}: the weights do not belong to this config.json", name,
             shape_str(shape_of(name)), shape_str({d.v, d.h}));
  }
  for (int k = 0; k < c.mtp_num_layers; ++k) {
    const std::string p = fmt::format("model.layers.{}.", c.num_layers + k);
    for (const auto& [copy, shared] : {std::pair{p + "embed_tokens.weight", std::string("model.embed_tokens.weight")},
                                       {p + "shared_head.head.weight", head}}) {
      MG_CHECK(same(copy, shared), "{} differs from {}: Megatron's MTP layers share the model's embedding and output layer",
               copy, shared);
    }
  }
}

void check_deepseek_mtp_copies(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf) {
  check_deepseek_mtp_copies(
      info, [&](const std::string& name) { return get_hf(name).shape(); },
      [&](const std::string& a, const std::string& b) {
        const Tensor ta = host(get_hf(a)), tb = host(get_hf(b));
        return ta.dtype() == tb.dtype() && ta.shape() == tb.shape() &&
               std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()) == 0;
      });
}

void deepseek_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf,
                          TensorSink& out) {
  const TransformerConfig& c = info.config;
  check_mtp_layers(c);
  const Dims d(c);
  const int64_t dqk = d.qk + d.pe;
  HFReader hf{get_hf};
  auto rope_rows = [&](Tensor t, int64_t heads, int64_t block, int64_t offset) {
    return info.rope_interleave ? permute_rope_rows(t, heads, block, offset, d.pe, true) : t;
  };
  out["embedding.word_embeddings.weight"] = pad_rows(hf("model.embed_tokens.weight", {d.v, d.h}), d.vp);
  for (const LayerNames& l : layer_names(c)) {
    auto p = [&](const char* rest) { return l.theirs(rest); };
    auto set = [&](const std::string& rest, RowParts t) { out[l.mine(rest)] = std::move(t); };
    set("input_layernorm.weight", hf(p("input_layernorm.weight"), {d.h}));
    if (d.qr > 0) {
      set("self_attention.linear_q_down_proj.weight", hf(p("self_attn.q_a_proj.weight"), {d.qr, d.h}));
      set("self_attention.q_layernorm.weight", hf(p("self_attn.q_a_layernorm.weight"), {d.qr}));
      set("self_attention.linear_q_up_proj.weight",
          rope_rows(hf(p("self_attn.q_b_proj.weight"), {d.n * dqk, d.qr}), d.n, dqk, d.qk));
    } else {
      set("self_attention.linear_q_proj.weight",
          rope_rows(hf(p("self_attn.q_proj.weight"), {d.n * dqk, d.h}), d.n, dqk, d.qk));
    }
    set("self_attention.linear_kv_down_proj.weight",
        rope_rows(hf(p("self_attn.kv_a_proj_with_mqa.weight"), {d.kvr + d.pe, d.h}), 1, d.kvr + d.pe, d.kvr));
    set("self_attention.kv_layernorm.weight", hf(p("self_attn.kv_a_layernorm.weight"), {d.kvr}));
    set("self_attention.linear_kv_up_proj.weight", hf(p("self_attn.kv_b_proj.weight"), {d.n * (d.qk + d.dv), d.kvr}));
    set("self_attention.linear_proj.weight", hf(p("self_attn.o_proj.weight"), {d.h, d.n * d.dv}));
    set("pre_mlp_layernorm.weight", hf(p("post_attention_layernorm.weight"), {d.h}));
    auto fc1 = [&](const std::string& base, int64_t rows) {
      return RowParts({hf(base + "gate_proj.weight", {rows, d.h}), hf(base + "up_proj.weight", {rows, d.h})});
    };
    if (!l.moe) {
      set("mlp.linear_fc1.weight", fc1(p("mlp."), d.f));
      set("mlp.linear_fc2.weight", hf(p("mlp.down_proj.weight"), {d.h, d.f}));
      continue;
    }
    set("mlp.router.weight", hf(p("mlp.gate.weight"), {c.num_moe_experts, d.h}));
    set("mlp.router.expert_bias", hf(p("mlp.gate.e_score_correction_bias"), {c.num_moe_experts}));
    for (int e = 0; e < c.num_moe_experts; ++e) {
      const std::string ours = fmt::format("mlp.experts.local_experts.{}.", e);
      const std::string theirs = p("mlp.experts.") + std::to_string(e) + ".";
      set(ours + "linear_fc1.weight", fc1(theirs, d.ef));
      set(ours + "linear_fc2.weight", hf(theirs + "down_proj.weight", {d.h, d.ef}));
    }
    if (d.sf > 0) {
      set("mlp.shared_experts.linear_fc1.weight", fc1(p("mlp.shared_experts."), d.sf));
      set("mlp.shared_experts.linear_fc2.weight", hf(p("mlp.shared_experts.down_proj.weight"), {d.h, d.sf}));
    }
  }
  out["decoder.final_layernorm.weight"] = hf("model.norm.weight", {d.h});
  if (!c.share_embeddings_and_output_weights)
    out["output_layer.weight"] = pad_rows(hf("lm_head.weight", {d.v, d.h}), d.vp);
  // Note [HF DeepSeek-V3 MTP]: each depth's own tensors; its copies of the shared embedding and
  // output head are read here (so none is left unused) and checked equal to the model's by
  // check_deepseek_mtp_copies (outside the mapping, which a streaming converter also runs over
  // placeholders to plan its output).
  for (int k = 0; k < c.mtp_num_layers; ++k) {
    const std::string p = fmt::format("model.layers.{}.", c.num_layers + k), ours = fmt::format("mtp.layers.{}.", k);
    out[ours + "enorm.weight"] = hf(p + "enorm.weight", {d.h});
    out[ours + "hnorm.weight"] = hf(p + "hnorm.weight", {d.h});
    out[ours + "eh_proj.weight"] = hf(p + "eh_proj.weight", {d.h, 2 * d.h});
    out[ours + "final_layernorm.weight"] = hf(p + "shared_head.norm.weight", {d.h});
    hf(p + "embed_tokens.weight", {d.v, d.h});
    hf(p + "shared_head.head.weight", {d.v, d.h});
  }
}

void megatron_to_deepseek(const HFModelInfo& info, const TensorSource& m, TensorSink& out) {
  const TransformerConfig& c = info.config;
  check_mtp_layers(c);
  const Dims d(c);
  const int64_t dqk = d.qk + d.pe;
  auto get = [&](const std::string& name) -> Tensor { return host(m.get(name)); };  // in its stored dtype
  auto rope_rows = [&](Tensor t, int64_t heads, int64_t block, int64_t offset) {
    return info.rope_interleave ? permute_rope_rows(t, heads, block, offset, d.pe, false) : t;
  };
  out["model.embed_tokens.weight"] = pad_rows(get("embedding.word_embeddings.weight"), d.v);
  for (const LayerNames& l : layer_names(c)) {
    auto p = [&](const char* rest) { return l.theirs(rest); };
    auto mine = [&](const std::string& rest) { return get(l.mine(rest)); };
    out[p("input_layernorm.weight")] = mine("input_layernorm.weight");
    if (d.qr > 0) {
      out[p("self_attn.q_a_proj.weight")] = mine("self_attention.linear_q_down_proj.weight");
      out[p("self_attn.q_a_layernorm.weight")] = mine("self_attention.q_layernorm.weight");
      out[p("self_attn.q_b_proj.weight")] = rope_rows(mine("self_attention.linear_q_up_proj.weight"), d.n, dqk, d.qk);
    } else {
      out[p("self_attn.q_proj.weight")] = rope_rows(mine("self_attention.linear_q_proj.weight"), d.n, dqk, d.qk);
    }
    out[p("self_attn.kv_a_proj_with_mqa.weight")] =
        rope_rows(mine("self_attention.linear_kv_down_proj.weight"), 1, d.kvr + d.pe, d.kvr);
    out[p("self_attn.kv_a_layernorm.weight")] = mine("self_attention.kv_layernorm.weight");
    out[p("self_attn.kv_b_proj.weight")] = mine("self_attention.linear_kv_up_proj.weight");
    out[p("self_attn.o_proj.weight")] = mine("self_attention.linear_proj.weight");
    out[p("post_attention_layernorm.weight")] = mine("pre_mlp_layernorm.weight");
    auto split_fc1 = [&](const std::string& fc1_rest, const std::string& base) {
      Tensor fc1 = mine(fc1_rest);
      const int64_t half = fc1.size(0) / 2;
      out[base + "gate_proj.weight"] = fc1.slice(0, half);
      out[base + "up_proj.weight"] = fc1.slice(half, 2 * half);
    };
    if (!l.moe) {
      split_fc1("mlp.linear_fc1.weight", p("mlp."));
      out[p("mlp.down_proj.weight")] = mine("mlp.linear_fc2.weight");
      continue;
    }
    out[p("mlp.gate.weight")] = mine("mlp.router.weight");
    // The expert bias is a model buffer, not a parameter: exported when the state holds it
    // (checkpoints and model_buffer_dict do; gradients do not).
    if (m.has(l.mine("mlp.router.expert_bias")))
      out[p("mlp.gate.e_score_correction_bias")] = mine("mlp.router.expert_bias");
    for (int e = 0; e < c.num_moe_experts; ++e) {
      const std::string ours = fmt::format("mlp.experts.local_experts.{}.", e);
      const std::string theirs = p("mlp.experts.") + std::to_string(e) + ".";
      split_fc1(ours + "linear_fc1.weight", theirs);
      out[theirs + "down_proj.weight"] = mine(ours + "linear_fc2.weight");
    }
    if (d.sf > 0) {
      split_fc1("mlp.shared_experts.linear_fc1.weight", p("mlp.shared_experts."));
      out[p("mlp.shared_experts.down_proj.weight")] = mine("mlp.shared_experts.linear_fc2.weight");
    }
  }
  out["model.norm.weight"] = get("decoder.final_layernorm.weight");
  if (!c.share_embeddings_and_output_weights) out["lm_head.weight"] = pad_rows(get("output_layer.weight"), d.v);
  // Note [HF DeepSeek-V3 MTP]: the shared embedding and head written again as each depth's copies.
  const char* head = c.share_embeddings_and_output_weights ? "embedding.word_embeddings.weight" : "output_layer.weight";
  for (int k = 0; k < c.mtp_num_layers; ++k) {
    const std::string p = fmt::format("model.layers.{}.", c.num_layers + k), ours = fmt::format("mtp.layers.{}.", k);
    out[p + "enorm.weight"] = get(ours + "enorm.weight");
    out[p + "hnorm.weight"] = get(ours + "hnorm.weight");
    out[p + "eh_proj.weight"] = get(ours + "eh_proj.weight");
    out[p + "shared_head.norm.weight"] = get(ours + "final_layernorm.weight");
    out[p + "embed_tokens.weight"] = pad_rows(get("embedding.word_embeddings.weight"), d.v);
    out[p + "shared_head.head.weight"] = pad_rows(get(head), d.v);
  }
}

}  // namespace megatron
