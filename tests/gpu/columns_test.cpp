// ops::copy_columns on CUDA against the CPU reference (kernels/column_ops.h): copies are exact and the
// accumulating form rounds once, as on the CPU, in fp32, bf16 and fp16.
#include <gtest/gtest.h>

#include "megatron/kernels/column_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TEST(CopyColumnsGpu, MatchesTheCpuExactly) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  Context cpu;
  Context gpu(Device::cuda(0));
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (bool accumulate : {false, true}) {
      const Tensor src = testing::random_tensor({300, 40}, 1).to(dt);
      Tensor want = testing::random_tensor({300, 72}, 2).to(dt);
      Tensor got = want.to(gpu.device());
      ops::copy_columns(cpu, src, 8, want, 30, 24, accumulate);
      ops::copy_columns(gpu, src.to(gpu.device()), 8, got, 30, 24, accumulate);
      gpu.synchronize();
      EXPECT_EQ(got.to(Device::cpu()).to_floats(), want.to_floats()) << to_string(dt) << " " << accumulate;
    }
  }
}

}  // namespace
}  // namespace megatron
