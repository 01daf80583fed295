// Golden tests of the DeepSeek-V3 and GPT-OSS architectures against HuggingFace transformers: every
// `<model>/` HF folder (config.json + model.safetensors in the Hub's names) with its
// `<model>_io.safetensors` in $MEGATRON_ARCH_FIXTURES, else <fixtures>/arch (../shared/fixtures/arch),
// else the copy in tests/fixtures/arch. Read through the converter's path (testing::FolderGolden);
// the logits and loss within 1e-5, every gradient within 1e-4 of its tensor's scale and the 3-step
// AdamW trajectory, as the dense and MoE goldens check them. Every shape and option comes from the
// files; each fixture prints one line. CTest names contain "arch_golden".
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/golden/golden_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::arch_fixtures_dir;

std::vector<std::string> arch_fixtures() { return testing::model_fixtures_in(arch_fixtures_dir()); }

// The architecture of a fixture as the converter read it, for its line.
std::string describe(const testing::Golden& g) {
  const TransformerConfig& c = g.info.config;
  int moe_layers = 0;
  for (int i = 0; i < c.num_layers; ++i) moe_layers += c.is_moe_layer(i);
  return fmt::format("{}: {} layers, {} MoE (top-{} of {}, {} scores){}", g.info.model_type, c.num_layers, moe_layers,
                     c.moe_router_topk, c.num_moe_experts, c.moe_router_score_function,
                     c.moe_shared_expert_intermediate_size > 0 ? ", shared expert" : "");
}

class arch_golden : public ::testing::TestWithParam<std::string> {};

TEST_P(arch_golden, LogitsLossAndGradients) {
  testing::FolderGolden g(arch_fixtures_dir(), GetParam());
  const testing::Golden::GradientReport r = g.golden->check_logits_loss_gradients();
  std::printf("arch_golden %s (%s): logits %.2e, loss %.2e, %d gradients (worst %.2e)\n", g.io_name.c_str(),
              describe(*g.golden).c_str(), r.logits_error, r.loss_error, r.checked, r.worst_grad);
}

TEST_P(arch_golden, AdamWTrajectory) {
  testing::FolderGolden g(arch_fixtures_dir(), GetParam());
  const testing::Golden::AdamReport r = g.golden->check_adamw_trajectory();
  std::printf("arch_golden %s AdamW: losses %.2e, weights %.2e (worst tensor, of 1e-5); %zu of %zu elements "
              "undetermined\n",
              g.io_name.c_str(), r.worst_loss, r.worst_weight, r.undetermined, r.total);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, arch_golden, ::testing::ValuesIn(arch_fixtures()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(arch_golden);

TEST(arch_golden_fixtures, AreFound) {
  EXPECT_FALSE(arch_fixtures().empty()) << "no <model>/ + <model>_io.safetensors pairs in " << arch_fixtures_dir()
                                        << ": set MEGATRON_ARCH_FIXTURES";
}

}  // namespace
}  // namespace megatron
