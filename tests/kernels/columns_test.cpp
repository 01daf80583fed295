// ops::copy_columns (kernels/column_ops.h): copies and accumulations of column blocks between 2-D
// tensors against an explicit loop, other columns untouched, bf16 storage, and bad ranges refused.
#include <gtest/gtest.h>

#include "megatron/kernels/column_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

TEST(CopyColumns, CopiesAndAccumulatesOneBlock) {
  Context ctx;
  const Tensor src = random_tensor({5, 7}, 1);
  for (bool accumulate : {false, true}) {
    Tensor dst = random_tensor({5, 9}, 2);
    const std::vector<float> before = dst.to_floats(), s = src.to_floats();
    ops::copy_columns(ctx, src, 2, dst, 4, 3, accumulate);
    const std::vector<float> after = dst.to_floats();
    for (int64_t r = 0; r < 5; ++r)
      for (int64_t c = 0; c < 9; ++c) {
        float want = before[size_t(r * 9 + c)];
        if (c >= 4 && c < 7) want = (accumulate ? want : 0.0f) + s[size_t(r * 7 + c - 2)];
        EXPECT_EQ(after[size_t(r * 9 + c)], want) << r << ", " << c;
      }
  }
}

TEST(CopyColumns, Bf16StorageRoundsOnce) {
  Context ctx;
  const Tensor src = random_tensor({4, 6}, 3).to(DType::BFloat16);
  Tensor dst = random_tensor({4, 6}, 4).to(DType::BFloat16);
  Tensor want = dst.to(DType::Float32);
  ops::copy_columns(ctx, src.to(DType::Float32), 0, want, 0, 6, true);
  ops::copy_columns(ctx, src, 0, dst, 0, 6, true);
  EXPECT_EQ(dst.to_floats(), want.to(DType::BFloat16).to_floats());
}

TEST(CopyColumns, OutOfRangeIsRefused) {
  Context ctx;
  const Tensor src = random_tensor({3, 4}, 1);
  Tensor dst = random_tensor({3, 4}, 2), other_rows = random_tensor({2, 4}, 3);
  EXPECT_ANY_THROW(ops::copy_columns(ctx, src, 2, dst, 0, 3, false));
  EXPECT_ANY_THROW(ops::copy_columns(ctx, src, 0, dst, 2, 3, false));
  EXPECT_ANY_THROW(ops::copy_columns(ctx, src, 0, other_rows, 0, 2, false));
}

}  // namespace
}  // namespace megatron
