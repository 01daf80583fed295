// Context parallelism (core/transformer/context_parallel.h) under mpirun equals one process: every
// iteration's loss and grad norm within 1e-6 relative over 5 iterations, and the final weights —
// CP 2 and 4 with each --cp-comm-type (p2p, all_gather, a2a, a2a+p2p), CP × TP × SP, CP × PP
// (interleaved), CP × DP with the distributed optimizer and overlapped reduction, full
// recomputation, learned positions (GPT) and RoPE with GQA (Llama; and with YaRN's scaling, whose
// angle rows each rank takes for its chunks and whose factor scales cos/sin), an MoE model with EP, and
// packed documents (--reset-attention-mask --reset-position-ids --eod-mask-loss) with each comm
// type; learned attention sinks with every comm type; multi-latent attention (keys of qk + pe channels,
// values of dv; YaRN on the rope channels) with every comm type and CP × TP × SP; a CP checkpoint resumes without CP (and the
// reverse) with the single run's losses.
// Sequences of 32 positions: CP 2 cuts them into 4 chunks of 8, CP 4 into 8 chunks of 4.
#include <gtest/gtest.h>

#include "tests/core/parallel/parallel_util.h"

namespace megatron::testing {
namespace {

struct CpLayout {
  std::string model;  // a key of model_flags
  std::string name;
  int np;
  std::vector<std::string> flags;
};

// Packed documents: the mock data's documents run across sequences, each ending with an EOD; micro-batch 1
// (Megatron's THD format under CP).
const std::vector<std::string> kPacked =
    concat(kLlama, {"--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--micro-batch-size", "1",
                    "--global-batch-size", "8"});
const std::vector<std::string> kCpMoe =
    concat(kLlama, {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff",
                    "1e-2", "--moe-z-loss-coeff", "1e-3"});

// YaRN x4 over an original context of 8 positions (the ramp covers pairs 0..2 of 8).
const std::vector<std::string> kYarn = concat(kLlama, {"--position-embedding-type", "yarn", "--rotary-scaling-factor",
                                                       "4", "--yarn-original-max-position-embeddings", "8"});

// Learned attention sinks (Note [Attention sinks]): folded into each rank's merged rows.
const std::vector<std::string> kSinks = concat(kLlama, {"--softmax-type", "learnable"});
// A sliding window of 6 positions on layers 1 and 3 (Note [Sliding-window attention]): it crosses the
// chunk boundaries (chunks of 8 at CP 2, of 4 at CP 4), so some blocks hold rows that see no key.
const std::vector<std::string> kWindow = concat(kLlama, {"--window-size", "5,0", "--window-attn-skip-freq", "2"});
const std::vector<std::string> kPackedWindow = concat(kPacked, {"--window-size", "5,0"});

// Multi-latent attention (Note [MLA context parallelism]): DeepSeek-V3's shape in small, dense.
const std::vector<std::string> kMla = concat({
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "20", "--qk-head-dim", "12",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8", "--mscale", "1",
    "--mscale-all-dim", "1"},
    kSmallRun);

const std::vector<std::string>& model_flags(const std::string& m) {
  if (m == "gpt") return kGpt;
  if (m == "mla") return kMla;
  if (m == "sinks") return kSinks;
  if (m == "window") return kWindow;
  if (m == "packed_window") return kPackedWindow;
  if (m == "yarn") return kYarn;
  if (m == "packed") return kPacked;
  if (m == "moe") return kCpMoe;
  return kLlama;
}

std::vector<std::string> cp(int n, const std::string& type) {
  std::vector<std::string> f = {"--context-parallel-size", std::to_string(n), "--cp-comm-type", type};
  if (type == "a2a+p2p") f.insert(f.end(), {"--hierarchical-context-parallel-sizes", "2", std::to_string(n / 2)});
  return f;
}

class ContextParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("context_parallel");
    for (const char* m : {"llama", "gpt", "packed", "moe", "yarn", "sinks", "window", "packed_window", "mla"}) {
      singles_[m] = train_single(dir_->path, std::string(m) + "_single", model_flags(m));
    }
  }
  static void TearDownTestSuite() {
    singles_.clear();
    delete dir_;
  }
  static ScratchDir* dir_;
  static std::map<std::string, TrainRun> singles_;
};
ScratchDir* ContextParallel::dir_ = nullptr;
std::map<std::string, TrainRun> ContextParallel::singles_;

std::vector<CpLayout> layouts() {
  std::vector<CpLayout> out;
  for (const char* t : {"p2p", "all_gather", "a2a"}) out.push_back({"llama", std::string("cp2_") + t, 2, cp(2, t)});
  for (const char* t : {"p2p", "all_gather", "a2a"}) out.push_back({"sinks", std::string("cp2_sinks_") + t, 2, cp(2, t)});
  out.push_back({"sinks", "cp4_sinks_a2a+p2p", 4, cp(4, "a2a+p2p")});
  for (const char* t : {"p2p", "all_gather", "a2a"}) out.push_back({"mla", std::string("cp2_") + t, 2, cp(2, t)});
  out.push_back({"mla", "cp4_a2a+p2p", 4, cp(4, "a2a+p2p")});
  out.push_back({"mla", "cp2_tp2_sp", 4, concat(cp(2, "p2p"), {"--tensor-model-parallel-size", "2", "--sequence-parallel"})});
  out.push_back({"mla", "cp2_a2a_tp2_sp", 4,
                 concat(cp(2, "a2a"), {"--tensor-model-parallel-size", "2", "--sequence-parallel"})});
  out.push_back({"mla", "cp2_all_gather_recompute_selective", 2,
                 concat(cp(2, "all_gather"), {"--recompute-granularity", "selective"})});
  for (const char* t : {"p2p", "all_gather", "a2a"}) out.push_back({"window", std::string("cp2_") + t, 2, cp(2, t)});
  out.push_back({"window", "cp4_a2a+p2p", 4, cp(4, "a2a+p2p")});
  out.push_back({"window", "cp4_p2p", 4, cp(4, "p2p")});
  for (const char* t : {"p2p", "all_gather", "a2a"})
    out.push_back({"packed_window", std::string("cp2_") + t, 2, cp(2, t)});
  for (const char* t : {"p2p", "all_gather", "a2a+p2p"}) out.push_back({"llama", std::string("cp4_") + t, 4, cp(4, t)});
  out.push_back({"llama", "cp2_tp2_sp", 4, concat(cp(2, "p2p"), {"--tensor-model-parallel-size", "2", "--sequence-parallel"})});
  out.push_back({"llama", "cp2_pp2_vpp", 4,
                 concat(cp(2, "p2p"), {"--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"})});
  out.push_back({"llama", "cp2_dp2_distopt_overlap", 4,
                 concat(cp(2, "p2p"), {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                       "--ddp-bucket-size", "20000"})});
  out.push_back({"llama", "cp2_all_gather_recompute_full", 2,
                 concat(cp(2, "all_gather"), {"--recompute-granularity", "full", "--recompute-method", "uniform",
                                              "--recompute-num-layers", "1"})});
  out.push_back({"llama", "cp2_a2a_recompute_selective", 2,
                 concat(cp(2, "a2a"), {"--recompute-granularity", "selective"})});
  out.push_back({"yarn", "cp2_p2p", 2, cp(2, "p2p")});
  out.push_back({"yarn", "cp2_a2a", 2, cp(2, "a2a")});
  out.push_back({"yarn", "cp4_all_gather", 4, cp(4, "all_gather")});
  out.push_back({"gpt", "cp2_p2p", 2, cp(2, "p2p")});
  out.push_back({"gpt", "cp4_a2a", 4, cp(4, "a2a")});
  for (const char* t : {"p2p", "all_gather", "a2a"}) out.push_back({"packed", std::string("cp2_") + t, 2, cp(2, t)});
  out.push_back({"packed", "cp4_a2a+p2p", 4, cp(4, "a2a+p2p")});
  out.push_back({"packed", "cp2_dp2_p2p", 4, concat(cp(2, "p2p"), {"--use-distributed-optimizer"})});
  out.push_back({"moe", "cp2_ep2_alltoall", 2,
                 concat(cp(2, "p2p"), {"--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"})});
  return out;
}

class ContextParallelGrid : public ContextParallel, public ::testing::WithParamInterface<CpLayout> {};

TEST_P(ContextParallelGrid, EqualsSingleProcess) {
  const CpLayout& l = GetParam();
  const TrainRun& single = singles_.at(l.model);
  ASSERT_EQ(single.losses.size(), 5u) << single.output;
  const std::string name = l.model + "_" + l.name;
  const fs::path save = dir_->path / name;
  TrainRun r = train(dir_->path, name, l.np, concat(concat(model_flags(l.model), l.flags), {"--train-iters", "5", "--save", save.string()}));
  expect_close(r.losses, single.losses, name + " loss");
  expect_close(r.grad_norms, single.grad_norms, name + " grad norm");
  for (const auto& [aux, values] : single.aux) expect_close(r.aux[aux], values, name + " " + aux);
  expect_same_weights(save, dir_->path / (l.model + "_single"), name);
  std::printf("%s: 5 iterations, final loss %.6f (single %.6f)\n", name.c_str(), r.losses.empty() ? 0.0 : r.losses.back(),
              single.losses.back());
}

INSTANTIATE_TEST_SUITE_P(Layouts, ContextParallelGrid, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<CpLayout>& info) {
                           std::string n = info.param.model + "_" + info.param.name;
                           for (char& c : n)
                             if (c == '+') c = '_';
                           return n;
                         });

// Saved at iteration 3 under one layout, resumed under another: iterations 4 and 5 give the
// single run's losses and the final weights are its.
TEST_F(ContextParallel, CheckpointsReshardBetweenCpAndNoCp) {
  struct Case {
    std::string name, model;
    int np_save;
    std::vector<std::string> save;
    int np_load;
    std::vector<std::string> load;
  };
  const std::vector<Case> cases = {
      {"cp2_to_none", "llama", 2, cp(2, "p2p"), 1, {}},
      {"none_to_cp4_a2a_p2p", "llama", 1, {}, 4, cp(4, "a2a+p2p")},
      {"packed_cp2_to_tp2", "packed", 2, cp(2, "all_gather"), 2, {"--tensor-model-parallel-size", "2"}},
  };
  for (const Case& c : cases) {
    const fs::path ckpt = dir_->path / ("reshard_" + c.name);
    const std::vector<std::string>& m = model_flags(c.model);
    train(dir_->path, c.name + "_save", c.np_save,
          concat(concat(m, c.save), {"--train-iters", "5", "--exit-interval", "3", "--save", ckpt.string()}));
    TrainRun resumed = train(dir_->path, c.name + "_load", c.np_load,
                             concat(concat(m, c.load), {"--train-iters", "5", "--load", ckpt.string(), "--save", ckpt.string()}));
    expect_close(resumed.losses, singles_.at(c.model).losses, c.name, 3);
    expect_same_weights(ckpt, dir_->path / (c.model + "_single"), c.name);
  }
}

// One line each: a sequence not divisible by 2 x CP, a2a with heads that do not divide, packed
// sequences with micro-batch 2 under CP, a2a+p2p without its level sizes.
TEST_F(ContextParallel, BadLayoutsAreOneLine) {
  struct Bad {
    std::vector<std::string> flags;
    int np;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {concat(kLlama, {"--context-parallel-size", "2", "--seq-length", "30", "--max-position-embeddings", "32"}), 2,
       "must be divisible by 2 x --context-parallel-size (4)"},
      {concat(kLlama, cp(4, "a2a")), 4, "--cp-comm-type a2a splits the heads over 4 ranks"},
      {concat(kLlama, {"--context-parallel-size", "2", "--reset-attention-mask"}), 2, "needs --micro-batch-size 1"},
      {concat(kLlama, {"--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"}), 4,
       "needs --hierarchical-context-parallel-sizes A P"},
      {concat(kLlama, {"--context-parallel-size", "2", "--cp-comm-type", "ring"}), 2, "--cp-comm-type"},
  };
  for (const Bad& b : cases) {
    std::vector<std::string> argv = {"mpirun", "-np", std::to_string(b.np), "--oversubscribe"};
    if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
    argv.push_back(bin("pretrain_gpt"));
    argv.insert(argv.end(), b.flags.begin(), b.flags.end());
    argv.insert(argv.end(), {"--train-iters", "1"});
    RunResult r = run(argv, dir_->path, "OMP_NUM_THREADS=1");
    EXPECT_NE(r.exit_code, 0) << b.message;
    EXPECT_NE(r.output.find(b.message), std::string::npos) << "expected '" << b.message << "' in:\n" << r.output;
  }
}

}  // namespace
}  // namespace megatron::testing
