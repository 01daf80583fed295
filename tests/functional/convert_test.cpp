// tools/convert_checkpoint: HF -> megatron.cpp -> HF is exact, and the converted fixture models
// loaded into GPTModel give the fixture logits.
#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/training/checkpointing.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

class Convert : public ::testing::TestWithParam<std::string> {};

TEST_P(Convert, RoundTripIsExactAndLogitsMatch) {
  ScratchDir dir("convert_" + GetParam());
  const fs::path fixtures = fs::absolute(fixtures_dir());
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
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  config.hidden_dropout = config.attention_dropout = 0.0f;
  GPTModel model(config);
  Checkpointer ck(args);
  Context ctx;
  ASSERT_TRUE(ck.load(ctx, (dir.path / "ckpt").string(), model, nullptr, nullptr).has_value());
  safetensors::File io((fixtures / (GetParam() + "_io.safetensors")).string());
  Tensor logits = model.forward_logits(ctx, io.read("tokens"), Tensor());             // [s, b, V]
  std::vector<float> ours = logits.to_floats(), ref = io.read("logits").to_floats();  // ref [b, s, V]
  const int64_t s = logits.size(0), b = logits.size(1), v = logits.size(2);
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < s; ++j)
      for (int64_t k = 0; k < v; ++k) {
        worst =
            std::max(worst, std::fabs(double(ours[size_t((j * b + i) * v + k)]) - ref[size_t((i * s + j) * v + k)]));
        scale = std::max(scale, std::fabs(double(ref[size_t((i * s + j) * v + k)])));
      }
  EXPECT_LE(worst / scale, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Convert, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return info.param; });

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
