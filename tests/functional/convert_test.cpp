// tools/convert_checkpoint: HF -> megatron.cpp -> HF is exact, and the converted fixture models
// loaded into GPTModel give the fixture logits (GPT-2, Llama, Qwen3); a --qk-layernorm model
// trained here exports as Qwen3.
#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/training/checkpointing.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

class Convert : public ::testing::TestWithParam<std::string> {};

TEST_P(Convert, RoundTripIsExactAndLogitsMatch) {
  ScratchDir dir("convert_" + GetParam());
  const fs::path fixtures = fs::absolute(golden_fixture_dir_of(GetParam()));
  safetensors::File src((fixtures / (GetParam() + "_model.safetensors")).string());
  // An HF folder: config.json + model.safetensors.
  fs::create_directories(dir.path / "hf");
  fs::copy_file(fixtures / (GetParam() + "_model.safetensors"), dir.path / "hf/model.safetensors");
  std::ofstream(dir.path / "hf/config.json") << src.metadata().at("config");

  RunResult to = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir.path);
  ASSERT_EQ(to.exit_code, 0) << to.output;
  EXPECT_EQ(read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt"), "release");
  RunResult back =
      run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf_back"}, dir.path);
  ASSERT_EQ(back.exit_code, 0) << back.output;
  safetensors::File out((dir.path / "hf_back/model.safetensors").string());
  ASSERT_EQ(out.names(), src.names());
  for (const std::string& n : src.names()) EXPECT_EQ(out.read(n).to_floats(), src.read(n).to_floats()) << n;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path / "hf_back/config.json")),
            nlohmann::json::parse(src.metadata().at("config")));

  // The converted checkpoint, loaded as pretrain_gpt would, gives the fixture's logits.
  Arguments args;
  apply_checkpoint_args(args, (dir.path / "ckpt").string());
  const nlohmann::json hf_config = nlohmann::json::parse(src.metadata().at("config"));
  EXPECT_EQ(args.qk_layernorm, hf_config.value("model_type", "") == "qwen3") << "Qwen3's q_norm/k_norm are --qk-layernorm";
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  config.hidden_dropout = config.attention_dropout = 0.0f;
  GPTModel model(config);
  Checkpointer ck(args);
  Context ctx;
  ASSERT_TRUE(ck.load(ctx, (dir.path / "ckpt").string(), model, nullptr, nullptr).has_value());
  safetensors::File io((fixtures / (GetParam() + "_io.safetensors")).string());
  Tensor logits = model.forward_logits(ctx, io.read("tokens"), Tensor());             // [s, b, V]
  std::vector<float> ours = logits.to_floats(), ref = io.read("logits").to_floats();  // ref [b, s, V]
  // Ours has the padded vocabulary vp >= the fixture's v; the padded columns are not compared.
  const int64_t s = logits.size(0), b = logits.size(1), v = io.read("logits").size(2), vp = logits.size(2);
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < s; ++j)
      for (int64_t k = 0; k < v; ++k) {
        const double r = ref[size_t((i * s + j) * v + k)];
        worst = std::max(worst, std::fabs(double(ours[size_t((j * b + i) * vp + k)]) - r));
        scale = std::max(scale, std::fabs(r));
      }
  EXPECT_LE(worst / scale, 1e-5);
  std::printf("convert %s: HF -> megatron.cpp -> HF exact over %zu tensors, logits within %.2e\n", GetParam().c_str(),
              src.names().size(), worst / scale);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Convert, ::testing::ValuesIn(golden_fixture_models()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Convert);

// A model trained here with --qk-layernorm (no HF config in its checkpoint) exports as Qwen3, and
// that export goes through megatron.cpp and back unchanged.
TEST(Convert, QkLayernormCheckpointExportsAsQwen3) {
  ScratchDir dir("convert_qk");
  const std::vector<std::string> flags = {"--num-layers",
                                          "2",
                                          "--hidden-size",
                                          "64",
                                          "--num-attention-heads",
                                          "4",
                                          "--group-query-attention",
                                          "--num-query-groups",
                                          "2",
                                          "--seq-length",
                                          "32",
                                          "--qk-layernorm",
                                          "--normalization",
                                          "RMSNorm",
                                          "--swiglu",
                                          "--disable-bias-linear",
                                          "--position-embedding-type",
                                          "rope",
                                          "--untie-embeddings-and-output-weights",
                                          "--micro-batch-size",
                                          "2",
                                          "--train-iters",
                                          "2",
                                          "--lr",
                                          "1e-3",
                                          "--mock-data",
                                          "--vocab-size",
                                          "100",
                                          "--eval-iters",
                                          "1",
                                          "--device",
                                          "cpu",
                                          "--save",
                                          "ckpt",
                                          "--save-interval",
                                          "2"};
  RunResult train = run(concat({bin("pretrain_gpt")}, flags), dir.path);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  RunResult to_hf = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  ASSERT_EQ(to_hf.exit_code, 0) << to_hf.output;
  const nlohmann::json config = nlohmann::json::parse(read_file(dir.path / "hf/config.json"));
  EXPECT_EQ(config.at("model_type"), "qwen3");
  EXPECT_EQ(config.at("architectures"), nlohmann::json({"Qwen3ForCausalLM"}));
  safetensors::File hf((dir.path / "hf/model.safetensors").string());
  const auto names = hf.names();
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.self_attn.k_norm.weight"), names.end());
  RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt2"}, dir.path);
  ASSERT_EQ(in.exit_code, 0) << in.output;
  RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt2", "--save", "hf2"}, dir.path);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  safetensors::File again((dir.path / "hf2/model.safetensors").string());
  ASSERT_EQ(again.names(), names);
  for (const std::string& n : names) EXPECT_EQ(again.read(n).to_floats(), hf.read(n).to_floats()) << n;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path / "hf2/config.json")), config);
}

TEST(Convert, MissingFilesAreClearErrors) {
  ScratchDir dir("convert_bad");
  fs::create_directories(dir.path / "hf");
  RunResult r = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "out"}, dir.path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  RunResult m = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "nothing", "--save", "out"}, dir.path);
  EXPECT_NE(m.exit_code, 0);
  EXPECT_NE(m.output.find("no checkpoint"), std::string::npos) << m.output;
}

}  // namespace
}  // namespace megatron::testing
