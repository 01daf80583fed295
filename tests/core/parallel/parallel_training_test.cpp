// Every parallel layout gives the single-process result: pretrain_gpt under mpirun with tensor,
// sequence, pipeline (1F1B and interleaved), data parallelism and the distributed optimizer, against
// one process — every iteration's loss and the final weights within 1e-6 (fp32), and checkpoints
// saved by one layout and resumed by another continuing with the same losses.
//
// The runs use mock data (--vocab-size 1000 pads to 1024 for TP 1, 2 and 4 alike), 8 layers (so
// PP 4 with 2 virtual stages divides), a global batch of 16 in microbatches of 2 (8 microbatches per
// step at DP 1, 4 at DP 2) and 5 iterations.
#include <gtest/gtest.h>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

class ParallelTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("parallel_training");
    gpt_ = new TrainRun(train_single(dir_->path, "gpt_single", kGpt));
    llama_ = new TrainRun(train_single(dir_->path, "llama_single", kLlama));
  }
  static void TearDownTestSuite() {
    delete gpt_;
    delete llama_;
    delete dir_;
  }

  // Trains `layout` for 5 iterations and compares with the single-process run.
  void check(const std::vector<std::string>& model, const TrainRun& single, const std::string& single_dir,
             const Layout& layout) {
    expect_layout_equals_single(dir_->path, model, single, single_dir, layout);
  }

  // A checkpoint saved by one layout at iteration 3 of a 5-iteration schedule (--exit-interval),
  // resumed under another: iterations 4 and 5 give the single run's losses (and aux losses), and
  // the final weights are the single run's.
  void check_reshard(const std::vector<std::string>& model, const TrainRun& single, const std::string& single_dir,
                     const Reshard& c) {
    expect_reshard_equals_single(dir_->path, dir_->path / ("reshard_" + c.name), model, single, single_dir, c);
  }

  static ScratchDir* dir_;
  static TrainRun* gpt_;
  static TrainRun* llama_;
};
ScratchDir* ParallelTraining::dir_ = nullptr;
TrainRun* ParallelTraining::gpt_ = nullptr;
TrainRun* ParallelTraining::llama_ = nullptr;

// TP ∈ {1, 2, 4} × PP ∈ {1, 2, 4} × DP ∈ {1, 2} (world <= 8), each plain and with every feature its
// layout allows: --sequence-parallel (TP > 1), --use-distributed-optimizer with overlapped gradient
// reduction in small buckets and overlapped parameter gathers (DP > 1), and interleaving with two
// virtual stages (PP > 1); plus uneven first/last pipeline stages.
std::vector<Layout> grid() {
  std::vector<Layout> out;
  for (int tp : {1, 2, 4}) {
    for (int pp : {1, 2, 4}) {
      for (int dp : {1, 2}) {
        const int np = tp * pp * dp;
        if (np > 8 || np == 1) continue;
        const std::string name = "tp" + std::to_string(tp) + "_pp" + std::to_string(pp) + "_dp" + std::to_string(dp);
        std::vector<std::string> flags = {"--tensor-model-parallel-size", std::to_string(tp),
                                          "--pipeline-model-parallel-size", std::to_string(pp)};
        out.push_back({name, np, flags});
        std::string suffix;
        if (tp > 1) flags.push_back("--sequence-parallel"), suffix += "_sp";
        if (dp > 1) {
          for (const char* f : {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                "--ddp-bucket-size", "20000"}) {
            flags.push_back(f);
          }
          suffix += "_distopt_overlap";
        }
        if (pp > 1) flags.insert(flags.end(), {"--num-layers-per-virtual-pipeline-stage", "1"}), suffix += "_vpp";
        out.push_back({name + suffix, np, flags});
      }
    }
  }
  out.push_back({"pp4_uneven_1_2_2_3", 4,
                 {"--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
                  "--decoder-last-pipeline-num-layers", "3"}});
  return out;
}

class ParallelGrid : public ParallelTraining, public ::testing::WithParamInterface<Layout> {};

TEST_P(ParallelGrid, EqualsSingleProcess) { check(kGpt, *gpt_, "gpt_single", GetParam()); }

INSTANTIATE_TEST_SUITE_P(Layouts, ParallelGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// The built-in launcher: --nproc-per-node 2 without mpirun (it runs mpirun itself for CPU ranks).
TEST_F(ParallelTraining, NprocPerNodeLauncher) {
  check(kGpt, *gpt_, "gpt_single", Layout{"nproc_per_node_2", 1, {"--nproc-per-node", "2"}});
}

// A world size the layout does not divide, and a rank that dies mid-training, end the job with a
// message (not a hang) well within the timeout.
TEST_F(ParallelTraining, BadWorldSizeAndDeadRankEndTheJob) {
  std::vector<std::string> mpirun = {"mpirun", "--oversubscribe"};
  if (::geteuid() == 0) mpirun.push_back("--allow-run-as-root");
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) { return concat(std::move(a), b); };
  const auto t0 = std::chrono::steady_clock::now();
  RunResult bad = run(with(with(mpirun, {"-np", "3", bin("pretrain_gpt")}),
                           concat(kGpt, {"--train-iters", "2", "--tensor-model-parallel-size", "2"})),
                      dir_->path);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("world size (3) is not divisible by tensor (2)"), std::string::npos)
      << bad.output;
  RunResult dead = run(with(with(mpirun, {"-np", "2", bin("pretrain_gpt")}),
                            concat(kGpt, {"--train-iters", "50", "--pipeline-model-parallel-size", "2",
                                          "--distributed-timeout-minutes", "1"})),
                       dir_->path, "MEGATRON_FAULT_INJECT=kill-rank:1:2");
  EXPECT_NE(dead.exit_code, 0) << dead.output;
  EXPECT_EQ(dead.output.find("iteration       50/"), std::string::npos) << dead.output;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 55.0) << "the failed jobs should end at once, not at the 1-minute timeout";
}

TEST_F(ParallelTraining, LlamaTP2PP2SequenceParallel) {
  check(kLlama, *llama_, "llama_single",
        Layout{"llama_tp2pp2sp", 4,
               {"--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"}});
}

TEST_F(ParallelTraining, LlamaTP2DP2DistributedOptimizer) {
  check(kLlama, *llama_, "llama_single",
        Layout{"llama_tp2dp2", 4, {"--tensor-model-parallel-size", "2", "--use-distributed-optimizer"}});
}

// --qk-layernorm (Qwen3 style): the q/k norms' weight gradients are partial sums over each rank's
// heads, reduced once per step by finalize_model_grads (Note [QK layernorm]); TP 2 × DP 2 with
// sequence parallelism, the distributed optimizer and overlapped reduction equals one process.
TEST_F(ParallelTraining, QkLayernormTP2DP2) {
  const std::vector<std::string> qwen = concat(kLlama, {"--qk-layernorm"});
  TrainRun single = train_single(dir_->path, "qk_single", qwen);
  check(qwen, single, "qk_single",
        Layout{"qk_tp2dp2_sp_distopt", 4,
               {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
                "--overlap-grad-reduce", "--ddp-bucket-size", "20000"}});
}

// DeepSeek-V3 style (Note [Multi-latent attention]): MLA with low-rank q and kv, their norms, YaRN
// on the decoupled rope channels, dense first layer then MoE with sigmoid group-limited routing, the
// expert bias and a shared expert. TP 2 with sequence parallelism (the down projections duplicated,
// their gradients all-reduced; the rope key gathered and its gradient reduce-scattered: Note [MLA
// tensor parallelism]), and TP 2 without it (MLA without MoE, one q projection), equal one process.
TEST_F(ParallelTraining, MultiLatentAttentionTP2SequenceParallel) {
  const std::vector<std::string> deepseek = concat({
      "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu",
      "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
      "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "20", "--qk-head-dim", "12",
      "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--qk-layernorm", "--rope-type", "yarn",
      "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8", "--mscale", "1",
      "--mscale-all-dim", "1", "--num-experts", "4", "--moe-layer-freq", "([0]+[1])", "--moe-ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2", "--moe-router-score-function",
      "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
      "--moe-router-topk-scaling-factor", "2.5"},
      kSmallRun);
  TrainRun single = train_single(dir_->path, "mla_single", deepseek);
  check(deepseek, single, "mla_single",
        Layout{"mla_tp2_sp", 2, {"--tensor-model-parallel-size", "2", "--sequence-parallel"}});
  // Without sequence parallelism (MoE under TP needs it, as in Megatron): MLA alone, with one q projection.
  std::vector<std::string> dense;
  for (size_t i = 0; i < deepseek.size(); ++i) {
    const std::string& f = deepseek[i];
    if (f.rfind("--moe-", 0) == 0 || f == "--num-experts" || f == "--q-lora-rank") {
      if (f != "--moe-router-enable-expert-bias") ++i;  // and its value
      continue;
    }
    dense.push_back(f);
  }
  TrainRun dense_single = train_single(dir_->path, "mla_dense_single", dense);
  check(dense, dense_single, "mla_dense_single", Layout{"mla_dense_tp2", 2, {"--tensor-model-parallel-size", "2"}});
}

// Dropout masks do not depend on the data-parallel or pipeline layout (schedules.h).
TEST_F(ParallelTraining, DropoutMatchesAcrossDataAndPipelineParallel) {
  std::vector<std::string> model = kGpt;
  for (size_t i = 0; i + 1 < model.size(); ++i) {
    if (model[i] == "--hidden-dropout" || model[i] == "--attention-dropout") model[i + 1] = "0.1";
  }
  TrainRun single = train_single(dir_->path, "dropout_single", model);
  check(model, single, "dropout_single",
        Layout{"dropout_pp2dp2", 4, {"--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"}});
}

// A checkpoint saved by one layout at iteration 3 of a 5-iteration schedule (--exit-interval) resumes
// under another with the single run's losses for iterations 4 and 5.
TEST_F(ParallelTraining, CheckpointsReshardAcrossLayouts) {
  const std::vector<Reshard> cases = {
      {"tp2pp2_to_single", 4, {"--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"}, 1, {}},
      {"single_to_tp4dp2_distopt", 1, {}, 8,
       {"--tensor-model-parallel-size", "4", "--use-distributed-optimizer"}},
      {"dp2_distopt_to_pp2_interleaved", 2, {"--use-distributed-optimizer"}, 2,
       {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"}},
      {"tp2sp_to_tp4pp2", 2, {"--tensor-model-parallel-size", "2", "--sequence-parallel"}, 8,
       {"--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"}},
  };
  for (const Reshard& c : cases) check_reshard(kGpt, *gpt_, "gpt_single", c);
}

// ---- mixture of experts --------------------------------------------------------------------------
// A small Mixtral-style model (layer 0 dense, layers 1-3 MoE: 8 experts, top-2, SwiGLU experts of
// 32, aux and z losses on): every expert layout equals one process — the loss, the grad norm and the
// load_balancing_loss of every iteration within 1e-6 relative, and the final weights.
const std::vector<std::string> kMoe = concat(
    kLlama, {"--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq",
             "([0]+[1]*3)", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"});

std::vector<Layout> moe_grid() {
  const std::vector<std::string> ep2 = {"--expert-model-parallel-size", "2"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) { return concat(std::move(a), b); };
  const std::vector<std::string> tp2sp = {"--tensor-model-parallel-size", "2", "--sequence-parallel"};
  std::vector<Layout> out;
  for (const char* d : {"alltoall", "allgather", "flex"}) {
    const std::vector<std::string> dispatcher = {"--moe-token-dispatcher-type", d};
    out.push_back({std::string("ep2_") + d, 2, with(ep2, dispatcher)});
    out.push_back({std::string("tp2sp_ep2_etp2_") + d, 4,
                   with(with(tp2sp, {"--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"}),
                        dispatcher)});
  }
  out.push_back({"ep4_alltoall", 4, {"--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"}});
  out.push_back({"ep8_alltoall", 8, {"--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall"}});
  out.push_back({"tp2sp_ep2_etp1_alltoall", 4,
                 with(tp2sp, {"--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                              "--moe-token-dispatcher-type", "alltoall"})});
  out.push_back({"ep2_pp2_vpp_alltoall", 4,
                 with(ep2, {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                            "--moe-token-dispatcher-type", "alltoall"})});
  // --moe-grouped-gemm: the same parameters through the grouped GEMM give the sequential experts' run.
  out.push_back({"grouped_gemm", 1, {"--moe-grouped-gemm", "--moe-permute-fusion"}});
  out.push_back({"ep2_grouped_gemm_alltoall", 2, with(ep2, {"--moe-grouped-gemm", "--moe-token-dispatcher-type",
                                                             "alltoall"})});
  out.push_back({"ep2_dp4_distopt_overlap", 4,
                 with(ep2, {"--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                            "--moe-token-dispatcher-type", "alltoall"})});
  return out;
}

class MoeGrid : public ParallelTraining, public ::testing::WithParamInterface<Layout> {
 protected:
  static const TrainRun& single() {
    static TrainRun* run = nullptr;
    if (!run) {
      run = new TrainRun(train_single(dir_->path, "moe_single", kMoe));
    }
    return *run;
  }
};

TEST_P(MoeGrid, EqualsSingleProcess) {
  ASSERT_EQ(single().aux.count("load_balancing_loss"), 1u) << single().output;
  check(kMoe, single(), "moe_single", GetParam());
}

INSTANTIATE_TEST_SUITE_P(MoeLayouts, MoeGrid, ::testing::ValuesIn(moe_grid()),
                         [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// ---- GPT-OSS -------------------------------------------------------------------------------------
// A small GPT-OSS-style model (biases everywhere, the router's included; learned attention sinks; a
// window on every other layer; clamped quick-GeGLU experts, 4 of them, top-2): the sinks split with
// the heads under TP, the router bias duplicated over TP with sequence parallelism, the expert biases
// over EP, and pipeline stages each equal one process.
const std::vector<std::string> kGptOss = concat(
    kLlama, {"--num-layers", "4", "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
             "7.0", "--softmax-type", "learnable", "--window-size", "7,0", "--window-attn-skip-freq", "2",
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff",
             "1e-2"});

// kLlama without --swiglu and --disable-bias-linear: GPT-OSS has biases and its own gated activation.
std::vector<std::string> gpt_oss_flags() {
  std::vector<std::string> f;
  for (const std::string& x : kGptOss)
    if (x != "--swiglu" && x != "--disable-bias-linear") f.push_back(x);
  return f;
}

class GptOssGrid : public ParallelTraining, public ::testing::WithParamInterface<Layout> {
 protected:
  static const TrainRun& single() {
    static TrainRun* run = nullptr;
    if (!run) {
      run = new TrainRun(train(dir_->path, "gpt_oss_single", 1,
                               concat(gpt_oss_flags(), {"--train-iters", "5", "--save",
                                                        (dir_->path / "gpt_oss_single").string()})));
    }
    return *run;
  }
};

TEST_P(GptOssGrid, EqualsSingleProcess) {
  ASSERT_EQ(single().aux.count("load_balancing_loss"), 1u) << single().output;
  check(gpt_oss_flags(), single(), "gpt_oss_single", GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    GptOssLayouts, GptOssGrid,
    ::testing::Values(Layout{"tp2sp_ep2_etp1_alltoall", 4,
                             {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                              "2", "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"}},
                      Layout{"ep2_grouped_gemm", 2, {"--expert-model-parallel-size", "2", "--moe-grouped-gemm"}},
                      Layout{"pp2", 2, {"--pipeline-model-parallel-size", "2"}}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// Token dropping: a capacity factor with dropping, and with padding to the capacity, over EP 2 × DP.
TEST_F(ParallelTraining, MoeCapacityDropAndPad) {
  for (const bool pad : {false, true}) {
    std::vector<std::string> model = concat(kMoe, {"--moe-expert-capacity-factor", "1.0"});
    if (pad) model.push_back("--moe-pad-expert-input-to-capacity");
    const std::string name = pad ? "moe_capacity_pad" : "moe_capacity_drop";
    TrainRun one = train(dir_->path, name + "_single", 1,
                         concat(model, {"--train-iters", "5", "--save", (dir_->path / (name + "_single")).string()}));
    check(model, one, name + "_single",
          Layout{name + "_ep2_dp4", 4,
                 {"--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", pad ? "allgather" : "alltoall"}});
  }
}

// DeepSeek-style routing: sigmoid scores, group-limited top-k, the aux-loss-free expert bias (its
// token counts summed over tp × dp before each update) and the sequence-level aux loss, TP 2 × EP 2.
TEST_F(ParallelTraining, MoeExpertBiasSeqAuxTP2EP2) {
  const std::vector<std::string> model =
      concat(kMoe, {"--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                    "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk",
                    "2", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type",
                    "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"});
  TrainRun one = train_single(dir_->path, "moe_bias_single", model);
  ASSERT_EQ(one.aux.count("seq_load_balancing_loss"), 1u) << one.output;
  const std::vector<std::string> tp2ep2 = {"--tensor-model-parallel-size", "2", "--sequence-parallel",
                                           "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                           "alltoall"};
  check(model, one, "moe_bias_single", Layout{"moe_bias_tp2sp_ep2", 4, tp2ep2});
  // The expert biases are checkpoint state: saved at iteration 3 under TP 2 × EP 2, resumed by one
  // process, the routing (and so the losses) continue as in the single run.
  check_reshard(model, one, "moe_bias_single", Reshard{"moe_bias_tp2sp_ep2_to_single", 4, tp2ep2, 1, {}});
  dist_checkpointing::ShardIndex index((dir_->path / "reshard_moe_bias_tp2sp_ep2_to_single/iter_0000003").string(),
                                       "model");
  EXPECT_TRUE(index.contains("decoder.layers.1.mlp.router.expert_bias"));
}

// Gated shared experts with --moe-shared-expert-overlap (Note [Shared experts on a side stream]):
// on the CPU the side context runs inline, so one process with the overlap has the plain run's
// losses and grad norms to the bit; TP 2 × SP × EP 2 × DP 2 with the overlap, the distributed
// optimizer and overlapped gradient reduction (the side's gradient hooks reported at the join,
// Note [Gradient hooks on the side stream]) equals the plain single process.
TEST_F(ParallelTraining, MoeSharedExpertOverlap) {
  const std::vector<std::string> model =
      concat(kMoe, {"--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate",
                    "--moe-token-dispatcher-type", "alltoall"});
  TrainRun one = train_single(dir_->path, "moe_shared_single", model);
  ASSERT_EQ(one.losses.size(), 5u) << one.output;
  TrainRun overlapped = train(dir_->path, "moe_shared_overlap_single", 1,
                              concat(model, {"--moe-shared-expert-overlap", "--train-iters", "5"}));
  EXPECT_EQ(overlapped.losses, one.losses) << overlapped.output;
  EXPECT_EQ(overlapped.grad_norms, one.grad_norms);
  check(model, one, "moe_shared_single",
        Layout{"moe_shared_overlap_tp2sp_ep2_dp2", 4,
               {"--moe-shared-expert-overlap", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--ddp-bucket-size", "20000"}});
}

// Sinkhorn routing (Note [Sinkhorn routing]: each rank balances its own microbatch's tokens, as
// one process balances each microbatch) over EP 2 × DP 4.
TEST_F(ParallelTraining, MoeSinkhornEP2) {
  const std::vector<std::string> model =
      concat(kMoe, {"--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0", "--moe-router-topk", "2"});
  TrainRun one = train_single(dir_->path, "moe_sinkhorn_single", model);
  check(model, one, "moe_sinkhorn_single",
        Layout{"moe_sinkhorn_ep2_dp4", 4, {"--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"}});
}

// The global aux loss composed with aux_loss, and the router's input jitter (Note [Global aux loss],
// Note [Router input jitter]): layouts without data parallelism give the single process — TP 2 × EP 2
// (the counts summed over the sequence shards, the jitter drawn by each shard's place in the
// sequence), interleaved PP 2, and full recomputation (the recomputed forwards reuse their counts and
// noise).
TEST_F(ParallelTraining, MoeGlobalAuxLossAndJitter) {
  const std::vector<std::string> model =
      concat(kMoe, {"--moe-router-load-balancing-type", "aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2",
                    "2e-2", "--moe-input-jitter-eps", "0.1"});
  TrainRun one = train_single(dir_->path, "moe_global_single", model);
  ASSERT_EQ(one.aux.count("global_load_balancing_loss"), 1u) << one.output;
  ASSERT_EQ(one.aux.count("load_balancing_loss"), 1u) << one.output;
  check(model, one, "moe_global_single",
        Layout{"moe_global_tp2sp_ep2_etp1", 2,
               {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"}});
  check(model, one, "moe_global_single",
        Layout{"moe_global_pp2_vpp", 2,
               {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"}});
  check(model, one, "moe_global_single",
        Layout{"moe_global_recompute_full", 1,
               {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"}});
}

// Note [Global aux loss] over data parallelism: each of dp ranks' loss is its share of the counts of
// tp × dp × cp, and the data-parallel gradient mean scales it by 1/dp (Megatron's semantics). So EP 2
// with DP d (micro-batch 2, coefficient c) is the single process with micro-batch 2d (its microbatch
// i is the union of the ranks' microbatches i, Megatron's sampler) and coefficient c/d: the same
// losses, grad norms, global_load_balancing_loss and weights.
TEST_F(ParallelTraining, MoeGlobalAuxLossDataParallel) {
  const std::vector<std::string> model =
      concat(kMoe, {"--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "2e-2"});
  for (int dp : {2, 4}) {
    const std::string name = "moe_global_dp" + std::to_string(dp);
    std::vector<std::string> single = model;
    for (size_t i = 0; i + 1 < single.size(); ++i) {
      if (single[i] == "--micro-batch-size") single[i + 1] = std::to_string(2 * dp);
    }
    single = concat(single, {"--moe-aux-loss-coeff", std::to_string(2e-2 / dp)});  // the last list occurrence wins
    TrainRun one = train(dir_->path, name + "_single", 1,
                         concat(single, {"--train-iters", "5", "--save", (dir_->path / (name + "_single")).string()}));
    ASSERT_EQ(one.aux.count("global_load_balancing_loss"), 1u) << one.output;
    std::vector<std::string> flags = {"--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"};
    if (dp == 4) flags = concat(flags, {"--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"});
    check(model, one, name + "_single", Layout{name + "_ep2", dp, flags});
  }
}

// An MoE checkpoint saved by one expert layout at iteration 3 resumes under another with the
// single run's losses.
TEST_F(ParallelTraining, MoeCheckpointsReshardAcrossExpertLayouts) {
  TrainRun one = train_single(dir_->path, "moe_reshard_single", kMoe);
  const std::vector<Reshard> cases = {
      {"tp2sp_ep2_etp2_to_ep4_distopt", 4,
       {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "2"},
       4, {"--expert-model-parallel-size", "4", "--use-distributed-optimizer"}},
      {"ep2_pp2_to_single", 4, {"--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"}, 1, {}},
  };
  for (const Reshard& c : cases) check_reshard(kMoe, one, "moe_reshard_single", c);
}

}  // namespace
}  // namespace megatron::testing
