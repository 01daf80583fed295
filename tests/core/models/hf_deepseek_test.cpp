// HF DeepSeek-V3 <-> Megatron-Core (Note [HF DeepSeek-V3] in hf_deepseek.h): the fixture's folder
// imported and exported back is exact, tensor for tensor (Note [Importing DeepSeek's interleaved
// RoPE]: the rope rows are permuted there and back), through a GPTModel too (the expert bias is a model
// buffer); the config round trip; and the one-line refusals of what the import does not support.
#include <gtest/gtest.h>

#include "megatron/core/models/gpt/hf_mapping.h"
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
  const HFModelInfo info = config_from_hf(folder.config(), 1);
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
  const HFModelInfo info = config_from_hf(folder.config(), 1);
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
