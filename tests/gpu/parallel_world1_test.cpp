// The parallel code path on one GPU: pretrain_gpt at world size 1 (the local one-rank group on CUDA
// tensors: no NCCL to initialise for one rank) with every parallel flag given — buckets, the
// distributed optimizer's reduce-scatter and gathers, overlap hooks — gives the plain run's losses,
// in fp32, and in bf16 with the distributed optimizer. Also launched torchrun-style (RANK/
// WORLD_SIZE/MASTER_ADDR/MASTER_PORT) and by --nproc-per-node 1. NCCL itself: nccl_communicator_test
// and parallel_multi_gpu_test (2+ GPUs).
#include <gtest/gtest.h>

#include "megatron/runtime/device.h"
#include "tests/gpu/pretrain_run_util.h"

namespace megatron::testing {
namespace {

bool have_gpu() { return cuda_device_count() > 0; }

const std::vector<std::string> kModel = {
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
    "--lr", "1e-3", "--vocab-size", "1000", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--train-iters", "6", "--seed", "7", "--device", "cuda",
    "--split", "100,0,0"};
const std::vector<std::string> kAllParallelFlags = {
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "100000",
    "--distributed-backend", "nccl", "--distributed-timeout-minutes", "2", "--accumulate-allreduce-grads-in-fp32"};

std::vector<double> losses(const fs::path& dir, const std::string& name, const std::vector<std::string>& argv,
                           const std::string& env = "") {
  return run_losses(dir, name, argv, env, 6);
}

TEST(ParallelWorldSize1, EveryFlagGivesThePlainRunFp32) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  ScratchDir dir("world1_fp32");
  const auto plain = losses(dir.path, "plain", with({bin("pretrain_gpt")}, kModel));
  const auto flags = losses(dir.path, "flags", with(with({bin("pretrain_gpt")}, kModel), kAllParallelFlags));
  expect_losses_close(flags, plain, 1e-6, "all parallel flags");
  const auto torchrun = losses(dir.path, "torchrun", with({bin("pretrain_gpt")}, kModel),
                               "RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611");
  expect_losses_close(torchrun, plain, 1e-6, "torchrun environment");
  const auto nproc = losses(dir.path, "nproc", with(with({bin("pretrain_gpt")}, kModel), {"--nproc-per-node", "1"}));
  expect_losses_close(nproc, plain, 1e-6, "--nproc-per-node 1");
}

TEST(ParallelWorldSize1, DistributedOptimizerBf16GivesThePlainBf16Run) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  ScratchDir dir("world1_bf16");
  const auto plain = losses(dir.path, "plain", with(with({bin("pretrain_gpt")}, kModel), {"--bf16"}));
  const auto distopt = losses(dir.path, "distopt",
                              with(with({bin("pretrain_gpt")}, kModel), {"--bf16", "--use-distributed-optimizer",
                                                                         "--overlap-grad-reduce",
                                                                         "--overlap-param-gather"}));
  // One GPU, one data-parallel rank: the same kernels on the same values, so the same losses.
  expect_losses_close(distopt, plain, 1e-6, "bf16 distributed optimizer");
}

}  // namespace
}  // namespace megatron::testing
