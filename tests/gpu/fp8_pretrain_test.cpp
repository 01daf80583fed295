// pretrain_gpt with FP8 GEMMs on the GPU (Llama-style, hidden 128 so that every recipe applies):
// for each recipe, fp32 on CUDA against the CPU reference of the FP8 ops (--fp8-cpu-reference) —
// the same quantisation rules, so the losses agree to the GEMMs' accumulation order — and bf16
// trains with falling losses near the unquantised bf16 run's; the FP8 state survives a
// checkpoint (a resumed run continues with the uninterrupted run's losses); an MoE model's FP8
// experts likewise match the CPU reference.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/runtime/allocator.h"
#include "tests/gpu/pretrain_run_util.h"

namespace megatron::testing {
namespace {

const std::vector<std::string> kLlama = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "256", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size",
    "16", "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--split", "100,0,0"};

std::vector<double> train(const fs::path& dir, const std::string& name, const std::vector<std::string>& extra,
                          const std::string& device, size_t iterations) {
  const std::vector<std::string> argv = with(with({bin("pretrain_gpt")}, kLlama), with({"--device", device}, extra));
  if (device == "cuda") return run_losses(dir, name, argv, "", iterations);
  const fs::path log = dir / (name + ".jsonl");
  RunResult r = run(argv, dir, "MEGATRON_LOSS_LOG=" + shell_quote(log.string()));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  std::vector<double> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("lm_loss").get<double>());
  return out;
}

TEST(Fp8PretrainGpu, Fp32OnCudaMatchesTheCpuReference) {
  if (cuda_device_count() == 0 || cuda_compute_capability(0) < 90) GTEST_SKIP() << "no Hopper GPU";
  ScratchDir dir("fp8_pretrain_fp32");
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    const std::vector<std::string> f = {"--train-iters", "4", "--fp8-format", "hybrid", "--fp8-recipe", recipe};
    const auto cpu = train(dir.path, std::string("cpu_") + recipe, with(f, {"--fp8-cpu-reference"}), "cpu", 4);
    const auto cuda = train(dir.path, std::string("cuda_") + recipe, f, "cuda", 4);
    std::printf("fp8 %s fp32: cpu %.6f %.6f, cuda %.6f %.6f\n", recipe, cpu.front(), cpu.back(), cuda.front(),
                cuda.back());
    expect_losses_close(cuda, cpu, 2e-3, std::string("fp8 ") + recipe + " cuda vs cpu");
  }
}

TEST(Fp8PretrainGpu, Bf16TrainsNearTheUnquantisedRun) {
  if (cuda_device_count() == 0 || cuda_compute_capability(0) < 90) GTEST_SKIP() << "no Hopper GPU";
  ScratchDir dir("fp8_pretrain_bf16");
  const std::vector<std::string> f = {"--train-iters", "10", "--bf16"};
  const auto bf16 = train(dir.path, "bf16", f, "cuda", 10);
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    const auto fp8 = train(dir.path, std::string("fp8_") + recipe,
                           with(f, {"--fp8-format", "hybrid", "--fp8-recipe", recipe}), "cuda", 10);
    ASSERT_EQ(fp8.size(), 10u);
    for (double l : fp8) EXPECT_TRUE(std::isfinite(l)) << recipe;
    EXPECT_LT(fp8.back(), fp8.front() - 0.1) << recipe;
    expect_losses_close(fp8, bf16, 3e-2, std::string("fp8 ") + recipe + " vs bf16");
  }
}

TEST(Fp8PretrainGpu, ResumesWithItsScalingState) {
  if (cuda_device_count() == 0 || cuda_compute_capability(0) < 90) GTEST_SKIP() << "no Hopper GPU";
  ScratchDir dir("fp8_pretrain_resume");
  const std::vector<std::string> f = {"--train-iters", "6", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                      "--fp8-amax-history-len", "8", "--deterministic-mode"};
  const auto whole = train(dir.path, "whole", f, "cuda", 6);
  ASSERT_EQ(whole.size(), 6u);
  const std::string ckpt = (dir.path / "ckpt").string();
  train(dir.path, "first", with(f, {"--exit-interval", "3", "--save", ckpt}), "cuda", 3);
  const auto rest = train(dir.path, "rest", with(f, {"--load", ckpt}), "cuda", 3);
  ASSERT_EQ(rest.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest[i], whole[i + 3]) << "iteration " << i + 4;
}

// Note [FP8 experts] on the GPU: an MoE model (layer 0 dense, then 4 SwiGLU experts of 128, top-2,
// and a shared expert of 128) in fp32 on CUDA against the CPU reference for each recipe — the
// experts' row counts are not multiples of 16, so the padding path runs, and the grouped form
// (Note [Grouped FP8 linear layers]: grouped quantisation passes with padded transposed blocks;
// blockwise: the per-expert loop); with --moe-router-padding-for-fp8 (alltoall) too — and in bf16
// it trains with falling losses.
TEST(Fp8PretrainGpu, MoeExpertsMatchTheCpuReference) {
  if (cuda_device_count() == 0 || cuda_compute_capability(0) < 90) GTEST_SKIP() << "no Hopper GPU";
  ScratchDir dir("fp8_pretrain_moe");
  const std::vector<std::string> moe = {"--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                                        "128", "--moe-shared-expert-intermediate-size", "128", "--moe-layer-freq",
                                        "([0]+[1]*3)", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type",
                                        "alltoall", "--fp8-format", "hybrid"};
  struct Case {
    std::string name;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"delayed", {"--fp8-recipe", "delayed"}},
      {"tensorwise", {"--fp8-recipe", "tensorwise"}},
      {"blockwise", {"--fp8-recipe", "blockwise"}},
      {"delayed_grouped", {"--fp8-recipe", "delayed", "--moe-grouped-gemm"}},
      {"tensorwise_grouped", {"--fp8-recipe", "tensorwise", "--moe-grouped-gemm"}},
      {"blockwise_grouped", {"--fp8-recipe", "blockwise", "--moe-grouped-gemm"}},
      {"delayed_router_padding", {"--fp8-recipe", "delayed", "--moe-router-padding-for-fp8"}},
      // the experts' (and every FP8 layer's) weights as FP8 parameters (Note [FP8 parameters])
      {"tensorwise_param_gather", {"--fp8-recipe", "tensorwise", "--use-distributed-optimizer", "--fp8-param-gather"}},
      {"blockwise_param_gather", {"--fp8-recipe", "blockwise", "--use-distributed-optimizer", "--fp8-param-gather"}}};
  for (const Case& c : cases) {
    const std::vector<std::string> f = with(with(moe, c.flags), {"--train-iters", "4"});
    const auto cpu = train(dir.path, "moe_cpu_" + c.name, with(f, {"--fp8-cpu-reference"}), "cpu", 4);
    const auto cuda = train(dir.path, "moe_cuda_" + c.name, f, "cuda", 4);
    ASSERT_EQ(cuda.size(), 4u) << c.name;
    std::printf("fp8 moe %s fp32: cpu %.6f %.6f, cuda %.6f %.6f\n", c.name.c_str(), cpu.front(), cpu.back(),
                cuda.front(), cuda.back());
    expect_losses_close(cuda, cpu, 2e-3, "fp8 moe " + c.name + " cuda vs cpu");
  }
  const auto bf16 = train(dir.path, "moe_bf16", with(with(moe, {"--fp8-recipe", "delayed", "--bf16"}),
                                                    {"--train-iters", "10"}), "cuda", 10);
  ASSERT_EQ(bf16.size(), 10u);
  EXPECT_LT(bf16.back(), bf16.front() - 0.1);
}

// --fp8-param-gather on the GPU (Note [FP8 parameters]): the fp8 buffer, the shard quantisation and
// the byte transpose on CUDA. fp32 on CUDA against the CPU reference with the flag, as above; bf16
// with the flag against bf16 without it, within the flag's rounding (fp32 -> fp8 instead of
// through bf16); and a resumed run with the flag continues exactly. For each recipe (blockwise: the
// shards' tile amaxes and the tile grid's transpose on CUDA).
TEST(Fp8PretrainGpu, ParamGatherMatchesTheCpuReferenceAndTheRunWithoutIt) {
  if (cuda_device_count() == 0 || cuda_compute_capability(0) < 90) GTEST_SKIP() << "no Hopper GPU";
  ScratchDir dir("fp8_pretrain_param_gather");
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    const std::vector<std::string> f = {"--fp8-format", "hybrid", "--fp8-recipe", recipe, "--use-distributed-optimizer",
                                        "--deterministic-mode"};
    const std::vector<std::string> pg = with(f, {"--fp8-param-gather"});
    const auto cpu = train(dir.path, std::string("pg_cpu_") + recipe,
                           with(pg, {"--train-iters", "4", "--fp8-cpu-reference"}), "cpu", 4);
    const auto cuda = train(dir.path, std::string("pg_cuda_") + recipe, with(pg, {"--train-iters", "4"}), "cuda", 4);
    expect_losses_close(cuda, cpu, 2e-3, std::string("fp8 param gather ") + recipe + " cuda vs cpu");
    const std::vector<std::string> bf16 = {"--train-iters", "6", "--bf16"};
    const auto with_flag = train(dir.path, std::string("pg_bf16_") + recipe, with(pg, bf16), "cuda", 6);
    const auto without = train(dir.path, std::string("nopg_bf16_") + recipe, with(f, bf16), "cuda", 6);
    std::printf("fp8 param gather %s bf16: %.6f .. %.6f, without %.6f .. %.6f\n", recipe, with_flag.front(),
                with_flag.back(), without.front(), without.back());
    expect_losses_close(with_flag, without, 5e-3, std::string("fp8 param gather ") + recipe + " vs without");
    const std::string ckpt = (dir.path / (std::string("ckpt_") + recipe)).string();
    train(dir.path, std::string("pg_first_") + recipe, with(with(pg, bf16), {"--exit-interval", "3", "--save", ckpt}),
          "cuda", 3);
    const auto rest = train(dir.path, std::string("pg_rest_") + recipe, with(with(pg, bf16), {"--load", ckpt}), "cuda", 3);
    ASSERT_EQ(rest.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest[i], with_flag[i + 3]) << recipe << " iteration " << i + 4;
  }
}

}  // namespace
}  // namespace megatron::testing
