// Golden tests of the mixture-of-experts models against HuggingFace transformers: every `<model>/`
// HF folder (config.json + model.safetensors, one tensor per expert, as users download them) with
// its `<model>_io.safetensors` in $MEGATRON_MOE_FIXTURES, else <fixtures>/moe (../shared/fixtures/moe),
// else the copy in tests/fixtures/moe. The folder is read through the converter's path (HFFolder,
// config_from_hf, hf_to_megatron); the logits, the loss, every gradient and the 3-step AdamW
// trajectory are checked as the dense goldens do (golden_util.h). The io files' loss is the mean
// cross entropy only, so the aux-loss and z-loss coefficients are 0 here. Every shape and option
// comes from the files; each fixture prints one line. CTest names contain "moe_golden".
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "tests/golden/golden_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;

using testing::moe_fixtures_dir;
using testing::moe_model_fixtures;

// The layers, experts and routing options of a fixture, for its line.
std::string describe(const testing::Golden& g) {
  const TransformerConfig& c = g.info.config;
  int moe_layers = 0;
  for (int i = 0; i < c.num_layers; ++i) moe_layers += c.is_moe_layer(i);
  return fmt::format("{}: {} MoE layers of {}, top-{} of {}{}{}{}", g.info.model_type, moe_layers, c.num_layers,
                     c.moe_router_topk, c.num_moe_experts, c.moe_router_pre_softmax ? ", pre-softmax" : "",
                     c.moe_shared_expert_intermediate_size > 0 ? ", gated shared expert" : "",
                     c.qk_layernorm ? ", qk-layernorm" : "");
}

class moe_golden : public ::testing::TestWithParam<std::string> {};

TEST_P(moe_golden, LogitsLossAndGradients) {
  testing::FolderGolden g(moe_fixtures_dir(), GetParam());
  const testing::Golden::GradientReport r = g.golden->check_logits_loss_gradients();
  std::printf("moe_golden %s (%s): logits %.2e, loss %.2e, %d gradients (worst %.2e)\n", g.io_name.c_str(),
              describe(*g.golden).c_str(), r.logits_error, r.loss_error, r.checked, r.worst_grad);
}

TEST_P(moe_golden, AdamWTrajectory) {
  testing::FolderGolden g(moe_fixtures_dir(), GetParam());
  const testing::Golden::AdamReport r = g.golden->check_adamw_trajectory();
  std::printf("moe_golden %s AdamW: losses %.2e, weights %.2e (worst tensor, of 1e-5); %zu of %zu elements undetermined\n",
              g.io_name.c_str(), r.worst_loss, r.worst_weight, r.undetermined, r.total);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, moe_golden, ::testing::ValuesIn(moe_model_fixtures()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(moe_golden);

TEST(moe_golden_fixtures, AreFound) {
  EXPECT_FALSE(moe_model_fixtures().empty()) << "no <model>/ + <model>_io.safetensors pairs in " << moe_fixtures_dir()
                                     << ": set MEGATRON_MOE_FIXTURES";
}

// A folder whose weights lack one expert's tensor: one line naming it.
TEST(moe_golden_fixtures, MissingExpertTensorIsNamed) {
  const std::vector<std::string> models = moe_model_fixtures();
  if (models.empty()) GTEST_SKIP() << "no MoE fixtures";
  const fs::path src = fs::path(moe_fixtures_dir()) / models[0];
  const fs::path dir = fs::temp_directory_path() / fmt::format("moe_missing_expert_{}", ::getpid());
  fs::create_directories(dir);
  fs::copy_file(src / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  safetensors::File full((src / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> kept;
  std::string dropped;
  for (const std::string& n : full.names()) {
    if (dropped.empty() && n.find("experts.1.") != std::string::npos) {
      dropped = n;
      continue;
    }
    kept.emplace_back(n, full.read(n));
  }
  ASSERT_FALSE(dropped.empty());
  safetensors::write((dir / "model.safetensors").string(), kept, {{"format", "pt"}});
  HFFolder folder(dir.string());
  const HFModelInfo info = config_from_hf(folder.config());
  const std::string e = testing::error_of([&] { hf_to_megatron(info, [&](const std::string& n) { return folder.get(n); }); });
  EXPECT_NE(e.find("'" + dropped + "'"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace megatron
