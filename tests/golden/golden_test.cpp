// Golden tests against HuggingFace transformers (../shared/fixtures, or $MEGATRON_FIXTURES; a
// fixture found only in the repository's tests/fixtures, such as one newer than the shared copy,
// is read from there): <model>_model.safetensors holds the HF weights with the config.json in its
// metadata, and <model>_io.safetensors the tokens, labels, logits, loss, every parameter gradient
// and a 3-step AdamW trajectory. Every shape and hyperparameter comes from the files, so any
// fixture made the same way must pass; each prints one line with what it checked. Tolerances are
// those stated in the fixture README (fp32 on CPU).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/golden/golden_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

// A dense fixture: <name>_model.safetensors with its config.json in the metadata.
struct DenseGolden {
  std::unique_ptr<safetensors::File> model_file;
  std::unique_ptr<testing::Golden> golden;
  explicit DenseGolden(const std::string& name) {
    const std::string dir = testing::golden_fixture_dir_of(name);
    model_file = std::make_unique<safetensors::File>(dir + "/" + name + "_model.safetensors");
    auto config = nlohmann::json::parse(model_file->metadata().at("config"));
    HFModelInfo info = config_from_hf(config, /*make_vocab_size_divisible_by=*/1);  // no padding: logits as HF's
    TransformerConfig c = info.config;
    c.hidden_dropout = c.attention_dropout = 0.0f;  // HF reference ran in eval mode
    golden = std::make_unique<testing::Golden>(
        info, c, [&](const std::string& n) { return model_file->read(n); }, dir + "/" + name + "_io.safetensors",
        model_file->path());
  }
};

class GoldenModel : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenModel, LogitsLossAndGradients) {
  DenseGolden d(GetParam());
  testing::Golden& g = *d.golden;
  const testing::Golden::GradientReport r = g.check_logits_loss_gradients();
  const TransformerConfig& c = g.info.config;
  const std::string rope = c.use_yarn()     ? fmt::format(", yarn x{}", c.yarn_rotary_scaling_factor)
                           : c.rope_scaling ? fmt::format(", llama3 rope scaling x{}", c.rope_scaling_factor)
                                            : std::string();
  std::printf("golden %s (%s, %s%s): logits %.2e, loss %.2e, %d gradients (worst %.2e) against %s\n",
              GetParam().c_str(), g.info.model_type.c_str(), c.qk_layernorm ? "qk-layernorm" : "no qk-layernorm",
              rope.c_str(), r.logits_error, r.loss_error, r.checked, r.worst_grad, g.io_file->path().c_str());
}

TEST_P(GoldenModel, AdamWTrajectory) {
  DenseGolden d(GetParam());
  const testing::Golden::AdamReport r = d.golden->check_adamw_trajectory();
  std::printf("AdamW: %zu of %zu elements in Adam's undetermined regime\n", r.undetermined, r.total);
}

TEST(GoldenFixtures, AreFound) {
  EXPECT_FALSE(testing::golden_fixture_models().empty()) << "no <name>_model.safetensors + <name>_io.safetensors pairs in "
                                         << testing::fixtures_dir() << ": set MEGATRON_FIXTURES";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenModel, ::testing::ValuesIn(testing::golden_fixture_models()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GoldenModel);

}  // namespace
}  // namespace megatron
