// The model arguments a checkpoint carries (model_arguments.inc): the keys and values written for
// the flags that existed before the table are unchanged (older checkpoints load, newer ones read
// the same), --use-checkpoint-args takes them back, and an identity flag (--qk-layernorm here)
// that differs between the checkpoint and the run refuses the load with one line.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/training/arguments.h"
#include "megatron/training/checkpointing.h"
#include "tests/test_util.h"
#include "tests/training/parse_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

using testing::parse;

std::vector<std::string> concat_flags(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<std::string> llama_flags() {
  return {"--num-layers",
          "2",
          "--hidden-size",
          "32",
          "--num-attention-heads",
          "4",
          "--group-query-attention",
          "--num-query-groups",
          "2",
          "--kv-channels",
          "12",
          "--seq-length",
          "16",
          "--max-position-embeddings",
          "16",
          "--swiglu",
          "--normalization",
          "RMSNorm",
          "--norm-epsilon",
          "1e-6",
          "--disable-bias-linear",
          "--position-embedding-type",
          "rope",
          "--rotary-base",
          "500000",
          "--untie-embeddings-and-output-weights",
          "--micro-batch-size",
          "2",
          "--train-iters",
          "1",
          "--lr",
          "1e-3",
          "--mock-data",
          "--vocab-size",
          "40",
          "--make-vocab-size-divisible-by",
          "8",
          "--bf16"};
}

// The checkpoint "args" as written before model_arguments.inc (key for key), plus qk_layernorm.
TEST(CheckpointArgs, KeysAndValuesOfTheEarlierFormatAreUnchanged) {
  Arguments a = parse(llama_flags());
  validate_args(a);
  const nlohmann::json before = {{"num_layers", a.num_layers},
                                 {"hidden_size", a.hidden_size},
                                 {"ffn_hidden_size", a.ffn_hidden_size},
                                 {"num_attention_heads", a.num_attention_heads},
                                 {"kv_channels", a.kv_channels},
                                 {"group_query_attention", a.group_query_attention},
                                 {"num_query_groups", a.num_query_groups},
                                 {"seq_length", a.seq_length},
                                 {"max_position_embeddings", a.max_position_embeddings},
                                 {"make_vocab_size_divisible_by", a.make_vocab_size_divisible_by},
                                 {"untie_embeddings_and_output_weights", a.untie_embeddings_and_output_weights},
                                 {"disable_bias_linear", a.disable_bias_linear},
                                 {"add_qkv_bias", a.add_qkv_bias},
                                 {"normalization", a.normalization},
                                 {"norm_epsilon", a.norm_epsilon},
                                 {"swiglu", a.swiglu},
                                 {"position_embedding_type", a.position_embedding_type},
                                 {"rotary_base", a.rotary_base},
                                 {"rotary_percent", a.rotary_percent},
                                 {"rotary_interleaved", a.rotary_interleaved},
                                 {"apply_layernorm_1p", a.apply_layernorm_1p},
                                 {"vocab_size", a.vocab_size},
                                 {"tokenizer_type", a.tokenizer_type},
                                 {"bf16", a.bf16},
                                 {"fp16", a.fp16}};
  nlohmann::json now = model_args_to_json(a);
  EXPECT_EQ(now.at("qk_layernorm"), false);
  now.erase("qk_layernorm");
  // The MoE rows came later too: a dense run writes their defaults.
  EXPECT_EQ(now.at("num_experts"), 0);
  for (auto it = now.begin(); it != now.end();) {
    it = it.key() == "num_experts" || it.key().rfind("moe_", 0) == 0 ? now.erase(it) : std::next(it);
  }
  // And the RoPE-scaling rows: a run without scaling writes Megatron's defaults.
  const nlohmann::json rope_defaults = {{"use_rope_scaling", false},
                                        {"rope_scaling_factor", 8.0f},
                                        {"rotary_scaling_factor", 1.0f},
                                        {"yarn_original_max_position_embeddings", 4096},
                                        {"yarn_beta_fast", 32.0f},
                                        {"yarn_beta_slow", 1.0f},
                                        {"mscale", 1.0f},
                                        {"mscale_all_dim", 0.0f},
                                        {"yarn_correction_range_round_to_int", true}};
  for (const auto& [key, value] : rope_defaults.items()) {
    EXPECT_EQ(now.at(key), value) << key;
    now.erase(key);
  }
  // And the multi-token-prediction rows: a run without MTP writes Megatron's defaults (None as 0).
  EXPECT_EQ(now.at("mtp_num_layers"), 0);
  EXPECT_EQ(now.at("mtp_loss_scaling_factor"), 0.1f);
  now.erase("mtp_num_layers");
  now.erase("mtp_loss_scaling_factor");
  // And GPT-OSS's rows (sinks, windows, quick-GeGLU): a run without them writes Megatron's defaults.
  const nlohmann::json gpt_oss_defaults = {{"quick_geglu", false},
                                           {"glu_linear_offset", 0.0f},
                                           {"activation_func_clamp_value", 0.0f},
                                           {"softmax_type", "vanilla"},
                                           {"window_size", ""},
                                           {"window_attn_skip_freq", ""}};
  for (const auto& [key, value] : gpt_oss_defaults.items()) {
    EXPECT_EQ(now.at(key), value) << key;
    now.erase(key);
  }
  // And the multi-latent attention rows (with --rope-type, now saved): a run without MLA writes Megatron's defaults.
  const nlohmann::json mla_defaults = {{"multi_latent_attention", false}, {"q_lora_rank", 0},
                                       {"kv_lora_rank", 32},             {"qk_head_dim", 128},
                                       {"qk_pos_emb_head_dim", 64},      {"v_head_dim", 128},
                                       {"rope_type", ""}};
  for (const auto& [key, value] : mla_defaults.items()) {
    EXPECT_EQ(now.at(key), value) << key;
    now.erase(key);
  }
  EXPECT_EQ(now.dump(2), before.dump(2));
  EXPECT_EQ(now.at("norm_epsilon").dump(), nlohmann::json(1e-6f).dump());
}

// The config mapping and its inverse (the converter's) agree on every model flag of a Llama shape.
TEST(CheckpointArgs, ConfigMappingRoundTrips) {
  Arguments a = parse(concat_flags(llama_flags(), {"--qk-layernorm", "--apply-layernorm-1p"}));
  validate_args(a);
  const TransformerConfig c = transformer_config_from_args(a, 40);
  EXPECT_TRUE(c.qk_layernorm);
  EXPECT_TRUE(c.layernorm_zero_centered_gamma);
  EXPECT_EQ(c.num_query_groups, 2);
  EXPECT_EQ(c.activation, "swiglu");
  Arguments back = model_arguments_from_config(c);
  back.vocab_size = a.vocab_size;
  back.tokenizer_type = a.tokenizer_type;
  back.bf16 = a.bf16;
  EXPECT_EQ(model_args_to_json(back), model_args_to_json(a));
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / fmt::format("megatron_{}_{}", name, ::getpid())) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

TEST(CheckpointArgs, QkLayernormIsPartOfTheModelIdentity) {
  TempDir dir("qk_identity");
  Arguments with = parse(concat_flags(llama_flags(), {"--qk-layernorm"}));
  validate_args(with);
  with.bf16 = false;
  GPTModel saved_model(transformer_config_from_args(with, with.vocab_size));
  saved_model.init_weights(1);
  save_model_checkpoint(dir.path.string(), saved_model, with, /*release=*/true);

  // Without the flag the weights would load (every tensor of the smaller model is there) and the
  // model would compute something else: refused, in one line naming the flag.
  Arguments without = with;
  without.qk_layernorm = false;
  GPTModel plain(transformer_config_from_args(without, without.vocab_size));
  Context ctx;
  const std::string e = error_of([&] { Checkpointer(without).load(ctx, dir.path.string(), plain, nullptr, nullptr); });
  EXPECT_NE(e.find("was saved from another model: --qk-layernorm is true there and false in this run"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;

  // --use-checkpoint-args takes it from the checkpoint, and then the checkpoint loads.
  Arguments restored = without;
  apply_checkpoint_args(restored, dir.path.string());
  EXPECT_TRUE(restored.qk_layernorm);
  GPTModel model(transformer_config_from_args(restored, restored.vocab_size));
  EXPECT_TRUE(Checkpointer(restored).load(ctx, dir.path.string(), model, nullptr, nullptr).has_value());
  const Parameter* w = model.params().find("decoder.layers.1.self_attention.k_layernorm.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->data.to_floats(), saved_model.params().find(w->name)->data.to_floats());
}

// Note [Rotary checkpoints]: a rope checkpoint continues as yarn (context extension) and the YaRN
// flags travel with --use-checkpoint-args; rope against none is still another model.
TEST(CheckpointArgs, RopeAndYarnAreOneRotaryEmbedding) {
  TempDir dir("rope_yarn");
  Arguments rope = parse(llama_flags());
  validate_args(rope);
  rope.bf16 = false;
  GPTModel model(transformer_config_from_args(rope, rope.vocab_size));
  model.init_weights(1);
  save_model_checkpoint(dir.path.string(), model, rope, /*release=*/true);

  Context ctx;
  Arguments yarn = parse(concat_flags(llama_flags(), {"--position-embedding-type", "yarn", "--rotary-scaling-factor",
                                                      "4", "--yarn-original-max-position-embeddings", "8"}));
  validate_args(yarn);
  yarn.bf16 = false;
  GPTModel yarn_model(transformer_config_from_args(yarn, yarn.vocab_size));
  EXPECT_TRUE(Checkpointer(yarn).load(ctx, dir.path.string(), yarn_model, nullptr, nullptr).has_value());

  Arguments none = rope;
  none.position_embedding_type = "none";
  GPTModel none_model(transformer_config_from_args(none, none.vocab_size));
  const std::string e =
      error_of([&] { Checkpointer(none).load(ctx, dir.path.string(), none_model, nullptr, nullptr); });
  EXPECT_NE(e.find("--position-embedding-type is \"rope\" there and \"none\" in this run"), std::string::npos) << e;

  TempDir yarn_dir("yarn_args");
  save_model_checkpoint(yarn_dir.path.string(), yarn_model, yarn, /*release=*/true);
  Arguments restored = parse(llama_flags());
  apply_checkpoint_args(restored, yarn_dir.path.string());
  EXPECT_EQ(restored.position_embedding_type, "yarn");
  EXPECT_EQ(restored.rotary_scaling_factor, 4.0f);
  EXPECT_EQ(restored.yarn_original_max_position_embeddings, 8);
}

// A checkpoint written before --qk-layernorm existed has no such key: it counts as off.
TEST(CheckpointArgs, AMissingIdentityKeyCountsAsItsDefault) {
  TempDir dir("qk_missing");
  Arguments a = parse(llama_flags());
  validate_args(a);
  a.bf16 = false;
  GPTModel model(transformer_config_from_args(a, a.vocab_size));
  model.init_weights(1);
  save_model_checkpoint(dir.path.string(), model, a, /*release=*/true);
  const fs::path meta_path = dir.path / "release/metadata.json";
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  ASSERT_TRUE(meta["args"].contains("qk_layernorm"));
  meta["args"].erase("qk_layernorm");
  std::ofstream(meta_path) << meta.dump(2);

  Context ctx;
  EXPECT_TRUE(Checkpointer(a).load(ctx, dir.path.string(), model, nullptr, nullptr).has_value());
  Arguments qk = a;
  qk.qk_layernorm = true;
  GPTModel qk_model(transformer_config_from_args(qk, qk.vocab_size));
  const std::string e = error_of([&] { Checkpointer(qk).load(ctx, dir.path.string(), qk_model, nullptr, nullptr); });
  EXPECT_NE(e.find("--qk-layernorm is false there and true in this run"), std::string::npos) << e;
}

}  // namespace
}  // namespace megatron
