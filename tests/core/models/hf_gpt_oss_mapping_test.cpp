// HF GPT-OSS (Note [HF GPT-OSS] in hf_gpt_oss.h): what config_from_hf makes of the gpt_oss fixture's
// config (sinks, the window pattern of layer_types, YaRN with truncate false, the clamped SwiGLU as
// quick-GeGLU, biases), the exact tensor round trip (the interleaved gate/up columns included), the
// exported config reading back as the same model, and the one-line refusals.
#include <gtest/gtest.h>

#include "megatron/core/models/gpt/hf_mapping.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

const std::string kModel = "gpt_oss";

nlohmann::json fixture_config() { return HFFolder(testing::arch_fixtures_dir() + "/" + kModel).config(); }

void expect_one_line_error(const nlohmann::json& j, const std::string& needle) {
  testing::expect_one_line_error([&] { config_from_hf(j); }, needle);
}

TEST(HFGptOssConfig, FixtureConfig) {
  const HFModelInfo info = config_from_hf(fixture_config());
  const TransformerConfig& c = info.config;
  EXPECT_EQ(info.family, HFFamily::GptOss);
  EXPECT_EQ(c.softmax_type, "learnable");
  EXPECT_EQ(c.window_size_left, 7);  // sliding_window 8: keys i-7..i
  EXPECT_EQ(c.window_attn_pattern, std::vector<int>({1, 0, 1}));
  EXPECT_EQ(c.layer_window_left(1), -1);
  EXPECT_EQ(c.activation, "quick_geglu");
  EXPECT_EQ(c.glu_linear_offset, 1.0f);
  EXPECT_EQ(c.activation_func_clamp_value, 7.0f);
  EXPECT_TRUE(c.add_bias_linear);
  EXPECT_TRUE(c.use_yarn());
  EXPECT_FALSE(c.yarn_correction_range_round_to_int);  // truncate false
  EXPECT_EQ(c.yarn_rotary_scaling_factor, 4.0f);
  EXPECT_EQ(c.num_moe_experts, 4);
  EXPECT_EQ(c.moe_router_topk, 2);
  EXPECT_EQ(c.moe_layer_pattern, std::vector<int>({1, 1, 1}));
  EXPECT_FALSE(c.moe_router_pre_softmax);
  EXPECT_EQ(c.num_query_groups, 2);
  EXPECT_EQ(c.kv_channels, 16);
}

TEST(HFGptOssMapping, RoundTripIsExact) {
  HFFolder folder(testing::arch_fixtures_dir() + "/" + kModel);
  const HFModelInfo info = config_from_hf(folder.config());
  const TensorMap ours = hf_to_megatron(info, [&](const std::string& n) { return folder.get(n); });
  const int64_t f = info.config.moe_ffn_hidden_size, h = info.config.hidden_size;
  ASSERT_TRUE(ours.count("decoder.layers.0.self_attention.core_attention.softmax_offset"));
  ASSERT_TRUE(ours.count("decoder.layers.2.mlp.router.bias"));
  const Tensor fc1 = ours.at("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight");
  EXPECT_EQ(fc1.shape(), (Shape{2 * f, h}));
  // [gate; up]: our row r < f is HF's column 2r of gate_up_proj[1], row f + r its column 2r + 1.
  const Tensor gate_up = folder.get("model.layers.0.mlp.experts.gate_up_proj");  // [E, h, 2f]
  const std::vector<float> g = gate_up.to_floats(), ours_fc1 = fc1.to_floats();
  for (int64_t col : {int64_t(0), int64_t(3)}) {
    EXPECT_EQ(ours_fc1[size_t(col * h + 2)], g[size_t((1 * h + 2) * 2 * f + 2 * col)]);            // gate, input 2
    EXPECT_EQ(ours_fc1[size_t((f + col) * h + 5)], g[size_t((1 * h + 5) * 2 * f + 2 * col + 1)]);  // up, input 5
  }
  TensorMap back = megatron_to_hf(info, ours);
  EXPECT_EQ(back.size(), folder.tensor_names().size());
  for (const std::string& n : folder.tensor_names()) {
    ASSERT_TRUE(back.count(n)) << n;
    EXPECT_EQ(back[n].shape(), folder.get(n).shape()) << n;
    EXPECT_EQ(back[n].to_floats(), folder.get(n).to_floats()) << n;
  }
}

TEST(HFGptOssConfig, ExportedConfigReadsBackAsTheSameModel) {
  const TransformerConfig c = config_from_hf(fixture_config()).config;
  const nlohmann::json exported = hf_config_from_megatron(c);
  EXPECT_EQ(exported.at("model_type"), "gpt_oss");
  EXPECT_EQ(exported.at("sliding_window"), 8);
  EXPECT_EQ(exported.at("layer_types"),
            nlohmann::json({"sliding_attention", "full_attention", "sliding_attention"}));
  const TransformerConfig again = config_from_hf(exported).config;
  EXPECT_EQ(again.window_size_left, c.window_size_left);
  EXPECT_EQ(again.window_attn_pattern, c.window_attn_pattern);
  EXPECT_EQ(again.softmax_type, c.softmax_type);
  EXPECT_EQ(again.activation, c.activation);
  EXPECT_EQ(again.activation_func_clamp_value, c.activation_func_clamp_value);
  EXPECT_EQ(again.glu_linear_offset, c.glu_linear_offset);
  EXPECT_EQ(again.yarn_rotary_scaling_factor, c.yarn_rotary_scaling_factor);
  EXPECT_EQ(again.yarn_correction_range_round_to_int, c.yarn_correction_range_round_to_int);
  EXPECT_EQ(again.yarn_original_max_position_embeddings, c.yarn_original_max_position_embeddings);
  EXPECT_EQ(again.rotary_base, c.rotary_base);
  EXPECT_EQ(again.num_moe_experts, c.num_moe_experts);
  EXPECT_EQ(again.moe_ffn_hidden_size, c.moe_ffn_hidden_size);
  EXPECT_EQ(again.num_query_groups, c.num_query_groups);
  EXPECT_EQ(again.kv_channels, c.kv_channels);
  EXPECT_EQ(again.share_embeddings_and_output_weights, c.share_embeddings_and_output_weights);
  // Every layer windowed: no layer_types entry is full; none windowed: sliding_window is not read.
  TransformerConfig all = c;
  all.window_attn_skip_freq.clear();
  all.finalize();
  EXPECT_EQ(config_from_hf(hf_config_from_megatron(all)).config.window_attn_pattern, std::vector<int>({1, 1, 1}));
  TransformerConfig none = c;
  none.window_attn_skip_freq.clear();
  none.window_size_left = -1;
  none.finalize();
  EXPECT_EQ(config_from_hf(hf_config_from_megatron(none)).config.window_size_left, -1);
  // What gpt_oss cannot hold is refused in one line.
  TransformerConfig vanilla = c;
  vanilla.softmax_type = "vanilla";
  vanilla.finalize();
  const std::string e = testing::error_of([&] { hf_config_from_megatron(vanilla); });
  EXPECT_NE(e.find("--softmax-type learnable"), std::string::npos) << e;
}

TEST(HFGptOssConfig, UnsupportedOptionsAreOneLine) {
  nlohmann::json j = fixture_config();
  j["swiglu_alpha"] = 1.5;
  expect_one_line_error(j, "swiglu_alpha");
  j = fixture_config();
  j["attention_bias"] = false;
  expect_one_line_error(j, "attention_bias");
  j = fixture_config();
  j["layer_types"] = {"sliding_attention", "chunked_attention", "full_attention"};
  expect_one_line_error(j, "chunked_attention");
  j = fixture_config();
  j["layer_types"] = {"sliding_attention"};
  expect_one_line_error(j, "layer_types");
  // HF's default layer_types: sliding on even layers.
  j = fixture_config();
  j.erase("layer_types");
  EXPECT_EQ(config_from_hf(j).config.window_attn_pattern, std::vector<int>({1, 0, 1}));
}

}  // namespace
}  // namespace megatron
