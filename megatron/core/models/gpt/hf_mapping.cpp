// HF tensors <-> Megatron-Core tensors for the GPT-2 and Llama families (hf_mapping.h; gpt_oss and
// deepseek_v3 dispatch to hf_gpt_oss.cpp and hf_deepseek.cpp), HF folders, and a model's tensors by
// name. The config.json each mapping follows is hf_config.cpp's.
#include "megatron/core/models/gpt/hf_mapping.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_deepseek.h"
#include "megatron/core/models/gpt/hf_gpt_oss.h"
#include "megatron/core/models/gpt/hf_util.h"

namespace megatron {

namespace {
using namespace hf_detail;

// A sink that collects a mapping's tensors into a map (the non-streaming API).
struct MapSink {
  TensorMap map;
  TensorSink sink{[this](const std::string& name, RowParts t) { map[name] = t.materialize(); }};
};

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
