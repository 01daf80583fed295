// --fp8-param-gather through pretrain_gpt on CPU ranks (--fp8-cpu-reference; Note [FP8 parameters]):
//   - in an fp32 run the flag changes nothing under data parallelism 2 (and TP 2 x DP 2) with the
//     distributed optimizer: fp32 master -> fp8 is the quantisation of the fp32 parameter without
//     the flag, with the same scales (the shards' amax reduced over the data-parallel group, or the
//     delayed history's) — the same losses bit for bit; the gradient norms and saved weights to 1e-6
//     (the FP8 weights' own buffer sums the norm in another order);
//   - data parallelism 2 with the flag agrees with one process with the flag as the FP8 layouts do
//     without it (core/parallel/fp8_training_test.cpp: within 2e-4 of the loss; at the first step's
//     scales of 1 a data-parallel rank's larger per-rank gradients underflow e5m2 differently);
//   - the same for the blockwise recipe (tiles cut by the shards), and for the MoE experts' weights
//     under expert parallelism;
//   - in bf16 it trains like the run without the flag: every loss within 0.3% (the difference is only
//     fp32 -> fp8 against fp32 -> bf16 -> fp8);
//   - stopped and resumed, it continues with exactly the uninterrupted run's losses and weights;
//   - checkpoints with and without the flag load into each other (the weights are saved in the
//     model's dtype from the fp32 masters: Note [FP8 parameters in checkpoints]) — exactly in fp32.
#include <gtest/gtest.h>

#include "megatron/core/dist_checkpointing/sharded.h"
#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

std::vector<std::string> fp8(const std::vector<std::string>& model, const std::string& recipe, bool param_gather) {
  std::vector<std::string> a = concat(model, {"--fp8-format", "hybrid", "--fp8-recipe", recipe,
                                              "--fp8-amax-history-len", "4", "--fp8-cpu-reference",
                                              "--use-distributed-optimizer"});
  if (param_gather) a.push_back("--fp8-param-gather");
  return a;
}

// 128 wide, 4 layers, in bf16.
const std::vector<std::string> kWideBf16 = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--device", "cpu", "--split", "100,0,0",
    "--adam-eps", "1e-4", "--bf16"};

// The saved state of a run with the flag (a) against one without (b): the weights within 1e-6 (the
// flag's own buffer for the FP8 weights sums the gradient norm in another order, which moves the
// clipping factor in its last bits), and the delayed recipe's histories equal except row 0 of the
// weight column: with the flag the optimizer step has already recorded there the amax of the new
// weights' shard of each rank (reduced over the ranks by the next step: Note [FP8 parameters]),
// without it the next forward will record the whole weight's.
void expect_same_state(const fs::path& a, const fs::path& b, const std::string& what) {
  dist_checkpointing::ShardIndex ia(latest_iteration_dir(a).string(), "model"),
      ib(latest_iteration_dir(b).string(), "model");
  ASSERT_EQ(ia.names(), ib.names()) << what;
  for (const std::string& name : ia.names()) {
    const Shape shape = ia.tensor(name).shape;
    Tensor ta = Tensor::empty(shape, DType::Float32), tb = Tensor::empty(shape, DType::Float32);
    ia.load_into(name, ShardSpec{}, ta);
    ib.load_into(name, ShardSpec{}, tb);
    const std::vector<float> va = ta.to_floats(), vb = tb.to_floats();
    const bool history = name.ends_with("fp8_forward_amax_history");
    for (size_t i = 0; i < va.size(); ++i) {
      if (history && i == 1) {  // [L, 2]: row 0, the weight (with the flag: the saving rank's shard's amax)
        EXPECT_EQ(vb[i], 0.0f) << what << ": " << name;
        continue;
      }
      EXPECT_NEAR(va[i], vb[i], history ? 0.0 : 1e-6 * std::max(1.0, double(std::fabs(vb[i])))) << what << ": " << name << "[" << i << "]";
    }
  }
}

// kWideBf16 in fp32 (the blockwise recipe needs the 128 multiples).
std::vector<std::string> wide_fp32() {
  std::vector<std::string> a = kWideBf16;
  a.pop_back();
  return a;
}

// An fp32 run with --fp8-param-gather and the same run without it, on `np` ranks for `iterations`
// iterations (`extra` after the model and FP8 flags), each saved under dir/<name>_with(out): the
// same losses bit for bit and, with `same_state`, the same saved state. Returns both runs.
std::pair<TrainRun, TrainRun> unchanged_by_the_flag(const fs::path& dir, const std::string& name, int np,
                                                    const std::vector<std::string>& model, const std::string& recipe,
                                                    const std::vector<std::string>& extra, size_t iterations,
                                                    bool same_state = true) {
  const fs::path with = dir / (name + "_with"), without = dir / (name + "_without");
  TrainRun a = train(dir, name + "_with", np, concat(concat(fp8(model, recipe, true), extra), {"--save", with.string()}));
  TrainRun b =
      train(dir, name + "_without", np, concat(concat(fp8(model, recipe, false), extra), {"--save", without.string()}));
  EXPECT_EQ(a.losses.size(), iterations) << a.output;
  EXPECT_EQ(b.losses.size(), iterations) << b.output;
  EXPECT_EQ(a.losses, b.losses);
  if (same_state) expect_same_state(with, without, name + " with and without --fp8-param-gather");
  return {std::move(a), std::move(b)};
}

class Fp8ParamGatherTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new ScratchDir("fp8_param_gather"); }
  static void TearDownTestSuite() { delete dir_; }
  static ScratchDir* dir_;
};
ScratchDir* Fp8ParamGatherTraining::dir_ = nullptr;

TEST_F(Fp8ParamGatherTraining, Fp32RunsAreUnchangedAndDp2AgreesWithOneProcess) {
  for (const char* recipe : {"delayed", "tensorwise"}) {
    SCOPED_TRACE(recipe);
    const std::string r = recipe;
    const std::vector<std::string> steps = {"--train-iters", "4", "--ddp-bucket-size", "20000"};
    const auto [a, b] = unchanged_by_the_flag(dir_->path, "fp32_" + r, 2, kGpt, r, steps, 4);
    ASSERT_EQ(a.losses.size(), 4u);
    ASSERT_EQ(a.grad_norms.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(a.grad_norms[i], b.grad_norms[i], 1e-6 * b.grad_norms[i]);
    TrainRun one = train(dir_->path, "fp32_one_" + r, 1, concat(fp8(kGpt, r, true), steps));
    ASSERT_EQ(one.losses.size(), 4u) << one.output;
    EXPECT_EQ(one.losses[0], a.losses[0]) << "the first forward";
    for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(a.losses[i], one.losses[i], 2e-4 * one.losses[i]) << "iteration " << i + 1;
  }
}

// The blockwise recipe (Note [FP8 parameters]): each 128x128 tile's amax from the shards' partial
// tile amaxes, reduced over the data-parallel group (the shards cut tiles: a bucket of 20000
// elements splits the 128-wide weights mid-tile), then the tiles' power-of-two scales — in fp32 the
// same bytes as quantising the fp32 weight without the flag, so the same losses bit for bit, and
// the transposed copy (bytes and tile grid transposed) gives the input gradient's GEMM the
// operand the run without the flag quantises from the transposed weight.
TEST_F(Fp8ParamGatherTraining, BlockwiseFp32RunsAreUnchanged) {
  unchanged_by_the_flag(dir_->path, "block", 2, wide_fp32(), "blockwise",
                        {"--train-iters", "3", "--ddp-bucket-size", "20000"}, 3);
}

// The MoE experts' weights are FP8 parameters too, in an FP8 buffer of the expert-data-parallel
// group (Note [FP8 parameters]): with expert parallelism 2 on 4 ranks (expert data parallelism 2:
// each expert weight sharded over two ranks) an fp32 run with the flag gives the losses of the run
// without it, for the per-tensor recipes, and its checkpoint holds the experts' weights as the
// run without the flag does.
TEST_F(Fp8ParamGatherTraining, ExpertWeightsUnderExpertParallelism) {
  const std::vector<std::string> moe = {
      "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*3)", "--moe-aux-loss-coeff",
      "1e-2", "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2", "--train-iters", "3",
      "--ddp-bucket-size", "20000"};
  for (const char* recipe : {"delayed", "tensorwise"}) {
    SCOPED_TRACE(recipe);
    const std::string r = recipe;
    unchanged_by_the_flag(dir_->path, "moe_" + r, 4, kLlama, r, moe, 3, /*same_state=*/r == "tensorwise");
  }
}

// Under tensor (and sequence) parallelism too: each tensor-parallel rank's weight shard is sharded
// again over data parallelism, and its amax is reduced over the data-parallel group only (the
// scale is the tensor-parallel rank's own, as without the flag); with the all-gathers overlapped
// (the FP8 weights are waited for before each chunk's forward, as bf16 ones).
TEST_F(Fp8ParamGatherTraining, Fp32RunsAreUnchangedUnderTensorAndDataParallelism) {
  unchanged_by_the_flag(dir_->path, "tp2dp2", 4, kGpt, "tensorwise",
                        {"--train-iters", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--ddp-bucket-size", "20000", "--overlap-grad-reduce", "--overlap-param-gather"},
                        3);
}

// bf16: the flag rounds the masters to FP8 once instead of through bf16; the loss falls and stays
// within 0.3% of the run without the flag.
TEST_F(Fp8ParamGatherTraining, Bf16TrainsLikeTheRunWithoutIt) {
  for (const char* recipe : {"delayed", "tensorwise"}) {
    SCOPED_TRACE(recipe);
    const std::string r = recipe;
    const std::vector<std::string> steps = {"--train-iters", "8"};
    TrainRun with = train(dir_->path, "bf16_with_" + r, 1, concat(fp8(kWideBf16, r, true), steps));
    TrainRun without = train(dir_->path, "bf16_without_" + r, 1, concat(fp8(kWideBf16, r, false), steps));
    ASSERT_EQ(with.losses.size(), 8u) << with.output;
    ASSERT_EQ(without.losses.size(), 8u) << without.output;
    EXPECT_LT(with.losses.back(), with.losses.front() - 0.1);
    double max_rel = 0;
    for (size_t i = 0; i < 8; ++i)
      max_rel = std::max(max_rel, std::abs(with.losses[i] - without.losses[i]) / without.losses[i]);
    std::printf("bf16 %s: final loss %.6f with --fp8-param-gather, %.6f without; largest relative difference %.3g\n",
                recipe, with.losses.back(), without.losses.back(), max_rel);
    EXPECT_GT(max_rel, 0.0) << "bf16 runs with and without the flag are the same: the flag is not in use";
    EXPECT_LT(max_rel, 3e-3);
  }
}

// Stopped after iteration 3 and resumed (bf16, DP 2): iterations 4 and 5 and the final weights are
// the uninterrupted run's (the masters and the FP8 scaling state come back; the FP8 weights are
// quantised from the masters again, as the step did).
TEST_F(Fp8ParamGatherTraining, ResumesExactly) {
  for (const char* recipe : {"delayed", "tensorwise"}) {
    SCOPED_TRACE(recipe);
    const std::string r = recipe;
    const fs::path full = dir_->path / ("resume_full_" + r), part = dir_->path / ("resume_part_" + r);
    const std::vector<std::string> base = concat(fp8(kWideBf16, r, true), {"--train-iters", "5"});
    TrainRun whole = train(dir_->path, "resume_full_" + r, 2, concat(base, {"--save", full.string()}));
    train(dir_->path, "resume_save_" + r, 2, concat(base, {"--exit-interval", "3", "--save", part.string()}));
    TrainRun resumed =
        train(dir_->path, "resume_load_" + r, 2, concat(base, {"--load", part.string(), "--save", part.string()}));
    ASSERT_EQ(whole.losses.size(), 5u) << whole.output;
    ASSERT_EQ(resumed.losses.size(), 2u) << resumed.output;
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[i + 3]) << "iteration " << i + 4;
    expect_same_weights(part, full, "resumed with --fp8-param-gather");
  }
}

// A checkpoint without the flag loads into a run with it and the other way round: in fp32 each
// resumed run continues exactly as the uninterrupted run (with the flag or without: the same);
// in bf16 the weights are saved as bf16 and the resumed runs stay within the flag's rounding.
TEST_F(Fp8ParamGatherTraining, CheckpointsWithAndWithoutTheFlagLoadIntoEachOther) {
  const std::vector<std::string> five = {"--train-iters", "5"};
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const std::vector<std::string>& model = bf16 ? kWideBf16 : kGpt;
    const std::string tag = bf16 ? "bf16" : "fp32";
    TrainRun whole = train(dir_->path, "cross_whole_" + tag, 1, concat(fp8(model, "delayed", false), five));
    ASSERT_EQ(whole.losses.size(), 5u) << whole.output;
    for (bool saved_with : {false, true}) {
      const std::string name = tag + (saved_with ? "_from_flag" : "_to_flag");
      const fs::path ckpt = dir_->path / ("cross_" + name);
      train(dir_->path, "cross_save_" + name, 1,
            concat(concat(fp8(model, "delayed", saved_with), five), {"--exit-interval", "3", "--save", ckpt.string()}));
      if (saved_with) {
        dist_checkpointing::ShardIndex index((ckpt / "iter_0000003").string(), "model");
        EXPECT_EQ(index.tensor("decoder.layers.1.mlp.linear_fc1.weight").dtype,
                  bf16 ? DType::BFloat16 : DType::Float32);
      }
      TrainRun resumed = train(dir_->path, "cross_load_" + name, 1,
                               concat(concat(fp8(model, "delayed", !saved_with), five), {"--load", ckpt.string()}));
      ASSERT_EQ(resumed.losses.size(), 2u) << resumed.output;
      for (size_t i = 0; i < 2; ++i) {
        if (bf16) {
          EXPECT_NEAR(resumed.losses[i], whole.losses[i + 3], 3e-3 * whole.losses[i + 3]) << name << " " << i + 4;
        } else {
          EXPECT_EQ(resumed.losses[i], whole.losses[i + 3]) << name << " iteration " << i + 4;
        }
      }
    }
  }
}

}  // namespace
}  // namespace megatron::testing
