// HF DeepSeek-V3 <-> Megatron-Core (Note [HF DeepSeek-V3] in hf_deepseek.h): the fixture's folder
// imported and exported back is exact, tensor for tensor (Note [Importing DeepSeek's interleaved
// RoPE]: the rope rows are permuted there and back), through a GPTModel too (the expert bias is a model
// buffer); the config round trip; the multi-token-prediction layers (Note [HF DeepSeek-V3 MTP]) of a
// model with --mtp-num-layers exported and imported back bit-exact; and the one-line refusals of what
// the import does not support.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <fstream>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/runtime/philox.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

std::string folder_dir() { return testing::arch_fixtures_dir() + "/deepseek_v3"; }

void expect_same_maps(const TensorMap& got, const HFFolder& folder, const std::string& what) {
  const std::vector<std::string> names = folder.tensor_names();
  EXPECT_EQ(got.size(), names.size()) << what;
  for (const std::string& n : names) {
    ASSERT_TRUE(got.count(n)) << what << ": " << n << " missing";
    EXPECT_EQ(got.at(n).shape(), folder.get(n).shape()) << what << ": " << n;
    EXPECT_EQ(got.at(n).to_floats(), folder.get(n).to_floats()) << what << ": " << n;
  }
}

TEST(HFDeepSeekV3, ImportThenExportIsExact) {
  HFFolder folder(folder_dir());
  const HFModelInfo info = config_from_hf(folder, 1);
  EXPECT_TRUE(info.rope_interleave);
  EXPECT_TRUE(info.config.multi_latent_attention);
  const TensorMap megatron = hf_to_megatron(info, [&](const std::string& n) { return folder.get(n); });
  expect_same_maps(megatron_to_hf(info, megatron), folder, "maps");
  // The rope rows really move: q_b_proj's first head, its first rope row pair.
  const int64_t qk = info.config.qk_head_dim, pe = info.config.qk_pos_emb_head_dim;
  const Tensor theirs = folder.get("model.layers.0.self_attn.q_b_proj.weight");
  const Tensor ours = megatron.at("decoder.layers.0.self_attention.linear_q_up_proj.weight");
  EXPECT_EQ(ours.slice(qk + 1, qk + 2).to_floats(), theirs.slice(qk + 2, qk + 3).to_floats());      // HF 2 -> 1
  EXPECT_EQ(ours.slice(qk + pe / 2, qk + pe / 2 + 1).to_floats(), theirs.slice(qk + 1, qk + 2).to_floats());  // 1 -> pe/2

  GPTModel model(info.config);
  load_model_state_dict(model, megatron, folder.dir());
  TensorMap state = model_state_dict(model);
  EXPECT_EQ(model_buffer_dict(model).size(), 2u);  // the expert biases of the two MoE layers
  state.merge(model_buffer_dict(model));
  expect_same_maps(megatron_to_hf(info, state), folder, "through the model");
}

TEST(HFDeepSeekV3, ConfigRoundTrip) {
  HFFolder folder(folder_dir());
  const HFModelInfo info = config_from_hf(folder, 1);
  const TransformerConfig& a = info.config;
  const nlohmann::json exported = hf_config_from_megatron(a);
  const HFModelInfo back = config_from_hf(exported, 1);
  const TransformerConfig& b = back.config;
  EXPECT_EQ(exported.at("model_type"), "deepseek_v3");
  EXPECT_TRUE(back.rope_interleave);
  EXPECT_EQ(std::make_tuple(a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim),
            std::make_tuple(b.q_lora_rank, b.kv_lora_rank, b.qk_head_dim, b.qk_pos_emb_head_dim, b.v_head_dim));
  EXPECT_EQ(a.moe_layer_pattern, b.moe_layer_pattern);
  EXPECT_EQ(std::make_tuple(a.num_moe_experts, a.moe_router_topk, a.moe_router_num_groups, a.moe_router_group_topk,
                            a.moe_router_group_score_topk, a.moe_shared_expert_intermediate_size),
            std::make_tuple(b.num_moe_experts, b.moe_router_topk, b.moe_router_num_groups, b.moe_router_group_topk,
                            b.moe_router_group_score_topk, b.moe_shared_expert_intermediate_size));
  EXPECT_EQ(a.moe_router_topk_scaling_factor, b.moe_router_topk_scaling_factor);
  EXPECT_EQ(std::make_tuple(a.position_embedding_type, a.yarn_rotary_scaling_factor, a.yarn_mscale,
                            a.yarn_mscale_all_dim, a.yarn_original_max_position_embeddings),
            std::make_tuple(b.position_embedding_type, b.yarn_rotary_scaling_factor, b.yarn_mscale,
                            b.yarn_mscale_all_dim, b.yarn_original_max_position_embeddings));
  // The fixture routes top-2 within 2 of 4 groups: HF sums each group's top 2, Megatron's topk / group_topk is 1.
  EXPECT_EQ(a.moe_router_group_score_topk, 2);
}

// ---- multi-token prediction (Note [HF DeepSeek-V3 MTP]) ---------------------------------------------

bool bit_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(DType::Float32), y = b.to(DType::Float32);
  return x.shape() == y.shape() && std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// A folder (config.json, model.safetensors) of the given HF tensors.
struct TempFolder {
  std::filesystem::path dir;
  TempFolder(const std::string& name, const nlohmann::json& config, const TensorMap& tensors) {
    dir = std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << config.dump(2);
    std::vector<std::pair<std::string, Tensor>> list(tensors.begin(), tensors.end());
    safetensors::write((dir / "model.safetensors").string(), list, {{"format", "pt"}});
  }
  ~TempFolder() { std::filesystem::remove_all(dir); }
};

// The fixture's shape with one MTP depth, every parameter and expert bias set to distinct values:
// the Megatron state (parameters and buffers) and its HF export.
struct MtpModel {
  HFModelInfo info;
  TensorMap state, hf;
  nlohmann::json config;
  MtpModel() {
    info = config_from_hf(HFFolder(folder_dir()), 1);
    info.config.mtp_num_layers = 1;
    GPTModel model(info.config);
    model.init_weights(7);
    TensorMap buffers = model_buffer_dict(model);
    for (auto& [name, t] : buffers) {  // expert biases away from zero, a function of the name
      std::vector<float> v(size_t(t.numel()));
      const uint64_t key = std::hash<std::string>{}(name);
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * float(int(philox_element(key, 0, i) % 200) - 100);
      t = Tensor::from_floats(v, t.shape());
    }
    state = model_state_dict(model);
    state.merge(buffers);
    load_model_state_dict(model, state, "test");
    hf = megatron_to_hf(info, state);
    config = hf_config_from_megatron(info.config);
  }
};

TEST(HFDeepSeekV3, MtpLayersExportAndImportBitExact) {
  const MtpModel m;
  const int L = m.info.config.num_layers;
  EXPECT_EQ(m.config.at("num_nextn_predict_layers"), 1);
  EXPECT_EQ(m.state.count("mtp.layers.0.transformer_layer.mlp.router.expert_bias"), 1u);
  // HF's layout of depth 0: its own tensors, the decoder layer's, and copies of the shared ones.
  const std::string p = "model.layers." + std::to_string(L) + ".";
  for (const char* n : {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                        "embed_tokens.weight", "shared_head.head.weight", "self_attn.kv_b_proj.weight",
                        "mlp.gate.e_score_correction_bias", "mlp.experts.0.up_proj.weight",
                        "mlp.shared_experts.down_proj.weight", "post_attention_layernorm.weight"})
    EXPECT_EQ(m.hf.count(p + n), 1u) << p + n;
  EXPECT_TRUE(bit_equal(m.hf.at(p + "embed_tokens.weight"), m.hf.at("model.embed_tokens.weight")));
  EXPECT_TRUE(bit_equal(m.hf.at(p + "shared_head.head.weight"), m.hf.at("lm_head.weight")));
  EXPECT_TRUE(bit_equal(m.hf.at(p + "eh_proj.weight"), m.state.at("mtp.layers.0.eh_proj.weight")));
  EXPECT_TRUE(bit_equal(m.hf.at(p + "shared_head.norm.weight"), m.state.at("mtp.layers.0.final_layernorm.weight")));
  // Written to a folder and read back: the config says 1 depth, and every tensor comes back bit-exact.
  TempFolder folder("hf_deepseek_mtp", m.config, m.hf);
  HFFolder hf(folder.dir.string());
  const HFModelInfo back = config_from_hf(hf, 1);
  ASSERT_EQ(back.config.mtp_num_layers, 1);
  std::set<std::string> read;
  const TensorMap state = hf_to_megatron(back, [&](const std::string& n) {
    read.insert(n);
    return hf.get(n);
  });
  EXPECT_EQ(read.size(), hf.tensor_names().size()) << "every HF tensor is read";
  ASSERT_EQ(state.size(), m.state.size());
  for (const auto& [name, t] : m.state) {
    ASSERT_TRUE(state.count(name)) << name;
    EXPECT_TRUE(bit_equal(state.at(name), t)) << name;
  }
  // And exported again: the same HF tensors.
  const TensorMap again = megatron_to_hf(back, state);
  ASSERT_EQ(again.size(), m.hf.size());
  for (const auto& [name, t] : m.hf) EXPECT_TRUE(again.count(name) && bit_equal(again.at(name), t)) << name;
  GPTModel model(back.config);
  EXPECT_NO_THROW(load_model_state_dict(model, state, folder.dir.string()));
}

// A folder transformers wrote (the fixture: num_nextn_predict_layers 1, no MTP weights) imports
// without MTP; the config alone says 1.
TEST(HFDeepSeekV3, FolderWithoutMtpWeightsImportsWithoutMtp) {
  HFFolder folder(folder_dir());
  EXPECT_EQ(folder.config().at("num_nextn_predict_layers"), 1);
  EXPECT_EQ(config_from_hf(folder.config(), 1).config.mtp_num_layers, 1);
  EXPECT_EQ(config_from_hf(folder, 1).config.mtp_num_layers, 0);
}

TEST(HFDeepSeekV3, BadMtpFoldersAreRefusedInOneLine) {
  const MtpModel m;
  const std::string p = "model.layers." + std::to_string(m.info.config.num_layers) + ".";
  auto import_error = [](const nlohmann::json& config, const TensorMap& tensors) {
    TempFolder folder("hf_deepseek_mtp_bad", config, tensors);
    HFFolder hf(folder.dir.string());
    return testing::error_of([&] {
      const HFModelInfo info = config_from_hf(hf, 1);
      hf_to_megatron(info, [&](const std::string& n) { return hf.get(n); });
    });
  };
  std::vector<std::pair<std::string, std::string>> errors;
  {  // an MTP embedding that is not the model's
    TensorMap t = m.hf;
    Tensor e = t.at(p + "embed_tokens.weight").clone();
    e.data<float>()[3] += 1.0f;
    t[p + "embed_tokens.weight"] = e;
    errors.push_back({import_error(m.config, t), "embed_tokens.weight differs from model.embed_tokens.weight"});
  }
  {  // a head that is not the model's lm_head
    TensorMap t = m.hf;
    Tensor h = t.at(p + "shared_head.head.weight").clone();
    h.data<float>()[0] = -h.data<float>()[0] + 1.0f;
    t[p + "shared_head.head.weight"] = h;
    errors.push_back({import_error(m.config, t), "shared_head.head.weight differs from lm_head.weight"});
  }
  {  // two depths in the config, one in the folder
    nlohmann::json c = m.config;
    c["num_nextn_predict_layers"] = 2;
    errors.push_back({import_error(c, m.hf), "holds the eh_proj of 1 of its num_nextn_predict_layers 2"});
  }
  {  // a dense last decoder layer: HF's MTP layer would be MoE, Megatron's dense
    nlohmann::json c = m.config;
    c["first_k_dense_replace"] = c["num_hidden_layers"];
    errors.push_back({import_error(c, m.hf), "with a dense last decoder layer is not supported"});
  }
  for (const auto& [e, want] : errors) {
    EXPECT_NE(e.find(want), std::string::npos) << "expected '" << want << "', got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

std::string import_error(const std::function<void(nlohmann::json&)>& change) {
  nlohmann::json j = HFFolder(folder_dir()).config();
  change(j);
  try {
    config_from_hf(j, 1);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(HFDeepSeekV3, UnsupportedConfigsAreRefusedInOneLine) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "longrope"; }, "longrope"},
      {[](nlohmann::json& j) { j["attention_bias"] = true; }, "attention_bias"},
      {[](nlohmann::json& j) { j["norm_topk_prob"] = false; }, "norm_topk_prob"},
      {[](nlohmann::json& j) { j["num_key_value_heads"] = 2; }, "num_key_value_heads"},
      {[](nlohmann::json& j) { j["qk_rope_head_dim"] = 7; }, "--qk-pos-emb-head-dim"},
      {[](nlohmann::json& j) { j["topk_method"] = "greedy"; }, "topk_method"},
      {[](nlohmann::json& j) { j["rms_norm_eps"] = 1e-5; }, "rms_norm_eps"},
  };
  for (const auto& [change, word] : cases) {
    const std::string e = import_error(change);
    EXPECT_NE(e.find(word), std::string::npos) << "expected an error naming " << word << ", got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace megatron
