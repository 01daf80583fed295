// HF config.json <-> TransformerConfig for RoPE scaling and sliding windows (hf_rope.h, Note [HF
// RoPE scaling]): llama3 and yarn in transformers 4's rope_scaling and 5's rope_parameters forms,
// every other type refused in one line naming it, the attention factor's cases, the exact round trip
// through hf_config_from_megatron, and which sliding windows are refused.
#include "megatron/core/models/gpt/hf_rope.h"

#include <gtest/gtest.h>

#include <cmath>

#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::error_of;

nlohmann::json llama(const std::string& model_type = "llama") {
  return {{"model_type", model_type}, {"num_hidden_layers", 4},
          {"hidden_size", 64},        {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 16},
          {"intermediate_size", 128}, {"max_position_embeddings", 131072},
          {"vocab_size", 100},        {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},   {"tie_word_embeddings", false}};
}

const nlohmann::json kLlama31Scaling = {{"rope_type", "llama3"},
                                        {"factor", 8.0},
                                        {"low_freq_factor", 1.0},
                                        {"high_freq_factor", 4.0},
                                        {"original_max_position_embeddings", 8192}};

// One line, containing `needle`.
void expect_refused(const nlohmann::json& j, const std::string& needle) {
  const std::string e = error_of([&] { config_from_hf(j); });
  EXPECT_NE(e.find(needle), std::string::npos) << "got: " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
}

// config_from_hf(hf_config_from_megatron(c)) gives c's position fields back.
void expect_round_trip(const TransformerConfig& c) {
  const nlohmann::json exported = hf_config_from_megatron(c);
  const TransformerConfig back = config_from_hf(exported).config;
  EXPECT_EQ(back.position_embedding_type, c.position_embedding_type) << exported.dump();
  EXPECT_EQ(back.rotary_base, c.rotary_base);
  EXPECT_EQ(back.rotary_percent, c.rotary_percent);
  EXPECT_EQ(back.rope_scaling, c.rope_scaling);
  EXPECT_EQ(back.rope_scaling_factor, c.rope_scaling_factor);
  if (c.use_yarn()) {
    EXPECT_EQ(back.yarn_rotary_scaling_factor, c.yarn_rotary_scaling_factor);
    EXPECT_EQ(back.yarn_original_max_position_embeddings, c.yarn_original_max_position_embeddings);
    EXPECT_EQ(back.yarn_beta_fast, c.yarn_beta_fast);
    EXPECT_EQ(back.yarn_beta_slow, c.yarn_beta_slow);
    EXPECT_EQ(back.yarn_mscale, c.yarn_mscale);
    EXPECT_EQ(back.yarn_mscale_all_dim, c.yarn_mscale_all_dim);
    EXPECT_EQ(back.yarn_correction_range_round_to_int, c.yarn_correction_range_round_to_int);
  }
  EXPECT_EQ(hf_config_from_megatron(back), exported) << "a second round trip writes the same config";
}

TEST(HFRopeScaling, Llama3BothSpellings) {
  nlohmann::json v4 = llama();
  v4["rope_scaling"] = kLlama31Scaling;
  nlohmann::json v5 = llama();
  v5.erase("rope_theta");
  v5["rope_parameters"] = kLlama31Scaling;
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  v5["rope_parameters"]["factor"] = 32.0;  // Llama 3.2
  nlohmann::json old_key = llama();
  old_key["rope_scaling"] = kLlama31Scaling;
  old_key["rope_scaling"].erase("rope_type");
  old_key["rope_scaling"]["type"] = "llama3";
  for (const auto& [j, factor] : {std::pair{v4, 8.0f}, std::pair{v5, 32.0f}, std::pair{old_key, 8.0f}}) {
    const TransformerConfig c = config_from_hf(j).config;
    EXPECT_EQ(c.position_embedding_type, "rope");
    EXPECT_TRUE(c.rope_scaling);
    EXPECT_EQ(c.rope_scaling_factor, factor);
    EXPECT_EQ(c.rotary_base, 500000.0f);
    expect_round_trip(c);
  }
  const nlohmann::json exported = hf_config_from_megatron(config_from_hf(v4).config);
  EXPECT_EQ(exported.at("rope_scaling"), kLlama31Scaling);
  EXPECT_EQ(exported.at("rope_theta"), 500000.0);
}

TEST(HFRopeScaling, Llama3BandsOtherThanMegatronsAreRefused) {
  nlohmann::json j = llama();
  j["rope_scaling"] = kLlama31Scaling;
  j["rope_scaling"]["low_freq_factor"] = 2.0;
  expect_refused(j,
                 "rope_scaling llama3 with low_freq_factor 2, high_freq_factor 4, original_max_position_embeddings "
                 "8192: only Megatron's 1, 4 and 8192");
  j["rope_scaling"] = kLlama31Scaling;
  j["rope_scaling"]["original_max_position_embeddings"] = 4096;
  expect_refused(j, "original_max_position_embeddings 4096");
}

TEST(HFRopeScaling, NoScalingAsBefore) {
  for (const nlohmann::json& rope : {nlohmann::json(nullptr), nlohmann::json::object(),
                                     nlohmann::json{{"rope_type", "default"}, {"rope_theta", 1e6}}}) {
    nlohmann::json j = llama("qwen3");
    j["rope_parameters"] = rope;
    j["rope_scaling"] = nullptr;
    const TransformerConfig c = config_from_hf(j).config;
    EXPECT_EQ(c.position_embedding_type, "rope");
    EXPECT_FALSE(c.rope_scaling);
    EXPECT_EQ(c.rotary_base, rope.is_object() && rope.contains("rope_theta") ? 1e6f : 500000.0f);
    EXPECT_FALSE(hf_config_from_megatron(c).contains("rope_scaling"));
  }
}

TEST(HFRopeScaling, OtherTypesAreRefusedByName) {
  for (const char* type : {"linear", "dynamic", "longrope", "proportional"}) {
    nlohmann::json j = llama("mistral");
    j["sliding_window"] = nullptr;
    j["rope_scaling"] = {{"rope_type", type}, {"factor", 2.0}};
    expect_refused(j, fmt::format("rope_scaling type '{}' is not supported: only llama3", type));
  }
  nlohmann::json j = llama();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};  // transformers 4's older key
  expect_refused(j, "rope_scaling type 'linear' is not supported");
}

TEST(HFRopeScaling, YarnOfQwen) {
  // Qwen3's recommended long-context setting, in both spellings.
  const nlohmann::json scaling = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  nlohmann::json v4 = llama("qwen3");
  v4["max_position_embeddings"] = 131072;
  v4["rope_theta"] = 1000000.0;
  v4["rope_scaling"] = scaling;
  nlohmann::json qwen2 = llama("qwen2");
  qwen2["rope_theta"] = 1000000.0;
  qwen2["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  for (const nlohmann::json& j : {v4, qwen2}) {
    const TransformerConfig c = config_from_hf(j).config;
    EXPECT_EQ(c.position_embedding_type, "yarn");
    EXPECT_TRUE(c.use_rope() && c.use_yarn());
    EXPECT_EQ(c.rotary_base, 1e6f);
    EXPECT_EQ(c.yarn_rotary_scaling_factor, 4.0f);
    EXPECT_EQ(c.yarn_original_max_position_embeddings, 32768);
    EXPECT_EQ(c.yarn_beta_fast, 32.0f);
    EXPECT_EQ(c.yarn_beta_slow, 1.0f);
    EXPECT_EQ(c.yarn_mscale, 1.0f);
    EXPECT_EQ(c.yarn_mscale_all_dim, 0.0f);
    EXPECT_TRUE(c.yarn_correction_range_round_to_int);
    EXPECT_FLOAT_EQ(rotary_attention_scale(c), float(0.1 * std::log(4.0) + 1));  // HF's default attention factor
    expect_round_trip(c);
  }
  // rope_scaling beside transformers 5's rope_parameters: the scaling from the first, theta from the second.
  nlohmann::json both = llama("qwen3");
  both.erase("rope_theta");
  both["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  both["rope_scaling"] = scaling;
  const TransformerConfig from_both = config_from_hf(both).config;
  EXPECT_EQ(from_both.rotary_base, 1e6f);
  EXPECT_TRUE(from_both.use_yarn());
  // Without original_max_position_embeddings: max_position_embeddings (transformers 5's default).
  nlohmann::json bare = v4;
  bare["rope_scaling"].erase("original_max_position_embeddings");
  EXPECT_EQ(config_from_hf(bare).config.yarn_original_max_position_embeddings, 131072);
}

TEST(HFRopeScaling, YarnOptions) {
  // gpt-oss's: truncate false, betas given.
  nlohmann::json j = llama("qwen2");
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 32.0},   {"original_max_position_embeddings", 4096},
                       {"beta_fast", 16.0},   {"beta_slow", 2.0}, {"truncate", false}};
  TransformerConfig c = config_from_hf(j).config;
  EXPECT_FALSE(c.yarn_correction_range_round_to_int);
  EXPECT_EQ(c.yarn_beta_fast, 16.0f);
  EXPECT_EQ(c.yarn_beta_slow, 2.0f);
  expect_round_trip(c);
  EXPECT_EQ(hf_config_from_megatron(c).at("rope_scaling").at("truncate"), false);

  // DeepSeek's mscale and mscale_all_dim (both non-zero): HF's ratio is Megatron's.
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 40.0},
                       {"original_max_position_embeddings", 4096},
                       {"mscale", 0.707},
                       {"mscale_all_dim", 1.0}};
  c = config_from_hf(j).config;
  EXPECT_EQ(c.yarn_mscale, 0.707f);
  EXPECT_EQ(c.yarn_mscale_all_dim, 1.0f);
  EXPECT_FLOAT_EQ(rotary_attention_scale(c), float((0.0707 * std::log(40.0) + 1) / (0.1 * std::log(40.0) + 1)));
  expect_round_trip(c);

  // mscale alone: HF ignores it (attention factor mscale(factor) = 0.1 ln f + 1), so does the import.
  j["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096}, {"mscale", 0.707}};
  c = config_from_hf(j).config;
  EXPECT_EQ(c.yarn_mscale, 1.0f);
  EXPECT_EQ(c.yarn_mscale_all_dim, 0.0f);

  // An explicit attention_factor: accepted when it is Megatron's ratio, refused otherwise.
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"original_max_position_embeddings", 4096},
                       {"attention_factor", 0.1 * std::log(4.0) + 1}};
  EXPECT_FLOAT_EQ(rotary_attention_scale(config_from_hf(j).config), float(0.1 * std::log(4.0) + 1));
  j["rope_scaling"]["attention_factor"] = 1.0;
  expect_refused(j, "rope_scaling yarn attention_factor 1 is not YaRN's");

  // A Megatron setting HF cannot compute from mscale (--mscale 0.5 alone) exports its attention_factor.
  c.yarn_mscale = 0.5f;
  c.yarn_mscale_all_dim = 0.0f;
  const nlohmann::json exported = hf_config_from_megatron(c).at("rope_scaling");
  EXPECT_NEAR(exported.at("attention_factor").get<double>(), 0.05 * std::log(40.0) + 1, 1e-7);
  expect_round_trip(c);

  // YaRN needs every channel rotated.
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  j["partial_rotary_factor"] = 0.5;
  expect_refused(j, "rope_scaling yarn with partial_rotary_factor 0.5");
}

TEST(HFRopeScaling, PartialRotaryFactorIsRead) {
  nlohmann::json j = llama();
  j["partial_rotary_factor"] = 0.5;
  TransformerConfig c = config_from_hf(j).config;
  EXPECT_EQ(c.rotary_percent, 0.5f);
  // HF's Llama-type models rotate every channel when they run, so the export refuses it (one line).
  c.finalize();
  try {
    hf_config_from_megatron(c);
    ADD_FAILURE() << "--rotary-percent 0.5 was exported as a Llama-type model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--rotary-percent 0.5 has no HuggingFace export"), std::string::npos)
        << e.what();
  }
}

TEST(HFSlidingWindow, ActiveWindowsAreRefusedOthersAccepted) {
  // Mistral v0.1: a 4096 window over 32768 positions.
  nlohmann::json mistral = llama("mistral");
  mistral["max_position_embeddings"] = 32768;
  mistral["sliding_window"] = 4096;
  expect_refused(mistral,
                 "mistral config.json has sliding_window 4096 (below max_position_embeddings 32768) on 4 of its 4 "
                 "layers: sliding-window attention is not supported");
  nlohmann::json mixtral = mistral;
  mixtral["model_type"] = "mixtral";
  mixtral["num_local_experts"] = 4;
  mixtral["num_experts_per_tok"] = 2;
  expect_refused(mixtral, "mixtral config.json has sliding_window 4096 (below");
  mistral["sliding_window"] = nullptr;  // v0.2 on
  EXPECT_NO_THROW(config_from_hf(mistral));
  mistral["sliding_window"] = 32768;  // never reached
  EXPECT_NO_THROW(config_from_hf(mistral));
  mistral.erase("sliding_window");  // MistralConfig's default, 4096
  expect_refused(mistral, "has sliding_window 4096");
  mixtral["sliding_window"] = nullptr;
  EXPECT_NO_THROW(config_from_hf(mixtral));

  // Qwen2: the window counts only with use_sliding_window, on the layers from max_window_layers on.
  nlohmann::json qwen = llama("qwen2");
  qwen["max_position_embeddings"] = 32768;
  qwen["sliding_window"] = 4096;
  qwen["max_window_layers"] = 2;
  qwen["use_sliding_window"] = false;  // Qwen2.5's files
  EXPECT_NO_THROW(config_from_hf(qwen));
  qwen["use_sliding_window"] = true;
  expect_refused(qwen,
                 "qwen2 config.json has sliding_window 4096 with use_sliding_window true (below "
                 "max_position_embeddings 32768) on 2 of its 4 layers");
  qwen["max_window_layers"] = 4;  // no layer slides
  EXPECT_NO_THROW(config_from_hf(qwen));
  qwen["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "full_attention"};
  expect_refused(qwen, "on 1 of its 4 layers");
  qwen["sliding_window"] = 32768;
  EXPECT_NO_THROW(config_from_hf(qwen));
  qwen["layer_types"] = {"full_attention", "chunked_attention", "full_attention", "full_attention"};
  expect_refused(qwen, "layer_types '\"chunked_attention\"' is not supported");
}

}  // namespace
}  // namespace megatron
