// pretrain_gpt under mpirun with the flags whose semantics span ranks:
//   - --calculate-per-token-loss (Note [Per-token loss]) with uneven loss masks (--eod-mask-loss,
//     micro-batch 1): DP 2 (plain and distributed optimizer with overlapped reduction), PP 2
//     (1F1B and interleaved), TP 2 with SP, CP 2, and an MoE model with its aux losses at DP 2 and
//     EP 2, each equal to one process with the flag (losses, grad norms within 1e-6, final weights);
//     the flag changes the one-process gradients (so the comparison can tell).
//   - --grad-reduce-in-bf16 (Note [Gradient reduction dtype]): a bf16 model at DP 2 (all-reduce and
//     reduce-scatter) within bf16 rounding of one process, and not bit-equal to DP 2 reducing in fp32.
#include <gtest/gtest.h>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

const std::vector<std::string> kMasked =
    concat(kLlama, {"--eod-mask-loss", "--micro-batch-size", "1", "--global-batch-size", "8"});
const std::vector<std::string> kPerToken = concat(kMasked, {"--calculate-per-token-loss"});
const std::vector<std::string> kPerTokenMoe =
    concat(kPerToken, {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"});

struct Case {
  std::string name;
  int np;
  std::vector<std::string> flags;
};

class FlagsTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("flags_training");
    for (const auto& [name, flags] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"per_token", kPerToken}, {"per_token_moe", kPerTokenMoe}, {"masked", kMasked}}) {
      singles_[name] = train_single(dir_->path, name + "_single", flags);
    }
  }
  static void TearDownTestSuite() {
    singles_.clear();
    delete dir_;
  }
  static ScratchDir* dir_;
  static std::map<std::string, TrainRun> singles_;
};
ScratchDir* FlagsTraining::dir_ = nullptr;
std::map<std::string, TrainRun> FlagsTraining::singles_;

TEST_F(FlagsTraining, PerTokenLossChangesTheGradient) {
  const TrainRun& a = singles_["per_token"];
  const TrainRun& b = singles_["masked"];
  ASSERT_EQ(a.losses.size(), 5u) << a.output;
  ASSERT_EQ(b.losses.size(), 5u) << b.output;
  EXPECT_EQ(a.losses[0], b.losses[0]);  // the same reported loss before any update: Σ loss / Σ tokens
  double most = 0;  // some microbatches hold an EOD (masked), others none: their weights differ
  for (size_t i = 0; i < 5; ++i) most = std::max(most, std::fabs(a.grad_norms[i] - b.grad_norms[i]) / b.grad_norms[i]);
  EXPECT_GT(most, 1e-4);
}

TEST_F(FlagsTraining, PerTokenLossEqualsOneProcessInEveryLayout) {
  const std::vector<std::string> overlap = {"--use-distributed-optimizer", "--overlap-grad-reduce",
                                            "--overlap-param-gather", "--ddp-bucket-size", "20000"};
  const std::vector<Case> cases = {
      {"dp2", 2, {}},
      {"dp2_distopt_overlap", 2, overlap},
      {"pp2", 2, {"--pipeline-model-parallel-size", "2"}},
      {"pp2_vpp", 2, {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"}},
      {"tp2_sp", 2, {"--tensor-model-parallel-size", "2", "--sequence-parallel"}},
      {"cp2", 2, {"--context-parallel-size", "2"}},
      {"pp2_dp2_distopt_overlap", 4, concat({"--pipeline-model-parallel-size", "2"}, overlap)},
      {"moe_dp2", 2, {}},
      {"moe_ep2", 2, {"--expert-model-parallel-size", "2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const bool moe = c.name.rfind("moe", 0) == 0;
    const std::string single = moe ? "per_token_moe" : "per_token";
    const TrainRun& want = singles_[single];
    ASSERT_EQ(want.losses.size(), 5u) << want.output;
    const fs::path save = dir_->path / c.name;
    const TrainRun r = train(dir_->path, c.name, c.np,
                             concat(concat(moe ? kPerTokenMoe : kPerToken, c.flags),
                                    {"--train-iters", "5", "--save", save.string()}));
    expect_close(r.losses, want.losses, c.name + " loss");
    expect_close(r.grad_norms, want.grad_norms, c.name + " grad norm");
    for (const auto& [name, values] : want.aux) expect_close(r.aux.at(name), values, c.name + " " + name);
    expect_same_weights(save, dir_->path / (single + "_single"), c.name);
  }
}

TEST_F(FlagsTraining, GradReduceInBf16IsOneProcessWithinBf16Rounding) {
  const std::vector<std::string> bf16 = concat(kMasked, {"--bf16", "--train-iters", "5"});
  const TrainRun single = train(dir_->path, "bf16_single", 1, bf16);
  ASSERT_EQ(single.losses.size(), 5u) << single.output;
  const TrainRun fp32_reduce = train(dir_->path, "bf16_dp2_fp32_reduce", 2, bf16);
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"dp2", {}}, {"dp2_distopt", {"--use-distributed-optimizer"}}}) {
    SCOPED_TRACE(name);
    const TrainRun r = train(dir_->path, "bf16_reduce_" + name, 2, concat(concat(bf16, extra), {"--grad-reduce-in-bf16"}));
    ASSERT_EQ(r.losses.size(), 5u) << r.output;
    bool differs = false;
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_NEAR(r.losses[i], single.losses[i], 2e-3 * single.losses[i]) << "iteration " << i + 1;
      EXPECT_NEAR(r.grad_norms[i], single.grad_norms[i], 2e-2 * single.grad_norms[i]) << "iteration " << i + 1;
      differs = differs || r.grad_norms[i] != fp32_reduce.grad_norms[i];
    }
    EXPECT_TRUE(differs) << "reducing in bf16 gave the fp32 reduction's grad norms bit for bit";
  }
}

}  // namespace
}  // namespace megatron::testing
