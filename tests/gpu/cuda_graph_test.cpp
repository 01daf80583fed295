// CUDA graphs: the runtime's capture and replay (runtime/cuda_graph.h, Note [Allocation under
// capture]) and the full-iteration training graph (core/full_cuda_graph.h) against the eager step:
// the same kernels on the same values, so the same bits — every iteration's loss and gradient norm
// must be equal, in fp32, bf16, fp16 with the dynamic loss scaler, with dropout, for a Llama-style
// model, for MoE with the shared experts on the side stream, and when the number of microbatches
// changes under batch-size ramp-up (a second capture).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/cuda_graph.h"
#include "megatron/runtime/philox.h"
#include "tests/gpu/pretrain_run_util.h"

namespace megatron::testing {
namespace {

bool have_gpu() { return cuda_device_count() > 0; }

Tensor filled(const Shape& shape, uint64_t seed, Device device) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(int64_t(philox_element(seed, 0, i) % 2001) - 1000) / 1000.0f;
  return Tensor::from_floats(v, shape, DType::Float32, device);
}

// y = 2·(x·Wᵀ) + zeros, through a temporary allocated, zero-filled and copied inside the capture.
void body(Context& ctx, const Tensor& x, const Tensor& w, Tensor& y) {
  Tensor t = Tensor::empty({x.size(0), w.size(0)}, DType::Float32, ctx.device());
  ops::linear_forward(ctx, x, w, Tensor(), t);
  Tensor z = Tensor::zeros(t.shape(), DType::Float32, ctx.device());
  Tensor u = Tensor::empty(t.shape(), DType::Float32, ctx.device());
  u.copy_from(t);
  ops::add(ctx, u, t, u);
  ops::add(ctx, u, z, y);
}

TEST(CudaGraph, ReplaysWhatWasCapturedOnNewInputs) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  Context ctx(Device::cuda(0));
  Tensor x = filled({67, 40}, 1, ctx.device()), w = filled({24, 40}, 2, ctx.device());
  Tensor y = Tensor::empty({67, 24}, DType::Float32, ctx.device());
  body(ctx, x, w, y);  // eager first: cuBLASLt's plan and workspace exist before the capture
  CudaGraph graph;
  graph.capture(ctx, [&] { body(ctx, x, w, y); });
  ASSERT_TRUE(graph.captured());
  for (uint64_t k = 0; k < 3; ++k) {
    x.copy_from(filled({67, 40}, 10 + k, Device::cpu()));
    y.zero_();
    graph.replay(ctx);
    Tensor want = Tensor::empty({67, 24}, DType::Float32, ctx.device());
    body(ctx, x, w, want);
    EXPECT_EQ(y.to_floats(), want.to_floats()) << "launch " << k;
  }
  EXPECT_GT(CudaGraph::memory_bytes(ctx.device()), 0u);
}

TEST(CudaGraph, WhatCannotBeCapturedFailsWithAReasonAndLeavesTheContextUsable) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  Context ctx(Device::cuda(0));
  Tensor x = filled({8, 16}, 3, ctx.device()), w = filled({4, 16}, 4, ctx.device());
  Tensor y = Tensor::empty({8, 4}, DType::Float32, ctx.device());
  body(ctx, x, w, y);
  const std::vector<float> want = y.to_floats();
  CudaGraph graph;
  std::string e = error_of([&] { graph.capture(ctx, [&] { ctx.synchronize(); }); });
  EXPECT_NE(e.find("must not synchronise"), std::string::npos) << e;
  e = error_of([&] { graph.capture(ctx, [&] { (void)x.to(Device::cpu()); }); });
  EXPECT_NE(e.find("cannot be captured in a CUDA graph"), std::string::npos) << e;
  Tensor kept;
  e = error_of([&] { graph.capture(ctx, [&] { kept = Tensor::zeros({4}, DType::Float32, ctx.device()); }); });
  EXPECT_NE(e.find("outlive it"), std::string::npos) << e;
  kept = Tensor();
  EXPECT_FALSE(graph.captured());
  EXPECT_FALSE(ctx.capturing());
  y.zero_();
  body(ctx, x, w, y);
  EXPECT_EQ(y.to_floats(), want);
}

const std::vector<std::string> kModel = {
    "--num-layers", "3", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
    "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
    "--eval-iters", "0", "--seed", "7", "--device", "cuda", "--split", "100,0,0"};
const std::vector<std::string> kGraph = {"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration",
                                         "--cuda-graph-warmup-steps", "2"};

struct LoggedRun {
  std::vector<std::string> lines;  // each iteration's {loss, grad norm} as logged (17 digits)
  std::string output;
};

LoggedRun run_logged(const fs::path& dir, const std::string& name, const std::vector<std::string>& argv) {
  const fs::path log = dir / (name + ".jsonl");
  RunResult r = run(argv, dir, "MEGATRON_LOSS_LOG=" + shell_quote(log.string()));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  LoggedRun out{{}, r.output};
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    out.lines.push_back(fmt::format("{:.17g} {:.17g}", j.at("lm_loss").get<double>(), j.at("grad_norm").get<double>()));
  }
  return out;
}

std::vector<std::string> validation_lines(const std::string& output) {
  std::vector<std::string> v;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line))
    if (line.find("lm loss value") != std::string::npos) v.push_back(line);
  return v;
}

void expect_graph_is_eager(const std::string& name, const std::vector<std::string>& extra, size_t iterations) {
  ScratchDir dir(name);
  const auto argv = with(with({bin("pretrain_gpt")}, kModel), extra);
  const LoggedRun eager = run_logged(dir.path, "eager", argv);
  const LoggedRun graph = run_logged(dir.path, "graph", with(argv, kGraph));
  EXPECT_NE(graph.output.find("CUDA graph: the forward and backward passes"), std::string::npos) << graph.output;
  ASSERT_EQ(eager.lines.size(), iterations) << eager.output;
  EXPECT_EQ(graph.lines, eager.lines) << graph.output;
  EXPECT_EQ(validation_lines(graph.output), validation_lines(eager.output));
  const bool evaluates = std::find(extra.begin(), extra.end(), "--eval-interval") != extra.end();
  if (evaluates) EXPECT_FALSE(validation_lines(eager.output).empty()) << eager.output;
}

TEST(FullCudaGraph, Fp32StepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_fp32", {"--train-iters", "6"}, 6);
}

TEST(FullCudaGraph, Bf16StepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_bf16", {"--train-iters", "6", "--bf16"}, 6);
}

// The loss scale lives on the device: skipped steps while the dynamic scale falls from 2^40 must be
// the eager run's, and so must the steps after them.
TEST(FullCudaGraph, Fp16DynamicLossScaleFollowsTheEagerRun) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_fp16", {"--train-iters", "8", "--fp16", "--initial-loss-scale", "1099511627776"}, 8);
}

TEST(FullCudaGraph, LlamaStyleBf16StepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_llama",
                        {"--train-iters", "6", "--bf16", "--swiglu", "--normalization", "RMSNorm",
                         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
                         "--disable-bias-linear", "--untie-embeddings-and-output-weights"},
                        6);
}

// Dropout draws the eager step's masks at every launch (Note [Random offsets under CUDA graphs]):
// our kernels in fp32, cuDNN's dropout in bf16; evaluation between the steps runs eagerly.
const std::vector<std::string> kDropout = {"--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters",
                                           "7", "--eval-interval", "3", "--eval-iters", "2", "--split", "90,10,0"};

TEST(FullCudaGraph, Fp32DropoutStepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_dropout_fp32", kDropout, 7);
}

TEST(FullCudaGraph, Bf16DropoutStepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_dropout_bf16", with(kDropout, {"--bf16"}), 7);
}

// Ramp-up from 8 to 16 samples a step: two and then four microbatches, so two captures.
TEST(FullCudaGraph, BatchSizeRampUpCapturesAgain) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  expect_graph_is_eager("graph_rampup", {"--train-samples", "128", "--rampup-batch-size", "8", "8", "64"}, 12);
}

// MoE with the shared experts on the side stream (--moe-shared-expert-overlap; Note [Side stream]):
// the fork and join inside the captured step, and the eager overlapped step against the plain one,
// all to the last bit. Drop-and-pad keeps the rows per expert fixed (the dropless layer reads its
// counts back to the host, which no capture allows).
TEST(FullCudaGraph, MoeSharedExpertOverlapStepsEqualTheEagerSteps) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  ScratchDir dir("graph_moe_shared_overlap");
  const auto plain = with(with({bin("pretrain_gpt")}, kModel),
                          {"--train-iters", "6", "--bf16", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
                           "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-router-load-balancing-type",
                           "none", "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
                           "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size", "512"});
  const auto overlapped = with(plain, {"--moe-shared-expert-overlap"});
  const LoggedRun eager = run_logged(dir.path, "plain", plain);
  const LoggedRun side = run_logged(dir.path, "overlap", overlapped);
  const LoggedRun graph = run_logged(dir.path, "overlap_graph", with(overlapped, kGraph));
  ASSERT_EQ(eager.lines.size(), 6u) << eager.output;
  EXPECT_EQ(side.lines, eager.lines) << side.output;
  EXPECT_NE(graph.output.find("CUDA graph: the forward and backward passes"), std::string::npos) << graph.output;
  EXPECT_EQ(graph.lines, eager.lines) << graph.output;
}

// --deterministic-mode at a shape where cuDNN's default attention backward varies in its last bits
// from run to run: two eager runs and a graph run give the same losses and gradient norms.
TEST(DeterministicMode, SameBitsEveryRunEagerOrGraph) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  ScratchDir dir("deterministic");
  const auto argv = with({bin("pretrain_gpt")},
                         {"--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length",
                          "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "4",
                          "--global-batch-size", "8", "--lr", "1e-3", "--vocab-size", "4000", "--mock-data",
                          "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters",
                          "0", "--seed", "7", "--device", "cuda", "--split", "100,0,0", "--train-iters", "6", "--bf16",
                          "--deterministic-mode"});
  const LoggedRun first = run_logged(dir.path, "first", argv);
  const LoggedRun second = run_logged(dir.path, "second", argv);
  const LoggedRun graph = run_logged(dir.path, "graph", with(argv, kGraph));
  ASSERT_EQ(first.lines.size(), 6u) << first.output;
  EXPECT_EQ(second.lines, first.lines);
  EXPECT_EQ(graph.lines, first.lines);
}

}  // namespace
}  // namespace megatron::testing
