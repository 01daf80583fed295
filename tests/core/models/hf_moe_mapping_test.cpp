// HF mixture-of-experts configs and tensors (Note [HF mixture of experts] in hf_mapping.h): what
// config_from_hf makes of the Mixtral, Qwen2-MoE and Qwen3-MoE fixture configs and of Qwen's layer
// placement options, the one-line refusals, the exact tensor round trip of every fixture folder,
// and the HF config written for a model trained here reading back as the same model.
#include <gtest/gtest.h>

#include "megatron/core/models/gpt/hf_mapping.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

nlohmann::json fixture_config(const std::string& model) {
  return HFFolder(testing::moe_fixtures_dir() + "/" + model).config();
}

void expect_one_line_error(const nlohmann::json& j, const std::string& needle) {
  testing::expect_one_line_error([&] { config_from_hf(j); }, needle);
}

TEST(HFMoEConfig, FixtureConfigs) {
  if (testing::moe_model_fixtures().empty()) GTEST_SKIP() << "no MoE fixtures in " << testing::moe_fixtures_dir();
  const TransformerConfig mixtral = config_from_hf(fixture_config("mixtral")).config;
  EXPECT_EQ(mixtral.num_moe_experts, 4);
  EXPECT_EQ(mixtral.moe_router_topk, 2);
  EXPECT_FALSE(mixtral.moe_router_pre_softmax);
  EXPECT_EQ(mixtral.moe_ffn_hidden_size, 48);
  EXPECT_EQ(mixtral.moe_layer_pattern, (std::vector<int>{1, 1}));
  EXPECT_EQ(mixtral.moe_shared_expert_intermediate_size, 0);

  const TransformerConfig qwen2 = config_from_hf(fixture_config("qwen2_moe")).config;
  EXPECT_TRUE(qwen2.moe_router_pre_softmax) << "norm_topk_prob false";
  EXPECT_EQ(qwen2.moe_shared_expert_intermediate_size, 96);
  EXPECT_TRUE(qwen2.moe_shared_expert_gate);
  EXPECT_TRUE(qwen2.add_qkv_bias);
  EXPECT_EQ(qwen2.moe_ffn_hidden_size, 48);

  const TransformerConfig qwen3 = config_from_hf(fixture_config("qwen3_moe")).config;
  EXPECT_EQ(qwen3.num_moe_experts, 8);
  EXPECT_FALSE(qwen3.moe_router_pre_softmax) << "norm_topk_prob true";
  EXPECT_TRUE(qwen3.qk_layernorm);
  EXPECT_EQ(qwen3.moe_layer_pattern, (std::vector<int>{0, 1})) << "mlp_only_layers [0]";
  EXPECT_EQ(qwen3.ffn_hidden_size, 96);
  EXPECT_EQ(qwen3.moe_ffn_hidden_size, 48);
}

nlohmann::json small_qwen_moe(const std::string& type) {
  return {{"model_type", type},    {"hidden_size", 32},          {"num_hidden_layers", 4},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"intermediate_size", 64},
          {"moe_intermediate_size", 16}, {"num_experts", 4},      {"num_experts_per_tok", 2},
          {"vocab_size", 64},      {"max_position_embeddings", 32}};
}

// Qwen's placement: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
TEST(HFMoEConfig, QwenLayerPlacement) {
  nlohmann::json j = small_qwen_moe("qwen3_moe");
  j["decoder_sparse_step"] = 2;
  EXPECT_EQ(config_from_hf(j).config.moe_layer_pattern, (std::vector<int>{0, 1, 0, 1}));
  j["mlp_only_layers"] = {3};
  EXPECT_EQ(config_from_hf(j).config.moe_layer_pattern, (std::vector<int>{0, 1, 0, 0}));
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = nlohmann::json::array();
  EXPECT_EQ(config_from_hf(j).config.moe_layer_freq, "1");
}

TEST(HFMoEConfig, UnsupportedOptionsAreOneLine) {
  nlohmann::json mixtral = small_qwen_moe("mixtral");
  mixtral.erase("num_experts");
  mixtral["num_local_experts"] = 4;
  mixtral["router_jitter_noise"] = 0.1;
  expect_one_line_error(mixtral, "router_jitter_noise");
  mixtral["router_jitter_noise"] = 0.0;
  mixtral["sliding_window"] = 16;  // below max_position_embeddings 32 (a window of 32 or more never applies)
  expect_one_line_error(mixtral, "sliding_window");
  nlohmann::json qwen = small_qwen_moe("qwen2_moe");
  qwen["use_sliding_window"] = true;
  qwen["sliding_window"] = 16;
  expect_one_line_error(qwen, "use_sliding_window");
  qwen = small_qwen_moe("qwen3_moe");
  qwen["num_local_experts"] = 8;
  expect_one_line_error(qwen, "must agree");
  qwen.erase("num_local_experts");
  qwen.erase("moe_intermediate_size");
  expect_one_line_error(qwen, "moe_intermediate_size");
  qwen = small_qwen_moe("qwen3_moe");
  qwen["rope_scaling"] = {{"type", "yarn"}};
  expect_one_line_error(qwen, "rope_scaling");
}

// The HF aux loss is Megatron's only when HF trains with it (output_router_logits).
TEST(HFMoEConfig, AuxLossFollowsOutputRouterLogits) {
  nlohmann::json j = small_qwen_moe("qwen3_moe");
  j["router_aux_loss_coef"] = 0.001;
  EXPECT_EQ(config_from_hf(j).config.moe_aux_loss_coeff, (std::vector<float>{0.0f}));
  j["output_router_logits"] = true;
  EXPECT_EQ(config_from_hf(j).config.moe_aux_loss_coeff, (std::vector<float>{0.001f}));
}

TEST(HFMoEMapping, RoundTripOfEveryFixtureIsExact) {
  const std::vector<std::string> models = testing::moe_model_fixtures();
  if (models.empty()) GTEST_SKIP() << "no MoE fixtures in " << testing::moe_fixtures_dir();
  for (const std::string& model : models) {
    HFFolder folder(testing::moe_fixtures_dir() + "/" + model);
    const HFModelInfo info = config_from_hf(folder.config());
    const TensorMap ours = hf_to_megatron(info, [&](const std::string& n) { return folder.get(n); });
    const std::string router = "decoder.layers.1.mlp.router.weight";
    ASSERT_TRUE(ours.count(router)) << model;
    EXPECT_EQ(ours.at(router).shape(), (Shape{info.config.num_moe_experts, info.config.hidden_size}));
    const std::string last_expert =
        fmt::format("decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight", info.config.num_moe_experts - 1);
    ASSERT_TRUE(ours.count(last_expert)) << model;
    EXPECT_EQ(ours.at(last_expert).shape(), (Shape{2 * info.config.moe_ffn_hidden_size, info.config.hidden_size}));
    TensorMap back = megatron_to_hf(info, ours);
    EXPECT_EQ(back.size(), folder.tensor_names().size()) << model;
    for (const std::string& n : folder.tensor_names()) {
      ASSERT_TRUE(back.count(n)) << model << ": " << n;
      EXPECT_EQ(back[n].to_floats(), folder.get(n).to_floats()) << n;
    }
  }
}

// A model trained here exports as the HF type whose options it has, and reads back as itself.
TEST(HFMoEConfig, ExportedConfigReadsBackAsTheSameModel) {
  const std::vector<std::string> models = testing::moe_model_fixtures();
  if (models.empty()) GTEST_SKIP() << "no MoE fixtures in " << testing::moe_fixtures_dir();
  for (const std::string& model : models) {
    const TransformerConfig c = config_from_hf(fixture_config(model)).config;
    const nlohmann::json exported = hf_config_from_megatron(c);
    EXPECT_EQ(exported.at("model_type"), model);
    const TransformerConfig again = config_from_hf(exported).config;
    EXPECT_EQ(again.num_moe_experts, c.num_moe_experts) << model;
    EXPECT_EQ(again.moe_layer_pattern, c.moe_layer_pattern) << model;
    EXPECT_EQ(again.moe_router_topk, c.moe_router_topk) << model;
    EXPECT_EQ(again.moe_router_pre_softmax, c.moe_router_pre_softmax) << model;
    EXPECT_EQ(again.moe_ffn_hidden_size, c.moe_ffn_hidden_size) << model;
    EXPECT_EQ(again.ffn_hidden_size, c.ffn_hidden_size) << model;
    EXPECT_EQ(again.moe_shared_expert_intermediate_size, c.moe_shared_expert_intermediate_size) << model;
    EXPECT_EQ(again.moe_shared_expert_gate, c.moe_shared_expert_gate) << model;
    EXPECT_EQ(again.qk_layernorm, c.qk_layernorm) << model;
    EXPECT_EQ(again.add_qkv_bias, c.add_qkv_bias) << model;
    EXPECT_EQ(again.kv_channels, c.kv_channels) << model;
  }
  TransformerConfig sigmoid = config_from_hf(small_qwen_moe("qwen3_moe")).config;
  sigmoid.moe_router_score_function = "sigmoid";
  const std::string e = testing::error_of([&] { hf_config_from_megatron(sigmoid); });
  EXPECT_NE(e.find("no HuggingFace equivalent"), std::string::npos) << e;
}

}  // namespace
}  // namespace megatron
