// FP8 training through pretrain_gpt on CPU ranks (--fp8-cpu-reference: the FP8 ops' CPU reference,
// which rounds and saturates exactly as the GPU kernels do):
//   - the delayed recipe under tensor, sequence, pipeline and data parallelism agrees with one
//     process to within FP8's own rounding (the amax reduction over tp × cp × dp gives every layout
//     one process's scales: Note [FP8 scaling under parallelism]). Not bit for bit, as the bf16/fp32
//     layouts are: a last-bit difference of fp32 sums (tensor-parallel partial sums) moves a value
//     across an FP8 rounding boundary, and at the first step (scales of 1, as TE's) the gradients of
//     a data-parallel rank, larger by the microbatch count it divides by, underflow e5m2 less; the
//     quantisation steps then grow such differences over the iterations;
//   - a run stopped and resumed from its checkpoint continues with exactly the uninterrupted run's
//     losses and weights (the scales and amax histories travel in the checkpoint: Note [FP8 state
//     in checkpoints]; fresh scales of 1 would quantise differently), also resumed under TP 2;
//   - bf16 (here fp32) and FP8 runs load each other's checkpoints;
//   - each recipe trains (falling loss), close to but not equal to the unquantised run;
//   - FP8 on the CPU without the reference flag is refused with one line;
//   - an MoE model's experts and shared experts in FP8 (Note [FP8 experts]): it trains, resumes
//     exactly, EP 2 equals one process within FP8 rounding, plain and FP8 checkpoints cross.
#include <gtest/gtest.h>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

// The GPT of the layout tests with FP8 (hybrid: e4m3 forward, e5m2 gradients) and a history of 4.
std::vector<std::string> fp8(const std::vector<std::string>& model, const std::string& recipe) {
  return concat(model, {"--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-amax-history-len", "4",
                        "--fp8-cpu-reference"});
}

// 128 wide (blockwise needs multiples of its 128 block), 4 layers.
const std::vector<std::string> kWide = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--device", "cpu", "--split", "100,0,0",
    "--adam-eps", "1e-4"};

class Fp8Training : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("fp8_training");
    single_ = new TrainRun(train_single(dir_->path, "fp8_single", fp8(kGpt, "delayed")));
  }
  static void TearDownTestSuite() {
    delete single_;
    delete dir_;
  }
  static ScratchDir* dir_;
  static TrainRun* single_;
};
ScratchDir* Fp8Training::dir_ = nullptr;
TrainRun* Fp8Training::single_ = nullptr;

class Fp8Layouts : public Fp8Training, public ::testing::WithParamInterface<Layout> {};

// Every iteration's loss within 2e-4 and gradient norm within 3e-2 of one process's (measured: TP 2
// + SP 4e-6 / 2e-3 over 3 iterations, PP 2 exact for 2 iterations, TP 2 x DP 2 ~3e-4 / 1.4e-2).
TEST_P(Fp8Layouts, DelayedScalingAgreesWithOneProcess) {
  const Layout& l = GetParam();
  ASSERT_EQ(single_->losses.size(), 5u) << single_->output;
  TrainRun r = train(dir_->path, l.name, l.np, concat(concat(fp8(kGpt, "delayed"), l.flags), {"--train-iters", "5"}));
  ASSERT_EQ(r.losses.size(), 5u) << r.output;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_NEAR(r.losses[i], single_->losses[i], 2e-4 * single_->losses[i]) << l.name << " iteration " << i + 1;
    EXPECT_NEAR(r.grad_norms[i], single_->grad_norms[i], 3e-2 * single_->grad_norms[i])
        << l.name << " iteration " << i + 1;
  }
  EXPECT_NEAR(r.losses[0], single_->losses[0], 1e-6 * single_->losses[0]) << l.name << ": the first forward";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Fp8Layouts,
    ::testing::Values(Layout{"tp2_sp", 2, {"--tensor-model-parallel-size", "2", "--sequence-parallel"}},
                      Layout{"pp2_vpp", 2,
                             {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"}},
                      Layout{"tp2_dp2_distopt", 4,
                             {"--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                              "--overlap-grad-reduce", "--ddp-bucket-size", "20000"}}),
    [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// The amax reduction over the tensor-parallel ranks (Note [FP8 scaling under parallelism]): after
// one step, the scales and histories TP 2 + SP saved (from its rank 0, whose weight shards and
// sequence shards alone would give other amaxes) are one process's, as are the weights.
TEST_F(Fp8Training, TensorParallelRanksScaleAsOneProcess) {
  const fs::path one = dir_->path / "step1_single", tp2 = dir_->path / "step1_tp2";
  // two iterations in the schedule (one warmup iteration), the checkpoint written after the first
  const std::vector<std::string> first = {"--train-iters", "2", "--exit-interval", "1"};
  train(dir_->path, "step1_single", 1, concat(concat(fp8(kGpt, "delayed"), first), {"--save", one.string()}));
  train(dir_->path, "step1_tp2", 2,
        concat(concat(fp8(kGpt, "delayed"), first),
               {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", tp2.string()}));
  expect_same_weights(tp2, one, "tp2 after one step");
}

// Stopped at iteration 3 and resumed: iterations 4 and 5 are the uninterrupted run's, which needs
// the scaling state (fresh scales of 1 would quantise differently).
TEST_F(Fp8Training, ResumesWithItsScalingState) {
  const fs::path ckpt = dir_->path / "resume";
  train(dir_->path, "resume_save", 1,
        concat(fp8(kGpt, "delayed"), {"--train-iters", "5", "--exit-interval", "3", "--save", ckpt.string()}));
  TrainRun resumed = train(dir_->path, "resume_load", 1,
                           concat(fp8(kGpt, "delayed"),
                                  {"--train-iters", "5", "--load", ckpt.string(), "--save", ckpt.string()}));
  ASSERT_EQ(resumed.losses.size(), 2u) << resumed.output;
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.losses[i], single_->losses[i + 3]) << "iteration " << i + 4;
  expect_same_weights(ckpt, dir_->path / "fp8_single", "fp8 resumed");  // the FP8 scaling state included
  // and under another layout: within FP8 rounding of the uninterrupted run
  const fs::path ckpt2 = dir_->path / "resume_tp2";
  train(dir_->path, "resume_save2", 1,
        concat(fp8(kGpt, "delayed"), {"--train-iters", "5", "--exit-interval", "3", "--save", ckpt2.string()}));
  TrainRun tp2 = train(dir_->path, "resume_load_tp2", 2,
                       concat(fp8(kGpt, "delayed"), {"--train-iters", "5", "--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel", "--load", ckpt2.string()}));
  ASSERT_EQ(tp2.losses.size(), 2u) << tp2.output;
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(tp2.losses[i], single_->losses[i + 3], 2e-4 * single_->losses[i + 3]);
}

// A checkpoint without FP8 state loads into an FP8 run (fresh scales), and an FP8 checkpoint into
// a run without FP8 (its scaling state ignored).
TEST_F(Fp8Training, PlainAndFp8RunsLoadEachOthersCheckpoints) {
  const fs::path plain = dir_->path / "plain_ckpt";
  const fs::path fp8_ckpt = dir_->path / "fp8_ckpt";
  TrainRun p = train(dir_->path, "plain", 1,
                     concat(kGpt, {"--train-iters", "3", "--save", plain.string()}));
  ASSERT_EQ(p.losses.size(), 3u) << p.output;
  TrainRun f = train(dir_->path, "plain_to_fp8", 1,
                     concat(fp8(kGpt, "delayed"),
                            {"--train-iters", "5", "--load", plain.string(), "--save", fp8_ckpt.string()}));
  ASSERT_EQ(f.losses.size(), 2u) << f.output;
  for (double l : f.losses) EXPECT_TRUE(std::isfinite(l)) << f.output;
  TrainRun back = train(dir_->path, "fp8_to_plain", 1,
                        concat(kGpt, {"--train-iters", "7", "--load", fp8_ckpt.string()}));
  ASSERT_EQ(back.losses.size(), 2u) << back.output;
  for (double l : back.losses) EXPECT_TRUE(std::isfinite(l)) << back.output;
}

// Every recipe trains: the loss falls over 8 iterations, and the run is FP8 (its losses differ from
// the unquantised run's) yet close to it (within 2% at every iteration).
TEST_F(Fp8Training, EveryRecipeTrainsCloseToTheUnquantisedRun) {
  const std::vector<std::string> steps = {"--train-iters", "8", "--lr", "3e-3"};
  TrainRun plain = train(dir_->path, "wide_plain", 1, concat(kWide, steps));
  ASSERT_EQ(plain.losses.size(), 8u) << plain.output;
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    for (const char* format : {"e4m3", "hybrid"}) {
      const std::string name = std::string("wide_") + recipe + "_" + format;
      TrainRun r = train(dir_->path, name, 1,
                         concat(concat(kWide, steps), {"--fp8-format", format, "--fp8-recipe", recipe,
                                                       "--fp8-cpu-reference"}));
      ASSERT_EQ(r.losses.size(), 8u) << r.output;
      EXPECT_LT(r.losses.back(), r.losses.front() - 0.1) << name;
      double max_rel = 0, max_abs = 0;
      for (size_t i = 0; i < r.losses.size(); ++i) {
        max_abs = std::max(max_abs, std::abs(r.losses[i] - plain.losses[i]));
        max_rel = std::max(max_rel, std::abs(r.losses[i] - plain.losses[i]) / plain.losses[i]);
      }
      std::printf("%s: final loss %.6f (unquantised %.6f), largest difference %.3g (%.3g relative)\n", name.c_str(),
                  r.losses.back(), plain.losses.back(), max_abs, max_rel);
      EXPECT_GT(max_abs, 0.0) << name << ": no difference from the unquantised run — FP8 is not in use";
      EXPECT_LT(max_rel, 0.02) << name;
    }
  }
}

// Note [FP8 weight cache]: with 4 microbatches a step (global batch 8 of 2) each FP8 weight is
// quantised once a step and reused; the losses are those of the run that quantises it at every
// microbatch (--disable-parameter-transpose-cache), bit for bit, for each recipe — also under
// pipeline parallelism 2, where a stage's microbatches interleave forwards and backwards.
TEST_F(Fp8Training, WeightCacheOverMicrobatchesGivesTheSameLosses) {
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(recipe);
    const std::vector<std::string> run = concat(fp8(kWide, recipe), {"--train-iters", "3"});
    TrainRun cached = train(dir_->path, std::string("cache_") + recipe, 1, run);
    TrainRun plain =
        train(dir_->path, std::string("nocache_") + recipe, 1, concat(run, {"--disable-parameter-transpose-cache"}));
    ASSERT_EQ(cached.losses.size(), 3u) << cached.output;
    ASSERT_EQ(plain.losses.size(), 3u) << plain.output;
    EXPECT_EQ(cached.losses, plain.losses);
  }
  const std::vector<std::string> pp = concat(fp8(kWide, "delayed"), {"--train-iters", "3", "--pipeline-model-parallel-size", "2"});
  TrainRun cached = train(dir_->path, "cache_pp2", 2, pp);
  TrainRun plain = train(dir_->path, "nocache_pp2", 2, concat(pp, {"--disable-parameter-transpose-cache"}));
  ASSERT_EQ(cached.losses.size(), 3u) << cached.output;
  EXPECT_EQ(cached.losses, plain.losses);
}

// Multi-latent attention's projections (q/kv down and up, linear_proj) run their GEMMs in FP8 as
// attention's do (MLASelfAttention::enable_fp8); a DeepSeek-style model (MLA, a dense first layer,
// sigmoid group-limited MoE with a shared expert) trains close to its unquantised run.
TEST_F(Fp8Training, MultiLatentAttentionTrainsCloseToTheUnquantisedRun) {
  const std::vector<std::string> mla = {
      "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
      "--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "32",
      "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm", "--num-experts", "4",
      "--moe-layer-freq", "([0]+[1]*3)", "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
      "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-router-load-balancing-type", "none", "--train-iters", "8", "--lr", "3e-3"};
  TrainRun plain = train(dir_->path, "mla_plain", 1, concat(kWide, mla));
  ASSERT_EQ(plain.losses.size(), 8u) << plain.output;
  TrainRun r = train(dir_->path, "mla_delayed", 1, concat(fp8(concat(kWide, mla), "delayed"), {}));
  ASSERT_EQ(r.losses.size(), 8u) << r.output;
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.1);
  double max_rel = 0;
  for (size_t i = 0; i < r.losses.size(); ++i)
    max_rel = std::max(max_rel, std::abs(r.losses[i] - plain.losses[i]) / plain.losses[i]);
  std::printf("mla_delayed: final loss %.6f (unquantised %.6f), largest relative difference %.3g\n",
              r.losses.back(), plain.losses.back(), max_rel);
  EXPECT_GT(max_rel, 0.0) << "no difference from the unquantised run: FP8 is not in use";
  EXPECT_LT(max_rel, 0.02);
}

// ---- mixture of experts (Note [FP8 experts]) -----------------------------------------------------
// A small Mixtral-style model with a shared expert: layer 0 dense, layers 1-3 MoE with 4 SwiGLU
// experts of 32 (top-2) and a shared expert of 32, all in FP8 (hybrid, delayed, history 4).
const std::vector<std::string> kFp8Moe = fp8(
    concat(kLlama, {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                    "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*3)",
                    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall"}),
    "delayed");

// One tensor of a checkpoint's latest iteration, as fp32 values (empty when it is not there).
std::vector<float> checkpoint_tensor(const fs::path& dir, const std::string& name) {
  dist_checkpointing::ShardIndex index(latest_iteration_dir(dir).string(), "model");
  if (!index.contains(name)) return {};
  Tensor t = Tensor::empty(index.tensor(name).shape, DType::Float32);
  index.load_into(name, ShardSpec{}, t);
  return t.to_floats();
}

// pretrain_gpt trains the MoE model in FP8 (the loss falls; the experts' and shared experts'
// scaling state is in the checkpoint, moved from TE's fresh scales of 1), and a run stopped at
// iteration 3 resumes with the uninterrupted run's losses exactly and ends with its weights and
// scaling state; the grouped experts give the sequential experts' run.
TEST_F(Fp8Training, MoeTrainsAndResumesExactly) {
  const fs::path full = dir_->path / "moe_full", part = dir_->path / "moe_part";
  TrainRun one = train(dir_->path, "moe_full", 1, concat(kFp8Moe, {"--train-iters", "6", "--save", full.string()}));
  ASSERT_EQ(one.losses.size(), 6u) << one.output;
  EXPECT_LT(one.losses.back(), one.losses.front() - 0.05) << one.output;
  const std::string expert = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2";
  for (const std::string& name : {expert + ".fp8_forward_scale", expert + ".fp8_backward_scale",
                                  std::string("decoder.layers.1.mlp.shared_experts.linear_fc1.fp8_forward_scale")}) {
    const std::vector<float> v = checkpoint_tensor(full, name);
    ASSERT_FALSE(v.empty()) << name << " is not in the checkpoint";
    for (float x : v) EXPECT_NE(x, 1.0f) << name << ": the scale never moved";
  }
  EXPECT_EQ(checkpoint_tensor(full, expert + ".fp8_forward_amax_history").size(), 4u * 2u);

  train(dir_->path, "moe_part", 1,
        concat(kFp8Moe, {"--train-iters", "6", "--exit-interval", "3", "--save", part.string()}));
  TrainRun resumed = train(dir_->path, "moe_resumed", 1,
                           concat(kFp8Moe, {"--train-iters", "6", "--load", part.string(), "--save", part.string()}));
  ASSERT_EQ(resumed.losses.size(), 3u) << resumed.output;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], one.losses[i + 3]) << "iteration " << i + 4;
  expect_same_weights(part, full, "moe fp8 resumed");

  TrainRun grouped = train(dir_->path, "moe_grouped", 1, concat(kFp8Moe, {"--train-iters", "6", "--moe-grouped-gemm"}));
  ASSERT_EQ(grouped.losses.size(), 6u) << grouped.output;
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(grouped.losses[i], one.losses[i]) << "grouped, iteration " << i + 1;
}

// Expert parallelism with FP8: EP 2 (alltoall, with the grouped experts, and with expert tensor
// parallelism 2 under TP 2 + SP: the experts' amax reduced over the expert-TP shards) equals one process to
// within FP8's rounding, as the dense layouts do (Fp8Layouts): each expert's amax is reduced over
// the ranks that hold it, so each expert scales by its own tokens wherever it lives; an EP 1
// checkpoint resumes under EP 2.
TEST_F(Fp8Training, MoeExpertParallelEqualsOneProcess) {
  TrainRun one = train(dir_->path, "moe_ep1", 1, concat(kFp8Moe, {"--train-iters", "5"}));
  ASSERT_EQ(one.losses.size(), 5u) << one.output;
  for (const auto& [name, flags] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"moe_ep2", {"--expert-model-parallel-size", "2"}},
           {"moe_ep2_grouped", {"--expert-model-parallel-size", "2", "--moe-grouped-gemm"}},
           {"moe_tp2sp_ep2_etp2", {"--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"}}}) {
    const int np = name == "moe_tp2sp_ep2_etp2" ? 4 : 2;
    TrainRun r = train(dir_->path, name, np, concat(concat(kFp8Moe, flags), {"--train-iters", "5"}));
    ASSERT_EQ(r.losses.size(), 5u) << r.output;
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_NEAR(r.losses[i], one.losses[i], 2e-4 * one.losses[i]) << name << " iteration " << i + 1;
      EXPECT_NEAR(r.grad_norms[i], one.grad_norms[i], 3e-2 * one.grad_norms[i]) << name << " iteration " << i + 1;
    }
    EXPECT_NEAR(r.losses[0], one.losses[0], 1e-6 * one.losses[0]) << name << ": the first forward";
  }
  // After one step EP 2 holds the weights and scaling states of EP 1 on the same ranks (data
  // parallel 2 for both: the dense layers quantise alike; one process differs there in its first
  // step, Fp8Layouts says why), the experts' written by the EP ranks that hold them.
  const fs::path s1 = dir_->path / "moe_step1_ep1", s2 = dir_->path / "moe_step1_ep2";
  const std::vector<std::string> first = {"--train-iters", "2", "--exit-interval", "1"};
  train(dir_->path, "moe_step1_ep1", 2, concat(concat(kFp8Moe, first), {"--save", s1.string()}));
  train(dir_->path, "moe_step1_ep2", 2,
        concat(concat(kFp8Moe, first), {"--expert-model-parallel-size", "2", "--save", s2.string()}));
  expect_same_weights(s2, s1, "ep2 after one step");
  // and expert TP 2 (each rank a shard of each of its experts) holds what whole experts give
  const std::vector<std::string> tp2sp = {"--tensor-model-parallel-size", "2", "--sequence-parallel"};
  const fs::path e1 = dir_->path / "moe_step1_etp1", e2 = dir_->path / "moe_step1_etp2";
  train(dir_->path, "moe_step1_etp1", 4,
        concat(concat(concat(kFp8Moe, first), tp2sp), {"--expert-tensor-parallel-size", "1", "--save", e1.string()}));
  train(dir_->path, "moe_step1_etp2", 4,
        concat(concat(concat(kFp8Moe, first), tp2sp),
               {"--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--save", e2.string()}));
  expect_same_weights(e2, e1, "expert TP 2 after one step");

  const fs::path ckpt = dir_->path / "moe_resume_ep";
  train(dir_->path, "moe_resume_ep_save", 1,
        concat(kFp8Moe, {"--train-iters", "5", "--exit-interval", "3", "--save", ckpt.string()}));
  TrainRun ep2 = train(dir_->path, "moe_resume_ep2", 2,
                       concat(kFp8Moe, {"--train-iters", "5", "--expert-model-parallel-size", "2", "--load",
                                        ckpt.string()}));
  ASSERT_EQ(ep2.losses.size(), 2u) << ep2.output;
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(ep2.losses[i], one.losses[i + 3], 2e-4 * one.losses[i + 3]);
}

// --moe-router-padding-for-fp8 (Note [Routing padding for FP8]): the run trains, close to the run
// that pads inside the experts but not equal to it (the padded tokens enter the amaxes), and EP 2
// (each rank pads its own tokens' map, as one process pads each microbatch's) equals one process
// to within FP8's rounding.
TEST_F(Fp8Training, MoeRouterPaddingTrainsAndEqualsAcrossExpertParallelism) {
  TrainRun plain = train(dir_->path, "moe_nopad", 1, concat(kFp8Moe, {"--train-iters", "5"}));
  TrainRun one = train(dir_->path, "moe_pad", 1, concat(kFp8Moe, {"--train-iters", "5", "--moe-router-padding-for-fp8"}));
  ASSERT_EQ(one.losses.size(), 5u) << one.output;
  ASSERT_EQ(plain.losses.size(), 5u) << plain.output;
  EXPECT_LT(one.losses.back(), one.losses.front() - 0.05);
  double max_rel = 0;
  for (size_t i = 0; i < 5; ++i)
    max_rel = std::max(max_rel, std::abs(one.losses[i] - plain.losses[i]) / plain.losses[i]);
  std::printf("router padding: largest relative loss difference from padding in the experts %.3g\n", max_rel);
  EXPECT_GT(max_rel, 0.0);
  EXPECT_LT(max_rel, 0.02);
  TrainRun ep2 = train(dir_->path, "moe_pad_ep2", 2,
                       concat(kFp8Moe, {"--train-iters", "5", "--moe-router-padding-for-fp8",
                                        "--expert-model-parallel-size", "2", "--moe-grouped-gemm"}));
  ASSERT_EQ(ep2.losses.size(), 5u) << ep2.output;
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(ep2.losses[i], one.losses[i], 2e-4 * one.losses[i]) << "iteration " << i + 1;
}

// GPT-OSS-style experts (biases: fc1's through the FP8 GEMM's epilogue, p·b2 after it; clamped
// quick-GeGLU): the grouped form gives the sequential form's losses exactly, and EP 2 one
// process's within FP8's rounding.
TEST_F(Fp8Training, GptOssExpertsWithBiases) {
  std::vector<std::string> model;
  for (const std::string& x : kLlama)
    if (x != "--swiglu" && x != "--disable-bias-linear") model.push_back(x);
  model = fp8(concat(model, {"--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
                             "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                             "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
                             "--train-iters", "5"}),
              "delayed");
  TrainRun seq = train(dir_->path, "gptoss_seq", 1, model);
  TrainRun grouped = train(dir_->path, "gptoss_grouped", 1, concat(model, {"--moe-grouped-gemm"}));
  TrainRun ep2 = train(dir_->path, "gptoss_ep2", 2, concat(model, {"--moe-grouped-gemm", "--expert-model-parallel-size", "2"}));
  ASSERT_EQ(seq.losses.size(), 5u) << seq.output;
  ASSERT_EQ(grouped.losses.size(), 5u) << grouped.output;
  ASSERT_EQ(ep2.losses.size(), 5u) << ep2.output;
  EXPECT_LT(seq.losses.back(), seq.losses.front());
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(grouped.losses[i], seq.losses[i]) << "iteration " << i + 1;
    EXPECT_NEAR(ep2.losses[i], seq.losses[i], 2e-4 * seq.losses[i]) << "iteration " << i + 1;
  }
}

// A bf16 (here fp32) MoE checkpoint loads into an FP8 run (fresh expert scales) and an FP8 one,
// with the experts' scaling state, into a run without FP8.
TEST_F(Fp8Training, MoePlainAndFp8RunsLoadEachOthersCheckpoints) {
  std::vector<std::string> plain_model;
  for (const std::string& f : kFp8Moe) {
    if (f == "--fp8-format") break;
    plain_model.push_back(f);
  }
  const fs::path plain = dir_->path / "moe_plain_ckpt", fp8_ckpt = dir_->path / "moe_fp8_ckpt";
  TrainRun p = train(dir_->path, "moe_plain", 1, concat(plain_model, {"--train-iters", "3", "--save", plain.string()}));
  ASSERT_EQ(p.losses.size(), 3u) << p.output;
  TrainRun f = train(dir_->path, "moe_plain_to_fp8", 1,
                     concat(kFp8Moe, {"--train-iters", "5", "--load", plain.string(), "--save", fp8_ckpt.string()}));
  ASSERT_EQ(f.losses.size(), 2u) << f.output;
  for (double l : f.losses) EXPECT_TRUE(std::isfinite(l)) << f.output;
  EXPECT_FALSE(checkpoint_tensor(fp8_ckpt, "decoder.layers.3.mlp.experts.local_experts.0.linear_fc1.fp8_forward_scale")
                   .empty());
  TrainRun back = train(dir_->path, "moe_fp8_to_plain", 1,
                        concat(plain_model, {"--train-iters", "7", "--load", fp8_ckpt.string()}));
  ASSERT_EQ(back.losses.size(), 2u) << back.output;
  for (double l : back.losses) EXPECT_TRUE(std::isfinite(l)) << back.output;
}

TEST_F(Fp8Training, FirstAndLastLayersInBf16) {
  // tensorwise (the delayed recipe refuses --first-last-layers-bf16, as Megatron): with every layer
  // kept in bf16 the run is the unquantised one exactly.
  TrainRun plain = train(dir_->path, "fl_plain", 1, concat(kWide, {"--train-iters", "3"}));
  TrainRun all_bf16 = train(dir_->path, "fl_all", 1,
                            concat(kWide, {"--train-iters", "3", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                                           "--fp8-cpu-reference", "--first-last-layers-bf16",
                                           "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "2"}));
  TrainRun mixed = train(dir_->path, "fl_mixed", 1,
                         concat(kWide, {"--train-iters", "3", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                                        "--fp8-cpu-reference", "--first-last-layers-bf16"}));
  ASSERT_EQ(plain.losses.size(), 3u) << plain.output;
  ASSERT_EQ(all_bf16.losses.size(), 3u) << all_bf16.output;
  ASSERT_EQ(mixed.losses.size(), 3u) << mixed.output;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(all_bf16.losses[i], plain.losses[i]) << "iteration " << i + 1;
  EXPECT_NE(mixed.losses[2], plain.losses[2]);
}

TEST_F(Fp8Training, RefusedOnTheCpuWithoutTheReferenceFlag) {
  RunResult r = run(concat({bin("pretrain_gpt")}, concat(kGpt, {"--train-iters", "1", "--fp8-format", "e4m3"})),
                    dir_->path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--fp8-format e4m3 needs a Hopper (sm_90) or newer GPU, and this run is on the CPU"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace megatron::testing
