// pretrain_gpt training a small Mixtral-style model on the GPU (RoPE, RMSNorm, SwiGLU experts, 8
// experts top-2, aux and z losses, the alltoall dispatcher at one rank): fp32 on CUDA gives the CPU
// run's losses; the grouped GEMM gives the sequential experts' losses; bf16 trains (finite, falling
// losses near fp32's); token dropping (dropping and padding), the global aux loss and the input
// jitter give the CPU run's losses; the fp64 router is refused at start-up with one line.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/runtime/device.h"
#include "tests/gpu/pretrain_run_util.h"

namespace megatron::testing {
namespace {

const std::vector<std::string> kMixtral = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
    "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval",
    "1", "--eval-iters", "0", "--train-iters", "6", "--seed", "7", "--split", "100,0,0", "--num-experts", "8",
    "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff",
    "1e-3", "--moe-token-dispatcher-type", "alltoall"};

std::vector<double> train(const fs::path& dir, const std::string& name, const std::vector<std::string>& extra,
                          const std::string& device = "cuda") {
  const std::vector<std::string> argv = with(with({bin("pretrain_gpt")}, kMixtral), with({"--device", device}, extra));
  if (device == "cuda") return run_losses(dir, name, argv, "", 6);
  const fs::path log = dir / (name + ".jsonl");
  RunResult r = run(argv, dir, "MEGATRON_LOSS_LOG=" + shell_quote(log.string()));
  EXPECT_EQ(r.exit_code, 0) << name << ":\n" << r.output;
  std::vector<double> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("lm_loss").get<double>());
  return out;
}

TEST(MoePretrainGpu, Fp32MatchesTheCpuAndGroupedMatchesSequential) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  ScratchDir dir("moe_pretrain_fp32");
  const auto cpu = train(dir.path, "cpu", {}, "cpu");
  const auto cuda = train(dir.path, "cuda", {});
  expect_losses_close(cuda, cpu, 1e-4, "fp32 cuda vs cpu");
  const auto grouped = train(dir.path, "cuda_grouped", {"--moe-grouped-gemm", "--moe-permute-fusion"});
  expect_losses_close(grouped, cuda, 1e-6, "grouped vs sequential (fp32)");
}

TEST(MoePretrainGpu, Bf16Trains) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  ScratchDir dir("moe_pretrain_bf16");
  const auto fp32 = train(dir.path, "fp32", {"--moe-grouped-gemm"});
  const auto bf16 = train(dir.path, "bf16", {"--bf16", "--moe-grouped-gemm"});
  ASSERT_EQ(bf16.size(), 6u);
  for (double l : bf16) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(bf16.back(), bf16.front());
  expect_losses_close(bf16, fp32, 2e-2, "bf16 vs fp32");
  const auto sequential = train(dir.path, "bf16_sequential", {"--bf16"});
  expect_losses_close(sequential, bf16, 1e-6, "grouped vs sequential (bf16)");
}

TEST(MoePretrainGpu, TokenDroppingGlobalAuxAndJitterMatchTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  ScratchDir dir("moe_pretrain_router_options");
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"capacity_drop", {"--moe-expert-capacity-factor", "1.0"}},
      {"capacity_pad_position",
       {"--moe-expert-capacity-factor", "1.25", "--moe-token-drop-policy", "position",
        "--moe-pad-expert-input-to-capacity"}},
      {"global_aux_jitter",
       {"--moe-router-load-balancing-type", "aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2", "1e-2",
        "--moe-input-jitter-eps", "0.05"}},
  };
  for (const auto& [name, extra] : cases) {
    const auto cpu = train(dir.path, name + "_cpu", extra, "cpu");
    const auto cuda = train(dir.path, name + "_cuda", extra);
    expect_losses_close(cuda, cpu, 1e-4, name + " cuda vs cpu");
  }
}

TEST(MoePretrainGpu, Fp64RouterIsRefusedAtStartUp) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  ScratchDir dir("moe_pretrain_fp64");
  RunResult r = run(with(with({bin("pretrain_gpt")}, kMixtral), {"--device", "cuda", "--moe-router-dtype", "fp64"}),
                    dir.path, "");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--moe-router-dtype fp64 runs on the CPU only"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace megatron::testing
