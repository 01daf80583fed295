// The device memory pool's statistics and its trim (Megatron's mem-reserved-bytes and
// --empty-unused-memory-level): freed blocks stay reserved in the pool until empty_cache gives
// them back to the driver.
#include <gtest/gtest.h>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/tensor.h"

namespace megatron {
namespace {

TEST(MemoryPoolGpu, ReservedHoldsFreedBlocksUntilEmptyCache) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  empty_cache(gpu);
  const MemoryStats before = memory_stats(gpu);
  EXPECT_GE(before.reserved, before.allocated);
  {
    Tensor t = Tensor::empty({64 << 20}, DType::Float32, gpu);  // 256 MiB
    const MemoryStats during = memory_stats(gpu);
    EXPECT_GE(during.allocated, before.allocated + (size_t(256) << 20));
    EXPECT_GE(during.reserved, during.allocated);
  }
  const MemoryStats freed = memory_stats(gpu);
  EXPECT_EQ(freed.allocated, before.allocated);
  EXPECT_GE(freed.reserved, before.reserved + (size_t(256) << 20)) << "the pool keeps the freed block";
  empty_cache(gpu);
  const MemoryStats trimmed = memory_stats(gpu);
  EXPECT_LT(trimmed.reserved, freed.reserved);
  EXPECT_GE(trimmed.reserved, trimmed.allocated);
}

}  // namespace
}  // namespace megatron
