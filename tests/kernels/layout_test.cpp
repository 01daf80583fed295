// transpose_01 on several dtypes and ranks.
#include <gtest/gtest.h>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TEST(Transpose01, SwapsLeadingDimensions) {
  Context ctx;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64, DType::UInt8}) {
    std::vector<int64_t> v(2 * 3 * 4);
    for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i);
    Tensor x = Tensor::from_ints(v, {2, 3, 4}, dt), out = Tensor::empty({3, 2, 4}, dt);
    cpu::transpose_01(ctx, x, out);
    std::vector<int64_t> o = out.to_ints();
    for (int64_t a = 0; a < 2; ++a)
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(o[size_t((b * 2 + a) * 4 + c)], (a * 3 + b) * 4 + c);
  }
  // Rank 2 (tokens [b, s] -> [s, b]).
  Tensor t = Tensor::from_ints({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Int32), tt = Tensor::empty({3, 2}, DType::Int32);
  cpu::transpose_01(ctx, t, tt);
  EXPECT_EQ(tt.to_ints(), (std::vector<int64_t>{1, 4, 2, 5, 3, 6}));
}

}  // namespace
}  // namespace megatron
