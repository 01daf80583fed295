// The parallel layouts over NCCL on several GPUs of one node: pretrain_gpt --nproc-per-node N (the
// TCP rendezvous, ncclCommInitRank, ncclCommSplit for every group, p2p for the pipeline, the
// overlapped bucket reductions and parameter gathers) gives the single-GPU run's losses — in fp32
// within 1e-5 relative (the layouts only reorder sums; cuBLAS picks kernels by shape), in bf16
// within 1e-2. Layouts that need more GPUs than the machine has are skipped. A rank that dies
// ends the job.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "megatron/runtime/device.h"
#include "tests/gpu/pretrain_run_util.h"

namespace megatron::testing {
namespace {

const std::vector<std::string> kModel = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--train-iters", "6", "--seed", "7", "--device", "cuda",
    "--split", "100,0,0", "--distributed-timeout-minutes", "2"};

struct Layout {
  std::string name;
  int gpus;
  std::vector<std::string> flags;
};

const std::vector<Layout> kLayouts = {
    {"dp2", 2, {}},
    {"dp2_distopt_overlap", 2,
     {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "40000"}},
    {"tp2", 2, {"--tensor-model-parallel-size", "2"}},
    {"tp2_sp", 2, {"--tensor-model-parallel-size", "2", "--sequence-parallel"}},
    {"pp2", 2, {"--pipeline-model-parallel-size", "2"}},
    {"pp2_interleaved", 2, {"--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"}},
    {"tp2_pp2", 4, {"--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"}},
    {"tp2_dp2_distopt", 4,
     {"--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
      "--overlap-param-gather"}},
    {"pp2_dp2_interleaved", 4,
     {"--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--use-distributed-optimizer", "--overlap-grad-reduce"}},
    {"tp2_pp2_dp2", 8,
     {"--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"}},
    {"tp4_pp2", 8, {"--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", "--sequence-parallel"}},
    {"dp8_distopt", 8, {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"}},
};

std::vector<double> losses(const fs::path& dir, const std::string& name, const std::vector<std::string>& argv) {
  return run_losses(dir, name, argv, "NCCL_NVLS_ENABLE=0", 6);
}

void check_layouts(const std::string& dtype_flag, double rel) {
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpus << " visible";
  ScratchDir dir("multi_gpu" + dtype_flag);
  std::vector<std::string> base = with({bin("pretrain_gpt")}, kModel);
  if (!dtype_flag.empty()) base.push_back(dtype_flag);
  const auto single = losses(dir.path, "single", base);
  int ran = 0;
  for (const Layout& l : kLayouts) {
    if (l.gpus > gpus) continue;
    SCOPED_TRACE(l.name);
    auto argv = with(with(base, l.flags), {"--nproc-per-node", std::to_string(l.gpus)});
    expect_losses_close(losses(dir.path, l.name, argv), single, rel, l.name + dtype_flag);
    ++ran;
  }
  std::printf("[ multi-gpu ] %d layouts on %d GPUs match the single-GPU run%s\n", ran, gpus, dtype_flag.c_str());
}

TEST(ParallelMultiGpu, EveryLayoutGivesTheSingleGpuRunFp32) { check_layouts("", 1e-5); }

TEST(ParallelMultiGpu, EveryLayoutGivesTheSingleGpuRunBf16) { check_layouts("--bf16", 1e-2); }

TEST(ParallelMultiGpu, AKilledRankEndsTheJob) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  ScratchDir dir("multi_gpu_kill");
  auto argv = with(with({bin("pretrain_gpt")}, kModel),
                   {"--tensor-model-parallel-size", "2", "--train-iters", "50", "--nproc-per-node", "2"});
  const auto start = std::chrono::steady_clock::now();
  RunResult r = run(argv, dir.path, "NCCL_NVLS_ENABLE=0 MEGATRON_FAULT_INJECT=kill-rank:1:2");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(seconds, 60.0) << r.output;
  EXPECT_EQ(r.output.find("iteration       50/"), std::string::npos) << r.output;
}

// Note [Checkpoint checksums] over NCCL: each rank's file checksums reach rank 0 through an
// all-reduce on the GPU; a resume verifies them, and a flipped byte in the second rank's file fails
// the load on both ranks (no rank left waiting), naming the file, well inside the collective timeout.
TEST(ParallelMultiGpu, CheckpointChecksumsAreGatheredAndVerified) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  ScratchDir dir("multi_gpu_checksums");
  auto base = with(with({bin("pretrain_gpt")}, kModel), {"--tensor-model-parallel-size", "2", "--nproc-per-node", "2"});
  RunResult saved = run(with(base, {"--train-iters", "3", "--save", "ckpt"}), dir.path, "NCCL_NVLS_ENABLE=0");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const nlohmann::json meta = nlohmann::json::parse(read_file(dir.path / "ckpt/iter_0000003/metadata.json"));
  ASSERT_TRUE(meta.contains("checksums")) << meta.dump().substr(0, 400);
  EXPECT_EQ(meta["checksums"]["files"].size(), 4u) << meta["checksums"].dump();
  RunResult resumed = run(with(base, {"--load", "ckpt"}), dir.path, "NCCL_NVLS_ENABLE=0");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("checksums verified"), std::string::npos) << resumed.output;
  const fs::path file = dir.path / "ckpt/iter_0000003/model_rank00001.safetensors";
  std::string bytes = read_file(file);
  bytes[bytes.size() - 5] = char(bytes[bytes.size() - 5] ^ 4);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  const auto start = std::chrono::steady_clock::now();
  RunResult corrupt = run(with(base, {"--load", "ckpt"}), dir.path, "NCCL_NVLS_ENABLE=0");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(corrupt.exit_code, 0) << corrupt.output;
  EXPECT_NE(corrupt.output.find("model_rank00001.safetensors does not match its checksum"), std::string::npos)
      << corrupt.output;
  EXPECT_LT(seconds, 60.0) << corrupt.output;
}

}  // namespace
}  // namespace megatron::testing
