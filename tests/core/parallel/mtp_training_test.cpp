// Multi-token prediction under every parallel layout the MTP block supports: pretrain_gpt with
// --mtp-num-layers under mpirun — pipeline (1F1B and interleaved; the block on the last stage with
// its copy of the embeddings), tensor (with and without sequence parallelism), data parallelism
// with the distributed optimizer and overlapped reduction (the embeddings and output head
// accumulate once per MTP depth more) — against one process: every iteration's lm loss, grad norm
// and "mtp_k loss" within 1e-6 relative, and the final weights — also with an MoE MTP layer under
// expert parallelism and with the decoder recomputed; a checkpoint with MTP saved at iteration 3
// resumes (in the same or another layout) with the single run's losses.
#include <gtest/gtest.h>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

// The Llama-style model (4 layers, RoPE, untied) with two MTP depths, and a tied one with one depth.
const std::vector<std::string> kMtpUntied = concat(kLlama, {"--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"});
// The MoE model of parallel_training_test.cpp (layers 1-3 MoE, so the MTP layer is one too) with the
// DeepSeek-style expert bias and sigmoid scores, and one MTP depth.
const std::vector<std::string> kMtpMoe = concat(
    kLlama, {"--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq",
             "([0]+[1]*3)", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
             "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--mtp-num-layers", "1"});
std::vector<std::string> tied_model() {
  std::vector<std::string> a;
  for (const std::string& f : kLlama)
    if (f != "--untie-embeddings-and-output-weights") a.push_back(f);
  return concat(a, {"--mtp-num-layers", "1"});
}

class MtpTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("mtp_training");
    untied_ = new TrainRun(train_single(dir_->path, "untied_single", kMtpUntied));
    tied_ = new TrainRun(train_single(dir_->path, "tied_single", tied_model()));
    moe_ = new TrainRun(train_single(dir_->path, "moe_single", kMtpMoe));
  }
  static void TearDownTestSuite() {
    delete untied_;
    delete tied_;
    delete moe_;
    delete dir_;
  }

  void check(const std::vector<std::string>& model, const TrainRun& single, const std::string& single_dir,
             const Layout& layout) {
    ASSERT_FALSE(single.aux.empty()) << "no MTP loss in the single run's log";
    expect_layout_equals_single(dir_->path, model, single, single_dir, layout);
  }

  static ScratchDir* dir_;
  static TrainRun* untied_;
  static TrainRun* tied_;
  static TrainRun* moe_;
};
ScratchDir* MtpTraining::dir_ = nullptr;
TrainRun* MtpTraining::untied_ = nullptr;
TrainRun* MtpTraining::tied_ = nullptr;
TrainRun* MtpTraining::moe_ = nullptr;

TEST_F(MtpTraining, SingleRunLogsEveryDepth) {
  ASSERT_EQ(untied_->aux.size(), 2u) << untied_->output;
  EXPECT_EQ(untied_->aux.count("mtp_1 loss") + untied_->aux.count("mtp_2 loss"), 2u);
  EXPECT_NE(untied_->output.find("| mtp_1 loss: "), std::string::npos) << untied_->output;
  EXPECT_NE(untied_->output.find("| mtp_2 loss: "), std::string::npos) << untied_->output;
  ASSERT_EQ(tied_->aux.size(), 1u) << tied_->output;
}

const std::vector<std::string> kPp2 = {"--pipeline-model-parallel-size", "2"};
const std::vector<std::string> kTp2Sp = {"--tensor-model-parallel-size", "2", "--sequence-parallel"};
const std::vector<std::string> kDistOpt = {"--use-distributed-optimizer", "--overlap-grad-reduce",
                                           "--overlap-param-gather", "--ddp-bucket-size", "20000"};

TEST_F(MtpTraining, UntiedLayoutsEqualSingleProcess) {
  const std::vector<Layout> layouts = {
      {"untied_pp2", 2, kPp2},
      {"untied_pp2_vpp", 2, concat(kPp2, {"--num-layers-per-virtual-pipeline-stage", "1"})},
      {"untied_tp2", 2, {"--tensor-model-parallel-size", "2"}},
      {"untied_tp2_sp", 2, kTp2Sp},
      {"untied_dp2_distopt_overlap", 2, kDistOpt},
      {"untied_tp2pp2_sp", 4, concat(kTp2Sp, kPp2)},
      // Note [MTP layer recomputation]: the decoder recomputed, the MTP layers kept: the same numbers.
      {"untied_recompute_full", 1, {"--recompute-granularity", "full", "--recompute-method", "uniform"}},
  };
  for (const Layout& l : layouts) check(kMtpUntied, *untied_, "untied_single", l);
}

TEST_F(MtpTraining, TiedLayoutsEqualSingleProcess) {
  const std::vector<Layout> layouts = {
      {"tied_pp2", 2, kPp2},
      {"tied_tp2_sp", 2, kTp2Sp},
      {"tied_dp2_distopt_overlap", 2, kDistOpt},
  };
  for (const Layout& l : layouts) check(tied_model(), *tied_, "tied_single", l);
}

// An MoE MTP layer: its router's losses join the decoder's (load_balancing_loss averages over the
// four MoE layers), its expert bias moves with theirs, under expert, pipeline and tensor parallelism.
TEST_F(MtpTraining, MoeLayoutsEqualSingleProcess) {
  ASSERT_EQ(moe_->aux.count("mtp_1 loss") + moe_->aux.count("load_balancing_loss"), 2u) << moe_->output;
  const std::vector<std::string> ep2 = {"--expert-model-parallel-size", "2"};
  const std::vector<Layout> layouts = {
      {"moe_ep2", 2, ep2},
      {"moe_pp2_vpp", 2, concat(kPp2, {"--num-layers-per-virtual-pipeline-stage", "1"})},
      {"moe_tp2sp_ep2", 4, concat(kTp2Sp, ep2)},
  };
  for (const Layout& l : layouts) check(kMtpMoe, *moe_, "moe_single", l);
}

// Saved at iteration 3 (--exit-interval), resumed: iterations 4 and 5 and the final weights are the
// single run's — in one process, from a pipeline layout into one process, and from one process
// into TP 2 × PP 2 (the last stage's embedding copy loads from the first stage's tensor).
TEST_F(MtpTraining, CheckpointsResumeExactly) {
  for (const Reshard& c : {Reshard{"resume_single", 1, {}, 1, {}}, Reshard{"resume_pp2_to_single", 2, kPp2, 1, {}},
                           Reshard{"resume_single_to_tp2pp2_sp", 1, {}, 4, concat(kTp2Sp, kPp2)}}) {
    expect_reshard_equals_single(dir_->path, dir_->path / c.name, kMtpUntied, *untied_, "untied_single", c);
  }
}

}  // namespace
}  // namespace megatron::testing
